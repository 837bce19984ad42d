//! `MemoryBackend`: the in-process lock server, with the full semantics of the
//! networked ones (leases that expire, FIFO waiters woken by notification,
//! fencing tokens, loss on expiry). It is the embedded default, the reference
//! model the other backends are checked against, and a test double.

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::{Arc, Mutex, MutexGuard},
};

use tokio::{sync::Notify, time::Instant};

use super::{
    AcquireRequest, Acquired, Backend, BoxFuture, Capabilities, LossReporter, ReleaseOutcome,
    RenewOutcome, RenewRequest, Wait,
};
use crate::{
    error::{LostReason, Result},
    key::LockKey,
    options::MAX_LEASE,
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
}

#[derive(Default)]
struct State {
    keys: HashMap<LockKey, Entry>,
    /// One counter for all keys: strictly increasing per key, and it survives
    /// idle keys being dropped from the map.
    fence: u64,
}

#[derive(Default)]
struct Entry {
    holder: Option<Holder>,
    queue: VecDeque<Waiter>,
}

struct Holder {
    token: Token,
    expires: Instant,
    loss: LossReporter,
}

struct Waiter {
    token: Token,
    wake: Arc<Notify>,
}

impl Entry {
    /// Drops a holder whose lease has run out, telling its guard.
    fn expire(&mut self, now: Instant) {
        if self.holder.as_ref().is_some_and(|h| h.expires <= now) {
            if let Some(h) = self.holder.take() {
                h.loss.report(LostReason::LeaseExpired);
            }
            self.wake_head();
        }
    }

    /// Wakes the first waiter, to take a free lock or, if the lock is held,
    /// to watch its holder's expiry: only the head watches it.
    fn wake_head(&self) {
        if let Some(w) = self.queue.front() {
            w.wake.notify_one();
        }
    }

    fn is_idle(&self) -> bool {
        self.holder.is_none() && self.queue.is_empty()
    }
}

impl State {
    fn grant(&mut self, key: &LockKey, req: &AcquireRequest<'_>, now: Instant) -> Acquired {
        self.fence += 1;
        let entry = self.keys.entry(key.clone()).or_default();
        entry.holder = Some(Holder {
            token: *req.token,
            expires: now + req.lease.min(MAX_LEASE),
            loss: req.loss.clone(),
        });
        Acquired::new(now).with_fence(self.fence)
    }

    fn forget_if_idle(&mut self, key: &LockKey) {
        if self.keys.get(key).is_some_and(Entry::is_idle) {
            self.keys.remove(key);
        }
    }
}

impl MemoryBackend {
    /// A new, empty server.
    pub fn new() -> Self {
        Self::default()
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

    async fn acquire_waiting(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        let key = req.key;
        let wake = Arc::new(Notify::new());
        {
            let now = Instant::now();
            let mut state = self.state();
            let entry = state.keys.entry(key.clone()).or_default();
            entry.expire(now);
            if entry.is_idle() {
                return Ok(Some(state.grant(key, &req, now)));
            }
            entry.queue.push_back(Waiter {
                token: *req.token,
                wake: wake.clone(),
            });
        }
        // From here on, dropping this future (cancellation) must take us out
        // of the queue and pass the turn on.
        let mut place = QueuePlace {
            backend: self,
            key,
            token: *req.token,
            queued: true,
        };
        let deadline = req.wait.deadline();
        loop {
            let woken = wake.notified();
            let expiry = {
                let now = Instant::now();
                let mut state = self.state();
                let entry = state.keys.entry(key.clone()).or_default();
                entry.expire(now);
                let head = entry.queue.front().is_some_and(|w| w.token == *req.token);
                if head && entry.holder.is_none() {
                    entry.queue.pop_front();
                    place.queued = false;
                    let granted = state.grant(key, &req, now);
                    // The next waiter is head now, and must watch our expiry.
                    if let Some(entry) = state.keys.get(key) {
                        entry.wake_head();
                    }
                    return Ok(Some(granted));
                }
                if deadline.is_some_and(|d| now >= d) {
                    return Ok(None);
                }
                // Only the head needs to watch the holder's expiry: an expiry
                // publishes nothing, and it is the head's turn that comes.
                head.then(|| entry.holder.as_ref().map(|h| h.expires))
                    .flatten()
            };
            let until = match (expiry, deadline) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            match until {
                Some(until) => {
                    tokio::select! {
                        _ = woken => {}
                        _ = tokio::time::sleep_until(until) => {}
                    }
                }
                None => woken.await,
            }
        }
    }
}

/// A waiter's place in a key's queue, given up on drop.
struct QueuePlace<'a> {
    backend: &'a MemoryBackend,
    key: &'a LockKey,
    token: Token,
    queued: bool,
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        if !self.queued {
            return;
        }
        let mut state = self.backend.state();
        if let Some(entry) = state.keys.get_mut(self.key) {
            entry.queue.retain(|w| w.token != self.token);
            entry.expire(Instant::now());
            entry.wake_head();
        }
        state.forget_if_idle(self.key);
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
        Capabilities::new().fencing(true).fifo(true)
    }

    fn acquire<'a>(&'a self, req: AcquireRequest<'a>) -> BoxFuture<'a, Result<Option<Acquired>>> {
        Box::pin(async move {
            if req.wait != Wait::No {
                return self.acquire_waiting(req).await;
            }
            let now = Instant::now();
            let mut state = self.state();
            let entry = state.keys.entry(req.key.clone()).or_default();
            entry.expire(now);
            if entry.is_idle() {
                Ok(Some(state.grant(req.key, &req, now)))
            } else {
                Ok(None)
            }
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move {
            let mut state = self.state();
            let Some(entry) = state.keys.get_mut(key) else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            entry.expire(Instant::now());
            let outcome = if entry.holder.as_ref().is_some_and(|h| h.token == *token) {
                entry.holder = None;
                entry.wake_head();
                ReleaseOutcome::Released
            } else {
                ReleaseOutcome::NotHeld
            };
            state.forget_if_idle(key);
            Ok(outcome)
        })
    }

    fn renew<'a>(&'a self, locks: &'a [RenewRequest]) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut state = self.state();
            let outcomes = locks
                .iter()
                .map(|r| match state.keys.get_mut(&r.key) {
                    Some(entry) => {
                        entry.expire(now);
                        match &mut entry.holder {
                            Some(h) if h.token == r.token => {
                                h.expires = now + r.lease.min(MAX_LEASE);
                                RenewOutcome::Renewed
                            }
                            _ => RenewOutcome::NotHeld,
                        }
                    }
                    None => RenewOutcome::NotHeld,
                })
                .collect();
            for r in locks {
                state.forget_if_idle(&r.key);
            }
            Ok(outcomes)
        })
    }
}
