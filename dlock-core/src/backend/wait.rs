//! Waiting, written once: the loop that drives a backend's wait steps.
//!
//! Every lock server offers the same few moves to a client that wants a
//! key someone else holds, and dlock's backends differ only in how they
//! make them:
//!
//! 1. **Look**: one attempt. A refused look may *stand in line*: it leaves
//!    an **entry** on the server (a ZooKeeper sequential node, an etcd key
//!    with its create revision, a Redis ticket, a SQL queue row) that
//!    keeps the waiter's place.
//! 2. **Arm**: ask to be told of a change that may admit the entry (a
//!    watch on the node ahead, a subscription), *before* looking again,
//!    so that no change falls between the look and the wait.
//! 3. **Wait for the change**: until woken, or until the next look is due
//!    anyway (a holder's lease may have run out unannounced).
//! 4. **Withdraw**: leave the line at the wait limit, so that the entry
//!    holds up nobody.
//!
//! [`WaitSteps`] is those four moves; [`drive`] is everything else: the
//! wait limit, this process's turn at the key (a backend whose line has
//! room for one waiter per process names its [`LocalTurns`] in
//! [`WaitSteps::turn`]), look-then-arm-then-look-again, the pause between
//! looks, backoff while the server fails, and withdrawal. A backend's
//! [`Backend::acquire`](super::Backend::acquire) is then
//! `drive(&steps, req).await`, and a new backend writes only its
//! protocol. This is the shape of etcd's `concurrency.Mutex` (try to
//! acquire, wait for the deletes ahead, delete on failure) and of
//! Curator's `LockInternals` (one loop, a small driver per recipe).
//!
//! **Cancellation.** Dropping the future of [`drive`] at any `.await`
//! drops the entry, and core's release of the acquisition's token (armed
//! for every acquire) takes away whatever the server holds under it. An
//! entry whose undo is not named by the token (a server session that may
//! still be granted the lock) undoes itself in its `Drop`.
//!
//! # Glossary
//!
//! - **line**: the waiters of one key on the server, in order.
//! - **entry**: one waiter's place in the line.
//! - **turn**: this process's place among its own tasks that want the
//!   same key ([`LocalTurns`]), so that one task per
//!   process stands in the server's line.

use std::{future::Future, hash::Hash, time::Duration};

use tokio::time::Instant;

use super::{AcquireRequest, Acquired, Backoff, LocalTurn, LocalTurns, Share, Wait};
use crate::{LockError, Result};

/// What one look at the server found.
#[derive(Debug)]
pub enum Look<E> {
    /// The lock is ours.
    Granted(Acquired),
    /// Not admitted.
    Refused {
        /// Our entry in the line, if the look made one (a look with an
        /// entry already keeps it).
        entry: Option<E>,
        /// The latest time to look again without being woken (a holder's
        /// lease ends then, a ticket needs refreshing); `None`: only when
        /// woken.
        again: Option<Duration>,
    },
}

/// What arming a wake-up found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Armed {
    /// Armed, and nothing can have admitted us since the last look
    /// (the arm read the server atomically with the watch): wait.
    Wait,
    /// Armed, but the server may have changed since the last look (or
    /// already did: the entry ahead is gone): look again first.
    LookAgain,
}

/// How a wait for a change ended.
#[derive(Debug)]
pub enum Woken {
    /// Something changed, or the time to look again came.
    LookAgain,
    /// The wait itself won the lock (a server-side blocking wait).
    Granted(Acquired),
}

/// A step's failure.
#[derive(Debug)]
pub enum StepError {
    /// A failure that may pass (a disconnect, a failover): the step is
    /// tried again after a backoff, within the wait limit, or for up to
    /// [`WaitSteps::unreachable_after`] without one.
    Retry(LockError),
    /// Anything else: the acquire ends with this error (core then
    /// releases the acquisition's token).
    Fatal(LockError),
}

impl StepError {
    fn into_error(self) -> LockError {
        match self {
            StepError::Retry(e) | StepError::Fatal(e) => e,
        }
    }
}

/// Where a backend's tasks take their turn at a key before they stand in
/// the server's line (see [`WaitSteps::turn`]).
#[derive(Debug)]
pub struct TurnAt<'t, K: Hash + Eq + Clone + Send + Sync + 'static> {
    /// The backend's turns.
    pub turns: &'t LocalTurns<K>,
    /// The key's name among them.
    pub key: K,
    /// What the turn shares with the process's other tasks.
    pub share: Share,
    /// Take the turn before the first look (also for one try, which then
    /// answers "not granted" at once while another task has it), rather
    /// than after the first refusal.
    pub first: bool,
}

