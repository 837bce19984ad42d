//! `LockGuard` and the hold it shares with its re-entered siblings: the hold
//! releases the lock, through its own token, when the last guard goes.

use std::{fmt, sync::Arc};

use tokio::{runtime::Handle, time::Instant};
use tracing::Instrument;

use crate::{
    backend::{Mode, ReleaseOutcome},
    error::{LockError, LostReason, Result},
    key::LockKey,
    locker::lease::LeaseState,
    locker::release::{release_traced, settle, spawn_release, Release, ReleaseOnDrop, Sent},
    locker::shared::Shared,
    token::Token,
};

/// What a guard knows about its lock; see [`LockGuard::state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HoldState {
    /// The lock is held.
    Held,
    /// The backend is disconnected and cannot tell; the lock is held until
    /// its lease ends by the guard's own clock.
    Unsure,
    /// The lock is lost.
    Lost,
}

/// One acquisition: shared by the guard that took it and every guard that
/// re-entered it. Dropping the last of them releases the lock.
pub(crate) struct Hold {
    pub(crate) shared: Arc<Shared>,
    pub(crate) key: LockKey,
    mode: Mode,
    token: Token,
    fence: Option<u64>,
    lease: Arc<LeaseState>,
    watchdog_id: Option<u64>,
    /// Whether the lease is fixed (see [`LockGuard::extend`]).
    fixed: bool,
    /// When the backend answered with the grant.
    answered: Instant,
    /// Until when a release leaves the lock held
    /// ([`LockOptions::hold_at_least`](crate::LockOptions::hold_at_least)):
    /// set once the guard is the caller's, so that a grant given back
    /// unused (a dropped `lock_all`, a lease over before the answer) is
    /// released at once.
    until: std::sync::OnceLock<Instant>,
    /// One extension at a time: their answers then arrive in the order
    /// the server applied them, and the last one sets the lease.
    extending: tokio::sync::Mutex<()>,
    runtime: Handle,
    span: tracing::Span,
    /// Whether dropping the hold releases the lock on the server.
    armed: bool,
}

impl Hold {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: &Arc<Shared>,
        key: LockKey,
        mode: Mode,
        token: Token,
        fence: Option<u64>,
        lease: Arc<LeaseState>,
        renewed_by_watchdog: bool,
        fixed: bool,
        runtime: Handle,
    ) -> Arc<Hold> {
        let watchdog_id = renewed_by_watchdog.then(|| {
            shared
                .watchdog
                .register(key.clone(), mode, token, lease.clone(), &runtime)
        });
        let span = tracing::debug_span!(
            parent: None,
            "dlock.hold",
            key = %shared.traced(&key),
            backend = shared.backend.name(),
            fence = fence,
        );
        span.follows_from(tracing::Span::current());
        crate::metrics::held(shared.backend.name(), mode, 1.0);
        Arc::new(Hold {
            shared: shared.clone(),
            key,
            mode,
            token,
            fence,
            lease,
            watchdog_id,
            fixed,
            answered: Instant::now(),
            until: std::sync::OnceLock::new(),
            extending: tokio::sync::Mutex::new(()),
            runtime,
            span,
            armed: true,
        })
    }

    fn release(&self) -> Release {
        Release {
            key: self.key.clone(),
            mode: self.mode,
            token: self.token,
            // Sent again after a failure for as long as the server may
            // keep the lock.
            lease: self.lease.length() + self.lease.delay(),
            until: self.until.get().copied().max(self.lost_until()),
            renewed_by: self.watchdog_id,
        }
    }

    /// Until when a release keeps a lock whose lease ran out by the
    /// holder's clock, under a [`lock_delay`](crate::LockOptions::lock_delay):
    /// a release after such a loss is no clean one, and the delay stands.
    fn lost_until(&self) -> Option<Instant> {
        self.lease.check(Instant::now());
        self.lease.delayed_until()
    }

    /// Keeps the lock, whenever it is released, until `at_least` after the
    /// backend's answer (which came after the server's grant); a hold's
    /// first setting stays.
    pub(crate) fn hold_at_least(&self, at_least: std::time::Duration) {
        let _ = self.until.set(self.answered + at_least);
    }

    /// Whether this is a plain (exclusive) hold of `key` taken through
    /// `shared`'s locker: the only kind a scope re-enters.
    pub(crate) fn is_of(&self, shared: &Arc<Shared>, key: &LockKey) -> bool {
        self.is_on(shared, key) && self.mode == Mode::Exclusive
    }

    /// Whether this is a hold of `key`, in any mode, through `shared`'s
    /// locker.
    pub(crate) fn is_on(&self, shared: &Arc<Shared>, key: &LockKey) -> bool {
        Arc::ptr_eq(&self.shared, shared) && self.key == *key
    }

    /// What this hold takes of its key.
    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        crate::metrics::held(self.shared.backend.name(), self.mode, -1.0);
        self.lease.mark_released();
        if let Some(id) = self.watchdog_id {
            self.shared.watchdog.unregister(id);
        }
        if self.armed {
            spawn_release(
                &self.runtime,
                self.shared.clone(),
                self.release(),
                Sent::No,
                self.span.clone(),
            );
        }
    }
}

