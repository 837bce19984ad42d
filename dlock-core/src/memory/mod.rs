//! `MemoryBackend`: the in-process lock server, with the full semantics of the
//! networked ones (leases that expire, FIFO waiters woken by notification,
//! fencing tokens, loss on expiry). It is the embedded default, the reference
//! model the other backends are checked against, and a test double.

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

mod list;
mod steps;

use steps::Steps;

use crate::backend::{
    wait, AcquireRequest, Acquired, Backend, Capabilities, Holder, ListPage, ListRequest,
    LossReporter, Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
};
use crate::{
    error::{LockError, LostReason, Result},
    key::LockKey,
    locker::options::MAX_LEASE,
    token::Token,
};

/// An in-process lock server.
///
/// Every clone of a `MemoryBackend` talks to the same server, the way several
/// processes talk to one Redis: lockers built on clones are independent
/// clients (each has its own reentrancy and watchdog), and they exclude each
/// other. Use it when every contender lives in one process, to run an
/// application without a lock server, or as a test double for code that
/// takes a [`Locker`](crate::Locker).
///
/// It is not a distributed lock: two processes each with a `MemoryBackend`
/// do not exclude each other.
///
/// Semantics match the networked backends: a lock's lease is counted on the
/// server's clock, an expired holder loses the lock (and its guard is told),
/// waiters are served first come, first served and woken one at a time, and
/// every acquisition gets a fencing token greater than all before it.
///
/// # Examples
///
/// ```
/// use dlock_core::{BackendExt, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let server = MemoryBackend::new();
/// let client_a = server.clone().into_locker();
/// let client_b = server.clone().into_locker();
///
/// let guard = client_a.lock("report:daily").await?;
/// assert!(client_b.try_lock("report:daily").await?.is_none());
/// guard.release().await?;
/// assert!(client_b.try_lock("report:daily").await?.is_some());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Default)]
pub struct MemoryBackend {
    server: Arc<Server>,
}

#[derive(Default)]
struct Server {
    state: Mutex<State>,
    /// Woken when a plain lock is granted or released, or its holder
    /// proclaims (see [`Backend::holder_changed`]).
    holders_changed: Notify,
}

#[derive(Default)]
struct State {
    keys: HashMap<(Kind, LockKey), Entry>,
    /// One counter for all keys: strictly increasing per key, and it survives
    /// idle keys being dropped from the map.
    fence: u64,
}

/// The three objects a key names (see [`Mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Lock,
    ReadWrite,
    Semaphore,
}

impl Kind {
    fn of(mode: Mode) -> Kind {
        match mode {
            Mode::Read | Mode::Write => Kind::ReadWrite,
            Mode::Permits { .. } => Kind::Semaphore,
            _ => Kind::Lock,
        }
    }
}

#[derive(Default)]
struct Entry {
    holders: Vec<Hold>,
    queue: VecDeque<Waiter>,
    /// A semaphore's permit limit, as its holders and waiters name it.
    limit: Option<u32>,
}

struct Hold {
    token: Token,
    mode: Mode,
    expires: Instant,
    loss: LossReporter,
    fence: u64,
    /// What the holder proclaimed (see [`Backend::proclaim`]).
    value: Option<Vec<u8>>,
    /// The note stored with the grant.
    note: Box<str>,
    granted: Instant,
}

impl Hold {
    /// The holder as [`Backend::holder`] and [`Backend::list`] show it.
    fn shown(&self, now: Instant) -> Holder {
        Holder::new(Some(self.fence), self.value.clone())
            .with_note(&*self.note)
            .with_mode(self.mode)
            .with_age(now.saturating_duration_since(self.granted))
            .with_lease_left(self.expires.saturating_duration_since(now))
    }
}

struct Waiter {
    token: Token,
    mode: Mode,
    wake: Arc<Notify>,
}

/// What the holders and the waiters granted before one take of a key, in
/// counts: decides [`admitted`](crate::backend::admitted) for the next mode in O(1), so a pass over
/// a line of `k` waiters is O(k).
#[derive(Debug, Clone, Copy, Default)]
struct Taken {
    any: bool,
    /// Something other than a read share.
    not_read: bool,
    /// Something other than permits.
    not_permits: bool,
    permits: u64,
}