/// A backend's wait steps, which [`drive`] runs. See the module docs.
pub trait WaitSteps: Send + Sync {
    /// What names a key among the backend's [`LocalTurns`] (`()` for a
    /// backend without them).
    type TurnKey: Hash + Eq + Clone + Send + Sync + 'static;

    /// A waiter's place in the line; dropping it must leave nothing the
    /// acquisition's token would not release.
    type Entry: Send;
    /// What [`arm`](WaitSteps::arm) leaves for
    /// [`changed`](WaitSteps::changed) to wait on.
    type Wake: Send;

    /// One look. `entry` is our place in line, if we have one; a refused
    /// look without one stands in line if `join` (and answers the new
    /// entry), and otherwise leaves nothing behind.
    fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut Self::Entry>,
        join: bool,
    ) -> impl Future<Output = Result<Look<Self::Entry>, StepError>> + Send;

    /// Asks to be told of a change that may admit `entry`. `wake` is what
    /// the last arm left (`None` before the first, and after each
    /// [`changed`](WaitSteps::changed) that used it up): keep it, replace
    /// it, or set it.
    ///
    /// The default arms nothing and answers [`Armed::Wait`]: for an entry
    /// that hears every change since the look that made it or last
    /// looked (a listener made atomically with the look).
    fn arm(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Self::Entry,
        wake: &mut Option<Self::Wake>,
    ) -> impl Future<Output = Result<Armed, StepError>> + Send {
        let _ = (req, entry, wake);
        std::future::ready(Ok(Armed::Wait))
    }

    /// Waits for the change `wake` was armed for, until `until` at the
    /// latest. Set `*wake` to `None` if it was used up (a one-shot watch).
    fn changed(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Self::Entry,
        wake: &mut Option<Self::Wake>,
        until: Instant,
    ) -> impl Future<Output = Result<Woken, StepError>> + Send;

    /// Leaves the line, at the wait limit. The default drops the entry,
    /// for an entry whose `Drop` leaves the line (or that holds no place
    /// on the server).
    fn withdraw(
        &self,
        req: &AcquireRequest<'_>,
        entry: Self::Entry,
    ) -> impl Future<Output = Result<(), StepError>> + Send {
        let _ = req;
        drop(entry);
        std::future::ready(Ok(()))
    }

    /// How long failures may go on, with no wait limit, before the
    /// acquire gives up with the last one.
    fn unreachable_after(&self) -> Duration;

    /// Where this process's tasks take their turn at `req`'s key before
    /// one of them stands in the server's line (`None`, the default: every
    /// task stands in line itself). Without a turn, a refused look does
    /// not join the line (`join` is `false`) until the task has it.
    fn turn(&self, req: &AcquireRequest<'_>) -> Option<TurnAt<'_, Self::TurnKey>> {
        let _ = req;
        None
    }

    /// Takes the turn of a granted acquisition: keep it as long as the
    /// lock (the default drops it, which lets the next task of this
    /// process stand in line).
    fn keep_turn(&self, req: &AcquireRequest<'_>, turn: LocalTurn<Self::TurnKey>) {
        let _ = (req, turn);
    }

    /// The longest wait for a change between two looks
    /// ([`LOOK_AGAIN_WITHIN`], the default). `None` for a backend whose
    /// [`changed`](WaitSteps::changed) is a wait on the server that ends
    /// by itself when the lock frees (a SQL lock wait): it then waits until
    /// the wait limit, and keeps its place in the server's queue.
    fn look_again_within(&self) -> Option<Duration> {
        Some(LOOK_AGAIN_WITHIN)
    }
}

/// The longest a waiter sleeps between two looks when neither the backend
/// nor a wake-up says when to look: a bound on what a lost notification
/// costs.
pub const LOOK_AGAIN_WITHIN: Duration = Duration::from_secs(10);

/// How many looks in a row may follow each other with no pause (each
/// [`Armed::LookAgain`]): past it, the engine pauses briefly, so that a
/// server that keeps changing cannot keep a waiter spinning.
const BACK_TO_BACK: u32 = 64;

/// The shortest pause a backend's [`Look::Refused::again`] asks for.
const SHORTEST_PAUSE: Duration = Duration::from_millis(2);

