//! Acquiring: the wait steps core's engine
//! ([`dlock_core::backend::wait`]) runs over `flock`.
//!
//! A look is one non-blocking attempt. The wait is a blocking `flock` on
//! a thread of its own, woken by the kernel, that wins the lock itself
//! ([`Woken::Granted`]); nothing can interrupt it, so a wait whose acquire
//! left (the limit, or a dropped future) stays blocked until the lock is
//! free, then unlocks at once. Past [`MAX_WAIT_THREADS`] waiting threads,
//! waits poll instead.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, LazyLock, Mutex,
    },
    time::Duration,
};

use dlock_core::{
    backend::{
        wait::{Armed, Look, StepError, WaitSteps, Woken},
        AcquireRequest, Acquired, Backoff, LeaseKind, Mode,
    },
    LockError, LockKey, Result, MAX_LEASE,
};
use tokio::{
    sync::oneshot::{self, error::TryRecvError},
    time::Instant,
};

use super::{
    lock,
    locks::{self, Gate, Held, Plan},
    FileBackend, Owned,
};
use crate::NAME;

/// The most permits a semaphore may have: a slot file each.
pub(crate) const MAX_PERMITS: u32 = 1_024;

/// The most waits blocked on threads of their own at once, in this
/// process; further waits poll instead.
const MAX_WAIT_THREADS: usize = 256;

static WAIT_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Per object (its main file), how many waits of this process were left by
/// their callers and are still blocked in `flock`: each will take the
/// lock for a moment when it is freed, and unlock it at once.
static ABANDONED: LazyLock<Mutex<HashMap<PathBuf, usize>>> = LazyLock::new(Default::default);

fn abandoned_waits(path: &Path) -> usize {
    lock(&ABANDONED).get(path).copied().unwrap_or(0)
}

fn count_abandoned(path: &Path, up: bool) {
    let mut counts = lock(&ABANDONED);
    let n = counts.entry(path.to_path_buf()).or_default();
    *n = if up { *n + 1 } else { n.saturating_sub(1) };
    if *n == 0 {
        counts.remove(path);
    }
}

/// The file backend's wait steps.
pub(super) struct Steps<'a>(pub(super) &'a FileBackend);

/// A waiter between looks.
pub(super) struct Entry {
    plan: Plan,
    /// A writer's gate, held from its first attempt so that no reader
    /// slips in before it (moved into its wait thread while one runs).
    gate: Option<Gate>,
    /// The thread blocked in `flock` for us, if one runs.
    thread: Option<WaitThread>,
    /// The pause between polls, when no thread could be had.
    polls: Backoff,
}