impl Taken {
    fn of(modes: impl IntoIterator<Item = Mode>) -> Taken {
        let mut taken = Taken::default();
        for mode in modes {
            taken.add(mode);
        }
        taken
    }

    fn add(&mut self, mode: Mode) {
        self.any = true;
        self.not_read |= mode != Mode::Read;
        match mode {
            Mode::Permits { count, .. } => self.permits += u64::from(count),
            _ => self.not_permits = true,
        }
    }

    /// As [`admitted`](crate::backend::admitted)`(mode, what was added)`.
    fn admits(&self, mode: Mode) -> bool {
        #[cfg(test)]
        tests::ADMITS_CALLS.with(|c| c.set(c.get() + 1));
        match mode {
            Mode::Read => !self.not_read,
            Mode::Permits { count, limit } => {
                !self.not_permits && self.permits + u64::from(count) <= u64::from(limit)
            }
            _ => !self.any,
        }
    }
}

impl Entry {
    /// Drops holders whose lease has run out, telling their guards.
    fn expire(&mut self, now: Instant) {
        let before = self.holders.len();
        self.holders.retain(|h| {
            let live = h.expires > now;
            if !live {
                h.loss.report(LostReason::LeaseExpired);
            }
            live
        });
        if self.holders.len() != before {
            self.wake();
        }
    }

    /// Whether `mode` may be granted now, with nobody waiting ahead of it.
    fn admits_now(&self, mode: Mode) -> bool {
        Taken::of(self.holders.iter().map(|h| h.mode)).admits(mode)
    }

    /// Whether the waiter at `index` may be granted now: it and every
    /// waiter ahead of it (all granted first), in order. O(holders + index).
    fn admits_waiter(&self, index: usize) -> bool {
        let mut taken = Taken::of(self.holders.iter().map(|h| h.mode));
        self.queue.iter().take(index + 1).all(|w| {
            let admitted = taken.admits(w.mode);
            taken.add(w.mode);
            admitted
        })
    }

    /// Wakes every waiter that may be granted now, and the first one, which
    /// watches the holders' expiry: an expiry publishes nothing. One pass
    /// over the holders and the line.
    fn wake(&self) {
        let mut taken = Taken::of(self.holders.iter().map(|h| h.mode));
        for (index, waiter) in self.queue.iter().enumerate() {
            let admitted = taken.admits(waiter.mode);
            if index == 0 || admitted {
                waiter.wake.notify_one();
            }
            if !admitted {
                break;
            }
            taken.add(waiter.mode);
        }
    }

    fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.queue.is_empty()
    }

    /// Checks that `mode` names this semaphore's limit (the first holder or
    /// waiter sets it, until the key is idle again).
    fn check_limit(&mut self, key: &LockKey, mode: Mode) -> Result<()> {
        let Mode::Permits { limit, .. } = mode else {
            return Ok(());
        };
        match self.limit {
            Some(held) if held != limit && !self.is_idle() => {
                Err(LockError::permit_limit_mismatch(key, held, limit))
            }
            _ => {
                self.limit = Some(limit);
                Ok(())
            }
        }
    }

    /// The earliest end of a holder's lease.
    fn next_expiry(&self) -> Option<Instant> {
        self.holders.iter().map(|h| h.expires).min()
    }
}

impl State {
    fn entry(&mut self, key: &LockKey, mode: Mode) -> &mut Entry {
        self.keys.entry((Kind::of(mode), key.clone())).or_default()
    }

    fn grant(&mut self, req: &AcquireRequest<'_>, now: Instant) -> Acquired {
        self.fence += 1;
        let fence = self.fence;
        self.entry(req.key, req.mode).holders.push(Hold {
            token: *req.token,
            mode: req.mode,
            expires: now + req.lease.min(MAX_LEASE),
            loss: req.loss.clone(),
            fence,
            value: None,
            note: req.note.into(),
            granted: now,
        });
        Acquired::new(now).with_fence(fence)
    }