/// Runs a backend's [`WaitSteps`] for `req` to a grant (`Ok(Some)`), the
/// wait limit (`Ok(None)`, withdrawn from the line), or an error.
///
/// `Wait::No` is one look that does not stand in line. A backend whose
/// every look stands in line (it cannot ask without entering) withdraws
/// at once, as at the limit.
///
/// # Errors
///
/// The error of a [`StepError::Fatal`] step, or of the last
/// [`StepError::Retry`] one past the limit.
pub async fn drive<S: WaitSteps>(steps: &S, req: &AcquireRequest<'_>) -> Result<Option<Acquired>> {
    let deadline = req.wait.deadline();
    let join = req.wait != Wait::No;
    let past = |now: Instant| deadline.is_some_and(|d| now >= d);
    let spec = steps.turn(req);
    let mut turn = None;
    if let Some(at) = spec.as_ref().filter(|at| at.first) {
        match at.turns.take(&at.key, at.share, req.wait).await {
            Some(taken) => turn = Some(taken),
            None => return Ok(None),
        }
    }
    let mut entry: Option<S::Entry> = None;
    let mut wake: Option<S::Wake> = None;
    let mut failing = Failing::new(steps.unreachable_after());
    let mut back_to_back = 0_u32;
    loop {
        let may_join = join && (spec.is_none() || turn.is_some());
        let look = steps.look(req, entry.as_mut(), may_join).await;
        let again = match look {
            Ok(Look::Granted(acquired)) => {
                if let Some(turn) = turn {
                    steps.keep_turn(req, turn);
                }
                return Ok(Some(acquired));
            }
            Ok(Look::Refused { entry: made, again }) => {
                if made.is_some() {
                    entry = made;
                }
                // Never back to back: a backend's "look again at once"
                // still leaves a pause.
                again.map(|again| again.max(SHORTEST_PAUSE))
            }
            Err(error) => {
                failing.pause(error, deadline).await?;
                continue;
            }
        };
        if !join || past(Instant::now()) {
            return withdraw(steps, req, entry).await;
        }
        if let (Some(at), None) = (&spec, &turn) {
            // Refused: wait for this process's turn, then stand in line.
            match at.turns.take(&at.key, at.share, req.wait).await {
                Some(taken) => turn = Some(taken),
                None => return withdraw(steps, req, entry).await,
            }
            continue;
        }
        let Some(place) = entry.as_mut() else {
            // Refused without a place in line: the look was the whole
            // round; look again when due.
            failing.ended();
            let pause = again.unwrap_or(LOOK_AGAIN_WITHIN);
            sleep_until(earliest(deadline, after(pause))).await;
            continue;
        };
        match steps.arm(req, place, &mut wake).await {
            Ok(Armed::LookAgain) => {
                back_to_back += 1;
                if back_to_back >= BACK_TO_BACK {
                    back_to_back = 0;
                    sleep_until(earliest(
                        deadline,
                        Instant::now() + Duration::from_millis(10),
                    ))
                    .await;
                }
                continue;
            }
            Ok(Armed::Wait) => back_to_back = 0,
            Err(error) => {
                failing.pause(error, deadline).await?;
                continue;
            }
        }
        let within = match (again, steps.look_again_within()) {
            (Some(again), Some(most)) => Some(again.min(most)),
            (again, most) => again.or(most),
        };
        let until = match within {
            Some(within) => earliest(deadline, after(within)),
            None => deadline.unwrap_or_else(far_future),
        };
        match steps.changed(req, place, &mut wake, until).await {
            Ok(Woken::Granted(acquired)) => {
                if let Some(turn) = turn {
                    steps.keep_turn(req, turn);
                }
                return Ok(Some(acquired));
            }
            // A whole round (look, arm, wait) answered: failures that
            // came before it are over. (A look that answers while its arm
            // or wait keeps failing does not end them.)
            Ok(Woken::LookAgain) => failing.ended(),
            Err(error) => failing.pause(error, deadline).await?,
        }
    }
}

/// Leaves the line (if we stand in it) and answers "not granted".
async fn withdraw<S: WaitSteps>(
    steps: &S,
    req: &AcquireRequest<'_>,
    entry: Option<S::Entry>,
) -> Result<Option<Acquired>> {
    if let Some(entry) = entry {
        steps
            .withdraw(req, entry)
            .await
            .map_err(StepError::into_error)?;
    }
    Ok(None)
}

/// The earlier of a deadline (if any) and `at`.
fn earliest(deadline: Option<Instant>, at: Instant) -> Instant {
    deadline.map_or(at, |d| d.min(at))
}

/// An instant no wait reaches: about thirty years from now.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

/// `pause` from now, or [`far_future`] for a pause longer than that.
fn after(pause: Duration) -> Instant {
    Instant::now()
        .checked_add(pause)
        .map_or_else(far_future, |at| at.min(far_future()))
}