/// Proof that a distributed lock is held.
///
/// Returned by [`Locker::lock`](crate::Locker::lock) and friends. The lock is
/// held until the guard (and every guard that re-entered it) is dropped or
/// [released](LockGuard::release).
///
/// # Release on drop is not immediate
///
/// Dropping a guard cannot wait for the server, so it schedules the release,
/// through this guard's own token, on the Tokio runtime the lock was acquired
/// on; it reaches the server a moment later. If that runtime has shut down,
/// the lock stays until its lease expires on the server. Call
/// [`release`](LockGuard::release) to release now and see the result, and
/// [`Locker::wait_for_releases`](crate::Locker::wait_for_releases) before a
/// process exits (guards dropped by `#[distributed_lock]` bodies included).
///
/// # Losing the lock
///
/// A distributed lock can be lost while its guard lives: the watchdog could
/// not renew the lease in time, a fixed lease ran out, or the server ended
/// the session. Check [`is_lost`](LockGuard::is_lost) before a write that
/// must not happen without the lock, race [`lost`](LockGuard::lost) against
/// the work, and pass [`fencing_token`](LockGuard::fencing_token) to stores
/// that can reject stale writers.
///
/// # Examples
///
/// ```
/// use dlock_core::{Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let guard = locker.lock("stock:42").await?;
/// let fence = guard.fencing_token().expect("the memory backend gives fencing tokens");
/// tokio::select! {
///     _ = guard.lost() => { /* stop: someone else may hold the lock now */ }
///     _ = async { /* write, passing `fence` to the store */ } => {}
/// }
/// guard.release().await?;
/// # let _ = fence;
/// # Ok(())
/// # }
/// ```
#[must_use = "if unused the lock will immediately unlock"]
#[clippy::has_significant_drop]
pub struct LockGuard {
    hold: Arc<Hold>,
}

impl LockGuard {
    pub(crate) fn fresh(hold: Arc<Hold>) -> Result<LockGuard> {
        // A lease that ran out before the answer arrived is lost already:
        // never hand out a guard that could let two owners work at once.
        if let Some(reason) = hold.lease.check(Instant::now()) {
            return Err(LockError::Lost {
                key: hold.key.to_string(),
                reason,
            });
        }
        Ok(LockGuard { hold })
    }

    pub(crate) fn reentered(hold: Arc<Hold>) -> Result<LockGuard> {
        tracing::trace!(key = %hold.shared.traced(&hold.key), "dlock lock re-entered");
        Self::fresh(hold)
    }

    /// Another guard of the same hold (as re-entering gives).
    pub(crate) fn sibling(&self) -> LockGuard {
        LockGuard {
            hold: self.hold.clone(),
        }
    }

