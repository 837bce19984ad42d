//! A complete, minimal backend written from outside dlock: one in-process
//! map behind a `std::sync::Mutex`, with leases simulated by deadlines.
//!
//! It is teaching code for the guide "Writing a backend"
//! (`dlock-testkit/README.md`): it uses only the public API of
//! `dlock-core`, and `tests/map_backend_conformance.rs` runs the whole
//! conformance suite against it. Read it top to bottom: each trait method
//! starts with the contract it keeps. It writes no wait loop: core's wait
//! engine ([`dlock_core::backend::wait`]) runs its two steps, a look at
//! the map and a wait for the map's bell.
//!
//! What it offers: plain (exclusive) locks, fixed and watchdog leases,
//! fencing tokens, and a holder's published value (so leader elections
//! work). What it does not: read-write locks, semaphores, first come first
//! served waiters; its [`Capabilities`] say so, and the suite then checks
//! that asking for them is refused with [`LockError::Unsupported`].
//!
//! Think of [`MapBackend::new`] as starting a lock server, and of each
//! clone as a client process connected to it: clones share the map, and
//! lockers on different clones exclude each other.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use dlock_core::{
    backend::{
        wait::{drive, Look, StepError, WaitSteps, Woken},
        AcquireRequest, Acquired, Backend, Capabilities, Holder, LossReporter, Mode,
        ReleaseOutcome, RenewOutcome, RenewRequest,
    },
    LockError, LockKey, LostReason, Result, Token,
};
use tokio::{sync::watch, time::Instant};

/// A lock server that is one in-process map, and a client of it.
///
/// Every clone is another client of the same map, as processes are clients
/// of one Redis: lockers built on clones exclude each other. Locks are
/// exclusive, leases end at a deadline on the map's clock (a lock whose
/// deadline has passed is free), and every grant gets a fencing token
/// greater than all before it.
///
/// # Examples
///
/// ```
/// use dlock_core::Locker;
/// use dlock_examples::map_backend::MapBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let server = MapBackend::new();
/// let client_a = Locker::new(server.clone());
/// let client_b = Locker::new(server.clone());
///
/// let guard = client_a.lock("report:daily").await?;
/// assert!(guard.fencing_token().is_some());
/// assert!(client_b.try_lock("report:daily").await?.is_none());
/// guard.release().await?;
/// assert!(client_b.try_lock("report:daily").await?.is_some());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MapBackend {
    server: Arc<Server>,
}

/// The "server": the map, and the one bell it rings on every change.
#[derive(Debug, Default)]
struct Server {
    state: Mutex<State>,
    /// Rung whenever a lock is released or granted, or its holder
    /// publishes a value. Waiters of every key listen to it: a waiter woken
    /// for another key looks, finds its key still held, and waits again.
    /// One bell keeps the example short; a real server would notify per
    /// key. A listener made while the map is locked hears every ring after
    /// what it read.
    bell: watch::Sender<()>,
}

#[derive(Debug, Default)]
struct State {
    /// The held locks. A hold whose deadline has passed is free: whoever
    /// finds it next treats it as absent (and tells its guard).
    locks: HashMap<LockKey, Hold>,
    /// The last fencing token given. One counter for all keys: it only
    /// grows, so every key's tokens do too, even after its entry is gone.
    last_fence: u64,
}

#[derive(Debug)]
struct Hold {
    token: Token,
    deadline: Instant,
    fence: u64,
    /// How to tell the holder's guard that its lock is gone.
    loss: LossReporter,
    /// What the holder published (see [`Backend::proclaim`]).
    value: Option<Vec<u8>>,
}

impl State {
    /// The live hold of `key`, if any. An expired hold is removed here,
    /// and its guard told (the guard's own clock normally says so first).
    fn live(&mut self, key: &LockKey, now: Instant) -> Option<&mut Hold> {
        if self.locks.get(key).is_some_and(|hold| hold.deadline <= now) {
            if let Some(expired) = self.locks.remove(key) {
                expired.loss.report(LostReason::LeaseExpired);
            }
        }
        self.locks.get_mut(key)
    }

