//! What every clone of a [`Locker`](crate::Locker) shares: the backend, the
//! default options, the watchdog, and the count of releases still on their
//! way to the server. Every hold keeps an `Arc` of it, so a lock outlives
//! the lockers it was taken through.
//!
//! There is no table of holds here: reentrancy is carried by the scope a
//! future runs in (see `scope.rs`), not by the locker.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use crate::{backend::DynBackend, locker::options::LockOptions, locker::watchdog::Watchdog};

pub(crate) struct Shared {
    pub(crate) backend: Arc<dyn DynBackend>,
    pub(crate) defaults: LockOptions,
    pub(crate) watchdog: Watchdog,
    pub(crate) pending: PendingReleases,
    /// Whether traces show keys (see `LockerBuilder::trace_keys`).
    pub(crate) trace_keys: bool,
}

impl Shared {
    /// `key` as this locker's traces show it.
    pub(crate) fn traced<'a>(&self, key: &'a crate::LockKey) -> crate::key::TracedKey<'a> {
        crate::key::TracedKey {
            key,
            shown: self.trace_keys,
        }
    }

    /// Counts a release as pending until the returned value is dropped.
    pub(crate) fn start_release(self: &Arc<Self>) -> PendingRelease {
        self.pending.count.fetch_add(1, Ordering::SeqCst);
        PendingRelease(self.clone())
    }
}

/// Releases scheduled by dropped guards (or abandoned steps) and not
/// answered yet.
#[derive(Debug, Default)]
pub(crate) struct PendingReleases {
    count: AtomicUsize,
    settled: tokio::sync::Notify,
}

impl PendingReleases {
    /// Completes when no release is pending.
    pub(crate) async fn settled(&self) {
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            // Registered before the count is read: a last release that ends
            // in between still wakes us.
            settled.as_mut().enable();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            settled.await;
        }
    }
}

/// One pending release; done when dropped.
pub(crate) struct PendingRelease(Arc<Shared>);

impl Drop for PendingRelease {
    fn drop(&mut self) {
        let pending = &self.0.pending;
        if pending.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            pending.settled.notify_waiters();
        }
    }
}
