//! Releasing by token, renewing, and the thread that ends leases.
//!
//! A lease is this process's: the kernel keeps a `flock` lock for as long
//! as its file is open. The watchdog renews a lease by moving its end
//! here; a lease not renewed in time (a fixed one, or one whose runtime
//! stopped or hangs) is ended by a plain thread, not a task, so that a
//! runtime that no longer runs cannot keep its locks: the thread tells the
//! guard, then unlocks.

use std::{
    sync::{mpsc, Weak},
    thread::Thread,
    time::{Duration, Instant},
};

use dlock_core::{
    backend::{Mode, ReleaseOutcome, RenewOutcome, RenewRequest},
    LockError, LockKey, LostReason, Result, Token, MAX_LEASE,
};

use super::{lock, FileBackend, Inner};
use crate::NAME;

/// How long the lease thread sleeps with nothing to end: how soon it
/// notices that its backend is gone.
const IDLE: Duration = Duration::from_secs(1);

impl FileBackend {
    /// Releases what `token` holds of `key` in `mode`, if it does: the
    /// files are unlocked and closed before this returns.
    pub(super) fn unlock(&self, key: &LockKey, mode: Mode, token: &Token) -> ReleaseOutcome {
        let mut owned = lock(&self.inner.owned);
        if !owned
            .get(token)
            .is_some_and(|o| o.key == *key && o.mode == mode)
        {
            return ReleaseOutcome::NotHeld;
        }
        let Some(released) = owned.remove(token) else {
            return ReleaseOutcome::NotHeld;
        };
        drop(owned);
        // A guard still listens only if the release came from elsewhere.
        released.loss.report(LostReason::NotHeld);
        drop(released);
        ReleaseOutcome::Released
    }

    /// Moves the end of every watchdog lease in `locks` that its token
    /// still holds: not one whose lock file was deleted or replaced (see
    /// `Held::still_named`), which is lost.
    pub(super) fn extend(&self, locks: &[RenewRequest]) -> Vec<RenewOutcome> {
        let now = Instant::now();
        let mut owned = lock(&self.inner.owned);
        locks
            .iter()
            .map(|r| match owned.get_mut(&r.token) {
                Some(o)
                    if o.key == r.key
                        && o.mode == r.mode
                        && now < o.ends
                        && o.held.still_named() =>
                {
                    if !o.fixed {
                        let lease = r.lease.min(MAX_LEASE);
                        o.ends = o.ends.max(now.checked_add(lease).unwrap_or(now));
                    }
                    RenewOutcome::Renewed
                }
                _ => RenewOutcome::NotHeld,
            })
            .collect()
    }
}

impl FileBackend {
    /// Moves the end of `token`'s fixed lease to `lease` from now, if it
    /// still holds its lock; the lease thread looks again.
    pub(super) fn extend_fixed(
        &self,
        token: &Token,
        lease: Duration,
    ) -> Option<(tokio::time::Instant, Duration)> {
        let sent = tokio::time::Instant::now();
        let now = Instant::now();
        let lease = lease.min(MAX_LEASE);
        {
            let mut owned = lock(&self.inner.owned);
            let held = owned.get_mut(token).filter(|o| now < o.ends)?;
            held.ends = now.checked_add(lease).unwrap_or(now);
        }
        self.inner.reaper.unpark();
        Some((sent, lease))
    }
}

/// Starts the thread that ends the leases of the backend it is then sent.
pub(super) fn start_reaper() -> Result<(Thread, mpsc::Sender<Weak<Inner>>)> {
    let (tx, rx) = mpsc::channel::<Weak<Inner>>();
    let thread = std::thread::Builder::new()
        .name("dlock-file-leases".to_owned())
        .spawn(move || {
            if let Ok(backend) = rx.recv() {
                end_leases(&backend);
            }
        })
        .map_err(|e| LockError::backend(NAME, e))?;
    Ok((thread.thread().clone(), tx))
}

/// Ends each lease at its end, until the backend is gone. Each round
/// sleeps until the next end, at most [`IDLE`]; a new grant wakes it.
fn end_leases(backend: &Weak<Inner>) {
    loop {
        let Some(inner) = backend.upgrade() else {
            return;
        };
        let now = Instant::now();
        let (ended, next) = {
            let mut owned = lock(&inner.owned);
            let over: Vec<Token> = owned
                .iter()
                .filter(|(_, o)| o.ends <= now)
                .map(|(token, _)| *token)
                .collect();
            let ended: Vec<_> = over.iter().filter_map(|t| owned.remove(t)).collect();
            (ended, owned.values().map(|o| o.ends).min())
        };
        for lease in ended {
            // Told first, unlocked then: never after another could take it.
            lease.loss.report(LostReason::LeaseExpired);
            drop(lease);
        }
        drop(inner);
        let sleep = next.map_or(IDLE, |next| {
            next.saturating_duration_since(Instant::now()).min(IDLE)
        });
        std::thread::park_timeout(sleep);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The lease thread ends now rather than at its next round.
        self.reaper.unpark();
    }
}