    /// The acquisition this guard shares.
    pub(crate) fn hold(&self) -> &Arc<Hold> {
        &self.hold
    }

    /// The key this guard holds.
    pub fn key(&self) -> &str {
        self.hold.key.as_str()
    }

    /// What this guard holds of its key: the whole key, a read or write
    /// share, or permits.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{backend::Mode, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// assert_eq!(locker.read("config").await?.mode(), Mode::Read);
    /// # Ok(())
    /// # }
    /// ```
    pub fn mode(&self) -> Mode {
        self.hold.mode()
    }

    /// The fencing token of this acquisition: greater than that of every
    /// earlier acquisition of the same key. `None` when the backend, in its
    /// mode, cannot guarantee that (see its docs), rather than a number that
    /// could go backwards.
    ///
    /// A writer's token fences like a plain lock's. A reader's is greater
    /// than every earlier writer's of the key, and a permit's than every
    /// earlier permit's; since readers and permits hold together, their
    /// tokens order acquisitions but do not prove that the holder is alone.
    ///
    /// Guards that re-entered a hold share its token.
    pub fn fencing_token(&self) -> Option<u64> {
        self.hold.fence
    }

    /// The owner token the server stores with the lock.
    pub fn token(&self) -> &Token {
        &self.hold.token
    }

    /// Whether the lock has been lost (see [Losing the lock](LockGuard#losing-the-lock)).
    /// Once `true`, always `true`.
    pub fn is_lost(&self) -> bool {
        self.hold.lease.is_lost()
    }

    /// Held, lost, or unsure: the backend is cut off from its server and
    /// cannot tell yet (the lock is still held by the guard's own clock,
    /// and becomes lost if the server is not reached in time).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{HoldState, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let guard = locker.lock("k").await?;
    /// assert_eq!(guard.state(), HoldState::Held);
    /// # Ok(())
    /// # }
    /// ```
    pub fn state(&self) -> HoldState {
        if self.hold.lease.is_lost() {
            HoldState::Lost
        } else if self.hold.lease.is_unsure() {
            HoldState::Unsure
        } else {
            HoldState::Held
        }
    }

    /// Completes when the lock is lost, with the reason: no later than the
    /// moment another owner could acquire it, by this process's clock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: use it in `select!`.
    pub async fn lost(&self) -> LostReason {
        self.hold.lease.lost().await
    }

    /// Moves the end of a fixed lease: the lock now lasts `lease` from
    /// when the server sees the request, earlier or later than before.
    /// The server checks that this guard's token still holds the lock in
    /// the same step, so a lock lost meanwhile is never taken back. Guards
    /// that re-entered this hold share its lease.
    ///
    /// A lock the watchdog renews needs none of this.
    ///
    /// # Errors
    ///
    /// - [`LockError::InvalidOptions`] for a lock renewed by the watchdog
    ///   ([`InvalidReason::NotFixedLease`](crate::InvalidReason::NotFixedLease)),
    ///   or a lease out of range;
    /// - [`LockError::Lost`] if the lock was lost before, or the server
    ///   says the token no longer holds it (the guard is then lost too);
    /// - [`LockError::Backend`] if the server could not be asked: the
    ///   lease may have moved or not, and the guard counts with the
    ///   earlier of the two ends.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropped before the answer (or failing), the lease may
    /// have moved on the server or not; the guard counts with the earlier
    /// of its old end and the new one.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_core::{Locker, LockOptions, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let options = LockOptions::new().lease(Duration::from_secs(5));
    /// let guard = locker.lock_with("import", options).await?;
    /// // The import runs longer than planned.
    /// guard.extend(Duration::from_secs(60)).await?;
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn extend(&self, lease: std::time::Duration) -> Result<()> {
        let hold = &self.hold;
        if !hold.fixed {
            return Err(crate::InvalidReason::NotFixedLease.into());
        }
        crate::locker::options::validate_lease(lease, crate::locker::options::MIN_LEASE)?;
        let _one_at_a_time = hold.extending.lock().await;
        let lost = |reason| LockError::Lost {
            key: hold.key.to_string(),
            reason,
        };
        if let Some(reason) = hold.lease.check(Instant::now()) {
            return Err(lost(reason));
        }
        // A shorter lease may take effect on the server though its answer
        // is lost: the guard counts with it from now on.
        let lease = lease + hold.lease.delay();
        hold.lease.cap(Instant::now(), lease);
        let backend = &hold.shared.backend;
        let until = backend
            .extend(&hold.key, hold.mode, &hold.token, lease)
            .instrument(hold.span.clone())
            .await?;
        let Some((sent, length)) = until else {
            hold.lease.mark_lost(LostReason::NotHeld);
            return Err(lost(
                hold.lease
                    .check(Instant::now())
                    .unwrap_or(LostReason::NotHeld),
            ));
        };
        if hold.lease.reset(sent, length) {
            Ok(())
        } else {
            Err(lost(
                hold.lease
                    .check(Instant::now())
                    .unwrap_or(LostReason::LeaseExpired),
            ))
        }
    }

