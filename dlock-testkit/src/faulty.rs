//! A backend wrapper that injects one fault: the lock is released behind
//! its holder's back as the holder first proclaims, as an operator's
//! forced unlock between a grant and the first write would.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use dlock_core::{
    backend::{
        AcquireRequest, Acquired, Backend, BoxFuture, Capabilities, Holder, Mode, ReleaseOutcome,
        RenewOutcome, RenewRequest,
    },
    LockKey, Result, Token,
};

/// Passes every call on to `inner`, except that the first
/// [`proclaim`](Backend::proclaim) releases the lock (with its own token)
/// before it is passed on, so the proclaim finds the lock not held.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use dlock_core::{Locker, MemoryBackend};
/// use dlock_testkit::ReleasedAtFirstProclaim;
///
/// let backend = ReleasedAtFirstProclaim::new(Arc::new(MemoryBackend::new()));
/// let locker = Locker::new(backend);
/// # drop(locker);
/// ```
#[derive(Debug)]
pub struct ReleasedAtFirstProclaim {
    inner: Arc<dyn Backend>,
    armed: AtomicBool,
}

impl ReleasedAtFirstProclaim {
    /// Wraps `inner`, armed for one fault.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        ReleasedAtFirstProclaim {
            inner,
            armed: AtomicBool::new(true),
        }
    }

    /// Whether the fault has been injected.
    pub fn fired(&self) -> bool {
        !self.armed.load(Ordering::SeqCst)
    }
}

impl Backend for ReleasedAtFirstProclaim {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn acquire<'a>(&'a self, req: AcquireRequest<'a>) -> BoxFuture<'a, Result<Option<Acquired>>> {
        self.inner.acquire(req)
    }

    fn release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        self.inner.release(key, mode, token)
    }

    fn renew<'a>(&'a self, locks: &'a [RenewRequest]) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        self.inner.renew(locks)
    }

    fn check_servers(&self) -> BoxFuture<'_, Result<()>> {
        self.inner.check_servers()
    }

    fn proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if self.armed.swap(false, Ordering::SeqCst) {
                self.inner.release(key, Mode::Exclusive, token).await?;
            }
            self.inner.proclaim(key, token, value).await
        })
    }

    fn holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>> {
        self.inner.holder(key)
    }

    fn holder_changed<'a>(
        &'a self,
        key: &'a LockKey,
        seen: Option<&'a Holder>,
    ) -> BoxFuture<'a, Result<()>> {
        self.inner.holder_changed(key, seen)
    }
}