impl WaitSteps for Steps<'_> {
    type TurnKey = ();
    type Entry = Entry;
    type Wake = ();

    /// One attempt; with a wait thread running, whether it won.
    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut Entry>,
        join: bool,
    ) -> std::result::Result<Look<Entry>, StepError> {
        let held = match entry {
            None => {
                let plan = self
                    .0
                    .plan(req.key, req.mode, req.note)
                    .map_err(StepError::Fatal)?;
                let (held, gate) = attempt(&plan, req.key, None, join, 25).await?;
                if held.is_none() && join {
                    let polls = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
                    let entry = Entry {
                        plan,
                        gate,
                        thread: None,
                        polls,
                    };
                    return Ok(Look::Refused {
                        entry: Some(entry),
                        again: None,
                    });
                }
                held
            }
            Some(entry) => match entry.thread.as_mut() {
                Some(thread) => match thread.answer.as_mut().map(|rx| rx.try_recv()) {
                    None | Some(Err(TryRecvError::Empty)) => None,
                    Some(answer) => answered(&mut entry.thread, answer)?,
                },
                None => {
                    let (held, gate) =
                        attempt(&entry.plan, req.key, entry.gate.take(), true, 1).await?;
                    entry.gate = gate;
                    held
                }
            },
        };
        Ok(match held {
            Some(held) => Look::Granted(self.0.granted(req, held)),
            None => Look::Refused {
                entry: None,
                again: None,
            },
        })
    }

    /// Starts the wait thread, unless one runs (or none can be had): a
    /// lock freed meanwhile is won by its first `flock`.
    async fn arm(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Entry,
        _wake: &mut Option<()>,
    ) -> std::result::Result<Armed, StepError> {
        if entry.thread.is_none() {
            entry.thread = WaitThread::start(&entry.plan, req.key, &mut entry.gate);
        }
        Ok(Armed::Wait)
    }

    /// The wait thread's grant, or its answer until `until`; without a
    /// thread, the next poll's pause.
    async fn changed(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Entry,
        _wake: &mut Option<()>,
        until: Instant,
    ) -> std::result::Result<Woken, StepError> {
        let Some(rx) = entry.thread.as_mut().and_then(|t| t.answer.as_mut()) else {
            let pause = entry.polls.next_delay();
            tokio::time::sleep_until(until.min(Instant::now() + pause)).await;
            return Ok(Woken::LookAgain);
        };
        let Ok(answer) = tokio::time::timeout_at(until, rx).await else {
            // Not yet: the thread waits on.
            return Ok(Woken::LookAgain);
        };
        Ok(match answered(&mut entry.thread, answer)? {
            Some(held) => Woken::Granted(self.0.granted(req, held)),
            None => Woken::LookAgain,
        })
    }

    /// Lets the gate go, and the thread (it unlocks what it obtains).
    async fn withdraw(
        &self,
        _req: &AcquireRequest<'_>,
        entry: Entry,
    ) -> std::result::Result<(), StepError> {
        drop(entry);
        Ok(())
    }

    fn unreachable_after(&self) -> Duration {
        // A file operation's failure does not pass.
        Duration::ZERO
    }

    /// A thread's `flock` ends by itself when the lock frees.
    fn look_again_within(&self) -> Option<Duration> {
        None
    }
}

/// The wait thread's `answer`, which ends it.
fn answered<E>(
    thread: &mut Option<WaitThread>,
    answer: std::result::Result<Result<Option<Held>>, E>,
) -> std::result::Result<Option<Held>, StepError> {
    if let Some(mut thread) = thread.take() {
        thread.answer = None;
    }
    let panicked = |_| LockError::backend(NAME, std::io::Error::other("a wait thread panicked"));
    answer
        .map_err(panicked)
        .and_then(|answer| answer)
        .map_err(StepError::Fatal)
}