    /// Releases the lock now and reports the result.
    ///
    /// If other guards re-entered the same hold, this one is dropped and the
    /// lock stays held until the last of them goes.
    ///
    /// # Errors
    ///
    /// - [`LockError::Lost`] if the lock had been lost (the work done under
    ///   it may have overlapped with another owner's);
    /// - [`LockError::Backend`] if the server could not be told. The release
    ///   is then sent again in the background, with backoff, until the
    ///   server answers; if a whole lease passes first, the backend gives
    ///   the lock up to expire (see
    ///   [`Backend::abandon`](crate::backend::Backend::abandon)).
    ///   [`Locker::wait_for_releases`](crate::Locker::wait_for_releases)
    ///   waits for these retries.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the release runs to completion on the runtime even if
    /// this future is dropped.
    pub async fn release(self) -> Result<()> {
        let key = self.hold.key.clone();
        let lost = |reason| LockError::Lost {
            key: key.to_string(),
            reason,
        };
        let lost_already = self.hold.lease.check(Instant::now());
        let Some(mut hold) = Arc::into_inner(self.hold) else {
            // Re-entered guards still hold the lock; report a loss all the same.
            return lost_already.map_or(Ok(()), |reason| Err(lost(reason)));
        };
        hold.armed = false;
        let (runtime, shared, release) =
            (hold.runtime.clone(), hold.shared.clone(), hold.release());
        let backend = shared.backend.clone();
        let span = hold.span.clone();
        drop(hold);
        // Release inline; if this future is dropped before the server
        // answers, the release is sent again from a task of its own.
        let mut pending = ReleaseOnDrop {
            runtime: &runtime,
            shared: &shared,
            release: release.clone(),
            armed: true,
        };
        settle(&shared, &release).await;
        let outcome = release_traced(&*backend, &release)
            .instrument(span.clone())
            .await;
        pending.armed = false;
        if outcome.is_err() {
            // The caller hears of the failure; the release is still sent
            // again in the background until it is answered.
            spawn_release(&runtime, shared.clone(), release, Sent::Failed, span);
        }
        match (lost_already, outcome?) {
            (Some(reason), _) => Err(lost(reason)),
            (None, ReleaseOutcome::NotHeld) => Err(lost(LostReason::NotHeld)),
            (None, ReleaseOutcome::Released) => Ok(()),
        }
    }

    /// Forgets the guard without releasing the lock: the watchdog stops, and
    /// the lock stays held on the server until its lease runs out.
    ///
    /// If other guards re-entered the same hold, the lock is released when
    /// the last of them goes, as usual.
    pub fn leak(self) {
        if let Some(mut hold) = Arc::into_inner(self.hold) {
            hold.armed = false;
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.hold.key)
            .field("fence", &self.hold.fence)
            .field("lost", &self.is_lost())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn guard_is_send_and_sync() {
        assert_send_sync::<LockGuard>();
    }
}