    /// Grants `req` if its key is free at `now`: the one atomic "compare
    /// and set" every acquire comes down to.
    fn try_grant(&mut self, req: &AcquireRequest<'_>, now: Instant) -> Option<Acquired> {
        if self.live(req.key, now).is_some() {
            return None;
        }
        self.last_fence += 1;
        self.locks.insert(
            req.key.clone(),
            Hold {
                token: *req.token,
                // `req.lease` is at most `MAX_LEASE` (30 days): core checks
                // every option before a backend sees it.
                deadline: now + req.lease,
                fence: self.last_fence,
                loss: req.loss.clone(),
                value: None,
            },
        );
        // The lease counts from `now`, the moment of the grant; the guard
        // counts its own from the same instant, so it never believes in a
        // lock the map has already let go.
        Some(Acquired::new(now).with_fence(self.last_fence))
    }
}

impl MapBackend {
    /// A new lock server with an empty map; clone it for more clients.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::backend::Backend;
    /// use dlock_examples::map_backend::MapBackend;
    ///
    /// let server = MapBackend::new();
    /// assert_eq!(server.name(), "map");
    /// assert!(!server.capabilities().has_read_write());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // No critical section below can panic half-way, so a poisoned
        // mutex still holds a consistent map.
        self.server
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn ring(&self) {
        self.server.bell.send_replace(());
    }
}

/// The wait, as core's engine runs it: a refused look that may wait
/// leaves a listener to the bell (its "entry" in the line, which holds no
/// place on the server), and the engine waits for a ring or for the
/// holder's deadline, then looks again. Cancel safe: a grant happens inside
/// one look, and a dropped listener leaves nothing behind.
impl WaitSteps for MapBackend {
    type TurnKey = ();
    type Entry = watch::Receiver<()>;
    type Wake = ();