    fn forget_if_idle(&mut self, key: &LockKey, mode: Mode) {
        let id = (Kind::of(mode), key.clone());
        if self.keys.get(&id).is_some_and(Entry::is_idle) {
            self.keys.remove(&id);
        }
    }
}

impl MemoryBackend {
    /// A new, empty server.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wakes the holder watches if `mode` is a plain lock's.
    fn holders_changed(&self, mode: Mode) {
        if Kind::of(mode) == Kind::Lock {
            self.server.holders_changed.notify_waiters();
        }
    }

    /// The plain lock's holder of `key` now, and when its lease ends.
    fn current_holder(state: &mut State, key: &LockKey) -> Option<(Holder, Instant)> {
        let entry = state.keys.get_mut(&(Kind::Lock, key.clone()))?;
        let now = Instant::now();
        entry.expire(now);
        let hold = entry.holders.first()?;
        Some((hold.shown(now), hold.expires))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // No critical section here can panic halfway; a poisoned lock only
        // means a panic elsewhere on a thread that held it.
        self.server.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether no lock is held and nobody waits, on any key. Expired holders
    /// count as gone.
    ///
    /// Useful in tests, to check that nothing was left behind.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let server = MemoryBackend::new();
    /// let guard = server.clone().into_locker().lock("k").await?;
    /// assert!(!server.is_idle());
    /// guard.release().await?;
    /// assert!(server.is_idle());
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_idle(&self) -> bool {
        let now = Instant::now();
        let mut state = self.state();
        state.keys.values_mut().for_each(|e| e.expire(now));
        state.keys.retain(|_, e| !e.is_idle());
        state.keys.is_empty()
    }
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("MemoryBackend");
        match self.server.state.try_lock() {
            Ok(state) => d.field("keys", &state.keys.len()),
            Err(_) => d.field("keys", &format_args!("<locked>")),
        };
        d.finish()
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .forced_release(true)
            .fencing(true)
            .fifo(true)
            .read_write(true)
            .semaphores(true)
            .server_leases(true)
    }

    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        wait::drive(&Steps(self), &req).await
    }

    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        let mut state = self.state();
        let Some(entry) = state.keys.get_mut(&(Kind::of(mode), key.clone())) else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        entry.expire(Instant::now());
        let before = entry.holders.len();
        entry.holders.retain(|h| h.token != *token);
        let outcome = if entry.holders.len() < before {
            entry.wake();
            self.holders_changed(mode);
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        };
        state.forget_if_idle(key, mode);
        Ok(outcome)
    }

    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        let now = Instant::now();
        let mut state = self.state();
        let outcomes = locks
            .iter()
            .map(
                |r| match state.keys.get_mut(&(Kind::of(r.mode), r.key.clone())) {
                    Some(entry) => {
                        entry.expire(now);
                        match entry.holders.iter_mut().find(|h| h.token == r.token) {
                            Some(h) => {
                                let expires = now + r.lease.min(MAX_LEASE);
                                let sooner = expires < h.expires;
                                h.expires = expires;
                                if sooner {
                                    // The head of the line waits for the
                                    // old end: tell it of the new one.
                                    entry.wake();
                                }
                                RenewOutcome::Renewed
                            }
                            None => RenewOutcome::NotHeld,
                        }
                    }
                    None => RenewOutcome::NotHeld,
                },
            )
            .collect();
        for r in locks {
            state.forget_if_idle(&r.key, r.mode);
        }
        Ok(outcomes)
    }

    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        let mut state = self.state();
        let Some(entry) = state.keys.get_mut(&(Kind::Lock, key.clone())) else {
            return Ok(false);
        };
        entry.expire(Instant::now());
        let hold = entry.holders.iter_mut().find(|h| h.token == *token);
        let written = hold.map(|h| h.value = Some(value.to_vec())).is_some();
        if written {
            self.holders_changed(Mode::Exclusive);
        }
        Ok(written)
    }

    /// A renewal: it sets the holder's end.
    async fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(Instant, Duration)>> {
        crate::backend::extend_by_renewal(self, key, mode, token, lease).await
    }

    /// The holders' permits, once the expired are gone.
    async fn permits_taken(&self, key: &LockKey, _limit: u32) -> Result<u32> {
        let mut state = self.state();
        let taken = state
            .keys
            .get_mut(&(Kind::Semaphore, key.clone()))
            .map_or(0, |entry| {
                entry.expire(Instant::now());
                let counts = entry.holders.iter().map(|h| match h.mode {
                    Mode::Permits { count, .. } => count,
                    _ => 0,
                });
                counts.sum()
            });
        Ok(taken)
    }

    /// Removes the holder at once; its guard is told at once.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let mut state = self.state();
        let Some(entry) = state.keys.get_mut(&(Kind::Lock, key.clone())) else {
            return Ok(false);
        };
        entry.expire(Instant::now());
        let removed: Vec<Hold> = entry.holders.drain(..).collect();
        for hold in &removed {
            hold.loss.report(LostReason::NotHeld);
        }
        if !removed.is_empty() {
            entry.wake();
            self.holders_changed(Mode::Exclusive);
        }
        state.forget_if_idle(key, Mode::Exclusive);
        Ok(!removed.is_empty())
    }

    /// Every key's plain lock, read-write lock and semaphore, in the
    /// order of their keys, with their waiters.
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        let mut state = self.state();
        Ok(list::page(&mut state, &req))
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        let mut state = self.state();
        Ok(Self::current_holder(&mut state, key).map(|(holder, _)| holder))
    }

    /// Woken by every grant, release and proclaim of a plain lock (of any
    /// key: this is one process), and at the end of the holder's lease,
    /// which runs out with nobody told.
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        let woken = self.server.holders_changed.notified();
        tokio::pin!(woken);
        let ends = {
            let mut state = self.state();
            // Armed under the state lock: no change can slip between
            // this read and the wait.
            woken.as_mut().enable();
            let current = Self::current_holder(&mut state, key);
            if current.as_ref().map(|(holder, _)| holder) != seen {
                return Ok(());
            }
            current.map(|(_, ends)| ends)
        };
        match ends {
            Some(ends) => {
                tokio::select! {
                    () = woken => {}
                    () = tokio::time::sleep_until(ends) => {}
                }
            }
            None => woken.await,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::admitted;

    thread_local! {
        /// Calls of `Taken::admits` on this thread.
        pub(super) static ADMITS_CALLS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// `Taken` decides exactly as `admitted`, for every line of up to four
    /// takes of a few modes and every next mode.
    #[test]
    fn counted_takes_admit_as_the_rule_does() {
        let modes = [
            Mode::Exclusive,
            Mode::Read,
            Mode::Write,
            Mode::permits(1, 3).unwrap(),
            Mode::permits(2, 3).unwrap(),
        ];
        let mut lines: Vec<Vec<Mode>> = vec![vec![]];
        let mut last: Vec<Vec<Mode>> = vec![vec![]];
        for _ in 0..4 {
            last = last
                .iter()
                .flat_map(|l| modes.iter().map(move |m| [l.as_slice(), &[*m]].concat()))
                .collect();
            lines.extend(last.iter().cloned());
        }
        for line in &lines {
            for mode in modes {
                assert_eq!(
                    Taken::of(line.iter().copied()).admits(mode),
                    admitted(mode, line.iter().copied()),
                    "{mode:?} after {line:?}"
                );
            }
        }
    }

    /// A release's wake-up is one pass over the line: for 64 readers that
    /// may all be granted, 64 decisions (it was O(k³)).
    #[test]
    fn a_wake_up_is_one_pass_over_the_line() {
        let mut entry = Entry::default();
        for _ in 0..64 {
            entry.queue.push_back(Waiter {
                token: Token::generate(),
                mode: Mode::Read,
                wake: Arc::new(Notify::new()),
            });
        }
        ADMITS_CALLS.with(|c| c.set(0));
        entry.wake();
        let calls = ADMITS_CALLS.with(std::cell::Cell::get);
        assert_eq!(calls, 64, "decisions for one wake-up of 64 readers");
        assert!(entry.admits_waiter(63));
    }
}