/// Up to `tries` attempts on the blocking pool, by a client that waits
/// if refused (`join`: a writer keeps its gate, taken now or given as
/// `gate`). A refusal while a wait this process abandoned may hold the
/// object for a moment is tried again after 1 ms, so that a lock freed
/// just now is not refused because of a waiter that left. Dropped before
/// it answers, its grant (or gate) is dropped with its output: unlocked.
async fn attempt(
    plan: &Plan,
    key: &LockKey,
    mut gate: Option<Gate>,
    join: bool,
    tries: u32,
) -> std::result::Result<(Option<Held>, Option<Gate>), StepError> {
    let (plan, key) = (plan.clone(), key.clone());
    let attempts = move || {
        for _ in 0..tries {
            let mut alone = None;
            let held = locks::attempt(&plan, &key, if join { &mut gate } else { &mut alone })?;
            if held.is_some() || abandoned_waits(&plan.names().main) == 0 {
                return Ok((held, gate));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok((None, gate))
    };
    tokio::task::spawn_blocking(attempts)
        .await
        .map_err(|e| LockError::backend(NAME, e))
        .and_then(|r| r)
        .map_err(StepError::Fatal)
}

impl FileBackend {
    fn plan(&self, key: &LockKey, mode: Mode, note: &str) -> Result<Plan> {
        let mut names = self.names(key, mode);
        Ok(match mode {
            Mode::Read => Plan::Read(names),
            Mode::Write => Plan::Write(names),
            Mode::Permits { count, limit } => {
                if limit > MAX_PERMITS {
                    return Err(LockError::Unsupported {
                        backend: NAME,
                        what: "semaphores of more than 1024 permits (an open file each)",
                    });
                }
                Plan::Permits {
                    names,
                    count,
                    limit,
                }
            }
            Mode::Exclusive => {
                names.note = note.into();
                Plan::Exclusive(names)
            }
            _ => {
                return Err(LockError::Unsupported {
                    backend: NAME,
                    what: "this lock mode",
                })
            }
        })
    }

    /// Records a grant, its lease ending `req.lease` after it (renewed by
    /// the watchdog, unless fixed).
    fn granted(&self, req: &AcquireRequest<'_>, held: Held) -> Acquired {
        let lease = req.lease.min(MAX_LEASE);
        let ends = held.granted.checked_add(lease).unwrap_or(held.granted);
        let acquired = Acquired::new(Instant::from_std(held.granted)).with_fence(held.fence);
        lock(&self.inner.owned).insert(
            *req.token,
            Owned {
                key: req.key.clone(),
                mode: req.mode,
                held,
                loss: req.loss.clone(),
                ends,
                fixed: req.lease_kind == LeaseKind::Fixed,
            },
        );
        self.inner.reaper.unpark();
        acquired
    }
}

/// A wait blocked in `flock` on a thread of its own. Dropped before it
/// answered, it tells the thread to give up, and counts an abandoned wait
/// on the object until the thread ends.
struct WaitThread {
    path: PathBuf,
    /// `None` once answered.
    answer: Option<oneshot::Receiver<Result<Option<Held>>>>,
}

impl WaitThread {
    /// A thread waiting for `plan` (with a writer's `gate`, which it takes),
    /// or `None` if none can be had (the gate is then left).
    fn start(plan: &Plan, key: &LockKey, gate: &mut Option<Gate>) -> Option<WaitThread> {
        if WAIT_THREADS.fetch_add(1, Ordering::SeqCst) >= MAX_WAIT_THREADS {
            WAIT_THREADS.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        // Moved into the thread; if none can be made, handed back.
        let gate_slot = Arc::new(Mutex::new(gate.take()));
        let path = plan.names().main.clone();
        let (tx, rx) = oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("dlock-file-wait".to_owned())
            .spawn({
                let (plan, path, key) = (plan.clone(), path.clone(), key.clone());
                let gate_slot = gate_slot.clone();
                move || {
                    let gate = lock(&gate_slot).take();
                    // A panic is an answer too, so that the counts below
                    // still come down.
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        locks::wait(&plan, &key, &|| tx.is_closed(), gate)
                    }))
                    .unwrap_or_else(|_| {
                        Err(LockError::backend(
                            NAME,
                            std::io::Error::other("a wait thread panicked"),
                        ))
                    });
                    // Sent to nobody, a grant is dropped here: unlocked.
                    if tx.send(outcome).is_err() {
                        count_abandoned(&path, false);
                    }
                    WAIT_THREADS.fetch_sub(1, Ordering::SeqCst);
                }
            });
        if spawned.is_err() {
            WAIT_THREADS.fetch_sub(1, Ordering::SeqCst);
            *gate = lock(&gate_slot).take();
            return None;
        }
        Some(WaitThread {
            path,
            answer: Some(rx),
        })
    }
}

impl Drop for WaitThread {
    fn drop(&mut self) {
        let Some(mut answer) = self.answer.take() else {
            return;
        };
        // Counted before the thread can fail to send (and count down).
        count_abandoned(&self.path, true);
        answer.close();
        if answer.try_recv().is_ok() {
            // Sent before: no thread left.
            count_abandoned(&self.path, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait left blocked in `flock` counts on its object until its
    /// thread took the freed lock and let it go.
    #[test]
    fn an_abandoned_wait_counts_until_its_thread_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let key = LockKey::new("k").unwrap();
        let names = crate::config::Names::new(dir.path(), "", &key, "lock");
        let (plan, path) = (Plan::Exclusive(names.clone()), names.main);
        let held = locks::attempt(&plan, &key, &mut None).unwrap().unwrap();
        drop(WaitThread::start(&plan, &key, &mut None).unwrap());
        assert_eq!(abandoned_waits(&path), 1);
        drop(held);
        for _ in 0..500 {
            if abandoned_waits(&path) == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(abandoned_waits(&path), 0);
        assert!(locks::attempt(&plan, &key, &mut None).unwrap().is_some());
    }
}