    /// One attempt; refused, it says when the holder's lease ends (nobody
    /// rings for that), and listens for the bell from this very moment.
    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut watch::Receiver<()>>,
        join: bool,
    ) -> std::result::Result<Look<watch::Receiver<()>>, StepError> {
        let now = Instant::now();
        let mut state = self.state();
        if let Some(granted) = state.try_grant(req, now) {
            drop(state);
            self.ring();
            return Ok(Look::Granted(granted));
        }
        let again = state
            .live(req.key, now)
            .map(|hold| hold.deadline.saturating_duration_since(now));
        let listener = (join && entry.is_none()).then(|| self.server.bell.subscribe());
        Ok(Look::Refused {
            entry: listener,
            again,
        })
    }

    // `arm` keeps its default (nothing to arm: the listener has heard
    // every ring since the look), and so does `withdraw` (dropping the
    // listener).

    async fn changed(
        &self,
        _req: &AcquireRequest<'_>,
        entry: &mut watch::Receiver<()>,
        _wake: &mut Option<()>,
        until: Instant,
    ) -> std::result::Result<Woken, StepError> {
        // The sender lives as long as the server, so `changed` cannot fail.
        let _ = tokio::time::timeout_at(until, entry.changed()).await;
        Ok(Woken::LookAgain)
    }

    /// A map never fails for a while and then recovers.
    fn unreachable_after(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

/// The error for the modes [`MapBackend`] does not offer. Core asks only
/// for the modes [`Capabilities`] name, so this is a second line of
/// defence.
fn unsupported() -> LockError {
    LockError::Unsupported {
        backend: "map",
        what: "read-write locks or semaphores",
    }
}

impl Backend for MapBackend {
    /// A short name for errors and traces.
    fn name(&self) -> &'static str {
        "map"
    }

    /// Honest capabilities: fencing tokens, and nothing else beyond the
    /// required properties. No `fifo` (the bell wakes every waiter and the
    /// first to look wins), no `session_leases` (a lock ends at its
    /// deadline, whether or not its client lives), no `read_write`, no
    /// `semaphores`.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new().fencing(true)
    }

    /// Contract: with `Wait::No`, one attempt; otherwise wait (woken by the
    /// server, not by polling) until granted or the deadline passes.
    /// `Ok(None)` when not acquired. Cancel safe: a dropped future leaves
    /// nothing that blocks others. Core's [`drive`] does all of that with
    /// this backend's [`WaitSteps`].
    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        if req.mode != Mode::Exclusive {
            return Err(unsupported());
        }
        drive(self, &req).await
    }

    /// Contract: release `key` if, and only if, `token` holds it, in one
    /// atomic step (here: under the mutex). A token that does not hold it
    /// (never did, expired, released already, or someone else's now) gets
    /// `NotHeld` and changes nothing: core sends releases for acquires that
    /// were dropped or timed out, and may release twice.
    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        if mode != Mode::Exclusive {
            return Ok(ReleaseOutcome::NotHeld);
        }
        let released = {
            let mut state = self.state();
            let ours = state
                .live(key, Instant::now())
                .is_some_and(|hold| hold.token == *token);
            ours && state.locks.remove(key).is_some()
        };
        if !released {
            return Ok(ReleaseOutcome::NotHeld);
        }
        // Wake the waiters: one of them takes the lock now.
        self.ring();
        Ok(ReleaseOutcome::Released)
    }

    // `abandon` keeps its default (do nothing): nothing keeps a lock here
    // alive but its deadline, which passes on its own once core stops
    // renewing.

    /// Contract: for each request, in order, extend the lease (counted
    /// from now) if its token still holds the key (`Renewed`), and change
    /// nothing otherwise (`NotHeld`: core then tells the guard it lost the
    /// lock). `Err` would mean nothing is known about any of them.
    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        let now = Instant::now();
        let mut state = self.state();
        let outcomes = locks
            .iter()
            .map(|lock| {
                let live = state.live(&lock.key, now);
                match live.filter(|hold| hold.token == lock.token) {
                    Some(hold) if lock.mode == Mode::Exclusive => {
                        hold.deadline = now + lock.lease;
                        RenewOutcome::Renewed
                    }
                    _ => RenewOutcome::NotHeld,
                }
            })
            .collect();
        Ok(outcomes)
    }

    /// Contract: move the end of a fixed lease to `lease` from now, if
    /// `token` still holds the lock, in one step with that check. The
    /// renewal above does exactly that.
    async fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: std::time::Duration,
    ) -> Result<Option<(Instant, std::time::Duration)>> {
        dlock_core::backend::extend_by_renewal(self, key, mode, token, lease).await
    }

    // `check_servers` keeps its default (`Ok`): an in-process map always
    // answers.

    /// Contract: store `value` as what the holder says, if `token` holds
    /// `key` now, checked in the same atomic step as the write. The value
    /// goes with the hold (release, expiry). Returns whether it was
    /// written.
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        let written = {
            let mut state = self.state();
            match state.live(key, Instant::now()) {
                Some(hold) if hold.token == *token => {
                    hold.value = Some(value.to_vec());
                    true
                }
                _ => false,
            }
        };
        if written {
            self.ring();
        }
        Ok(written)
    }

    /// Contract: one read of who holds `key` now (its fencing token and
    /// published value), or `None` if it is free.
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        let mut state = self.state();
        let hold = state.live(key, Instant::now());
        Ok(hold.map(|hold| Holder::new(Some(hold.fence), hold.value.clone())))
    }

    /// Contract: complete once `key`'s holder may differ from `seen` (at
    /// once if it already does). It may complete when nothing changed,
    /// but must never sleep through a change: the bell is armed before
    /// the holder is read, and a lease that runs out (which nobody rings
    /// for) ends the wait at its deadline.
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        let (mut bell, ends) = {
            let mut state = self.state();
            let bell = self.server.bell.subscribe();
            let hold = state.live(key, Instant::now());
            let now = hold
                .as_ref()
                .map(|hold| Holder::new(Some(hold.fence), hold.value.clone()));
            if now.as_ref() != seen {
                return Ok(());
            }
            (bell, hold.map(|hold| hold.deadline))
        };
        match ends {
            Some(ends) => {
                let _ = tokio::time::timeout_at(ends, bell.changed()).await;
            }
            None => {
                let _ = bell.changed().await;
            }
        }
        Ok(())
    }
}