async fn sleep_until(at: Instant) {
    tokio::time::sleep_until(at).await;
}

/// Failures in a row, and the backoff between them.
struct Failing {
    since: Option<Instant>,
    backoff: Backoff,
    unreachable_after: Duration,
}

impl Failing {
    fn new(unreachable_after: Duration) -> Failing {
        Failing {
            since: None,
            backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(500)),
            unreachable_after,
        }
    }

    /// A step answered.
    fn ended(&mut self) {
        if self.since.take().is_some() {
            self.backoff.reset();
        }
    }

    /// After a failed step: the pause before trying again, or the error
    /// if it is fatal or the time to try again is up.
    async fn pause(&mut self, error: StepError, deadline: Option<Instant>) -> Result<()> {
        let error = match error {
            StepError::Fatal(error) => return Err(error),
            StepError::Retry(error) => error,
        };
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        let give_up = deadline.unwrap_or(since + self.unreachable_after);
        let delay = self.backoff.next_delay();
        if now + delay >= give_up {
            return Err(error);
        }
        tracing::debug!(%error, ?delay, "dlock: a wait step failed; trying again");
        tokio::time::sleep(delay).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicU32, Ordering},
        Mutex,
    };

    use super::*;
    use crate::{backend::Mode, LockKey, Token};

    /// Steps that refuse `refusals` looks, failing each of the first
    /// `failures` of them first, then grant; they count what they were
    /// asked.
    #[derive(Default)]
    struct Scripted {
        refusals: u32,
        failures: u32,
        looks: AtomicU32,
        arms: AtomicU32,
        withdrawn: AtomicU32,
        log: Mutex<Vec<&'static str>>,
        /// Looks that were allowed to join the line.
        joined: AtomicU32,
        /// The turns to take after the first refusal, if any.
        turns: Option<LocalTurns<()>>,
        /// What a refusal says of the next look.
        again: Option<Duration>,
        /// Every arm fails (with a retry).
        arm_fails: bool,
    }

    impl WaitSteps for Scripted {
        type Entry = ();
        type Wake = ();
        type TurnKey = ();

        async fn look(
            &self,
            _req: &AcquireRequest<'_>,
            entry: Option<&mut ()>,
            join: bool,
        ) -> std::result::Result<Look<()>, StepError> {
            let n = self.looks.fetch_add(1, Ordering::SeqCst);
            self.joined.fetch_add(u32::from(join), Ordering::SeqCst);
            self.log.lock().unwrap().push("look");
            if n < self.failures {
                return Err(StepError::Retry(LockError::backend(
                    "test",
                    std::io::Error::other("down"),
                )));
            }
            if n < self.refusals {
                let entry = (entry.is_none() && join).then_some(());
                return Ok(Look::Refused {
                    entry,
                    again: self.again,
                });
            }
            Ok(Look::Granted(Acquired::new(Instant::now())))
        }

        async fn arm(
            &self,
            _req: &AcquireRequest<'_>,
            _entry: &mut (),
            wake: &mut Option<()>,
        ) -> std::result::Result<Armed, StepError> {
            self.arms.fetch_add(1, Ordering::SeqCst);
            self.log.lock().unwrap().push("arm");
            if self.arm_fails {
                return Err(StepError::Retry(LockError::backend(
                    "test",
                    std::io::Error::other("no watch"),
                )));
            }
            // The first arm asks for a look before the wait.
            Ok(if wake.replace(()).is_none() {
                Armed::LookAgain
            } else {
                Armed::Wait
            })
        }

        async fn changed(
            &self,
            _req: &AcquireRequest<'_>,
            _entry: &mut (),
            _wake: &mut Option<()>,
            until: Instant,
        ) -> std::result::Result<Woken, StepError> {
            self.log.lock().unwrap().push("wait");
            tokio::time::sleep_until(until.min(Instant::now() + Duration::from_millis(5))).await;
            Ok(Woken::LookAgain)
        }

        async fn withdraw(
            &self,
            _req: &AcquireRequest<'_>,
            _entry: (),
        ) -> std::result::Result<(), StepError> {
            self.withdrawn.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        fn unreachable_after(&self) -> Duration {
            Duration::from_secs(2)
        }

        fn turn(&self, _req: &AcquireRequest<'_>) -> Option<TurnAt<'_, ()>> {
            self.turns.as_ref().map(|turns| TurnAt {
                turns,
                key: (),
                share: Share::Alone,
                first: false,
            })
        }
    }

    async fn run(steps: &Scripted, wait: Wait) -> Result<Option<Acquired>> {
        let key = LockKey::new("k").unwrap();
        let token = Token::generate();
        let lease = crate::locker::lease::LeaseState::new(key.clone(), "test", false);
        let req = AcquireRequest {
            key: &key,
            mode: Mode::Exclusive,
            token: &token,
            lease: Duration::from_secs(10),
            lease_kind: super::super::LeaseKind::Watchdog,
            wait,
            loss: crate::locker::lease::LossReporter(std::sync::Arc::new(lease)),
            fair: None,
            note: "",
            delay: Duration::ZERO,
        };
        drive(steps, &req).await
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_waiter_arms_then_looks_again_before_it_waits() {
        let steps = Scripted {
            refusals: 3,
            ..Scripted::default()
        };
        assert!(run(&steps, Wait::Forever).await.unwrap().is_some());
        assert_eq!(
            *steps.log.lock().unwrap(),
            ["look", "arm", "look", "arm", "wait", "look", "arm", "wait", "look"]
        );
        assert_eq!(steps.withdrawn.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_task_joins_the_line_only_with_its_turn() {
        let steps = std::sync::Arc::new(Scripted {
            refusals: 3,
            turns: Some(LocalTurns::new()),
            ..Scripted::default()
        });
        let held = steps.turns.as_ref().unwrap();
        let other = held.take(&(), Share::Alone, Wait::No).await.unwrap();
        let waiter = tokio::spawn({
            let steps = steps.clone();
            async move { run(&steps, Wait::Forever).await }
        });
        tokio::time::sleep(Duration::from_secs(30)).await;
        // One look, which did not join, then a wait for the turn.
        assert_eq!(steps.looks.load(Ordering::SeqCst), 1);
        assert_eq!(steps.joined.load(Ordering::SeqCst), 0);
        drop(other);
        assert!(waiter.await.unwrap().unwrap().is_some());
        assert_eq!(steps.joined.load(Ordering::SeqCst), 3);
        assert!(steps.turns.as_ref().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn one_try_looks_once_and_waits_for_nothing() {
        let steps = Scripted {
            refusals: u32::MAX,
            ..Scripted::default()
        };
        assert!(run(&steps, Wait::No).await.unwrap().is_none());
        assert_eq!(steps.looks.load(Ordering::SeqCst), 1);
        assert_eq!(steps.arms.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_limit_withdraws_after_one_last_look() {
        let steps = Scripted {
            refusals: u32::MAX,
            ..Scripted::default()
        };
        let deadline = Instant::now() + Duration::from_millis(100);
        assert!(run(&steps, Wait::Until(deadline)).await.unwrap().is_none());
        assert!(Instant::now() >= deadline);
        assert_eq!(steps.withdrawn.load(Ordering::SeqCst), 1);
        assert_eq!(steps.log.lock().unwrap().last(), Some(&"look"));
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_retried_with_backoff_and_given_up_on() {
        let passing = Scripted {
            failures: 3,
            refusals: 3,
            ..Scripted::default()
        };
        let started = Instant::now();
        assert!(run(&passing, Wait::Forever).await.unwrap().is_some());
        assert!(started.elapsed() >= Duration::from_millis(60), "no backoff");
        let failing = Scripted {
            failures: u32::MAX,
            ..Scripted::default()
        };
        let started = Instant::now();
        assert!(run(&failing, Wait::Forever).await.is_err());
        let took = started.elapsed();
        assert!(took <= Duration::from_secs(2), "gave up after {took:?}");
        assert!(took >= Duration::from_secs(1), "gave up after {took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_arm_that_keeps_failing_is_given_up_on_though_looks_answer() {
        let steps = Scripted {
            refusals: u32::MAX,
            arm_fails: true,
            ..Scripted::default()
        };
        let started = Instant::now();
        assert!(run(&steps, Wait::Forever).await.is_err());
        assert!(started.elapsed() <= Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_backends_pause_is_neither_zero_nor_an_overflow() {
        let eager = Scripted {
            refusals: u32::MAX,
            again: Some(Duration::ZERO),
            ..Scripted::default()
        };
        let deadline = Instant::now() + Duration::from_millis(100);
        assert!(run(&eager, Wait::Until(deadline)).await.unwrap().is_none());
        let looks = eager.looks.load(Ordering::SeqCst);
        assert!(looks <= 60, "{looks} looks in 100 ms");
        let patient = Scripted {
            refusals: 3,
            again: Some(Duration::MAX),
            ..Scripted::default()
        };
        assert!(run(&patient, Wait::Forever).await.unwrap().is_some());
    }
}
