//! Asking a holder to let go: a release request is a short lock of its
//! own on the key's request key (`release-request:{key}`), whose
//! proclaimed value names the grant it asks (its fencing token). The
//! holder hears of it only if it listens
//! ([`LockGuard::release_requested`], [`Leadership::release_requested`]),
//! and decides: nothing is released for it.

use std::time::Duration;

use crate::{
    backend::{DynBackend, Holder},
    error::Result,
    key::LockKey,
    locker::{guard::LockGuard, options::LockOptions, Locker},
    primitives::election::Leadership,
};

/// How long a release request stands: a holder that starts listening
/// later than this after it was asked does not hear it.
pub const RELEASE_REQUEST_LIFE: Duration = Duration::from_secs(30);

/// The lock a request to let go of `key` is held on.
fn request_key(key: &LockKey) -> Result<LockKey> {
    LockKey::new(format!("release-request:{key}"))
}

/// What a request names: the grant's fencing token, or `any` where the
/// holder's cannot be read.
fn grant_name(fence: Option<u64>) -> String {
    fence.map_or_else(|| "any".to_owned(), |fence| fence.to_string())
}

impl Locker {
    /// Asks whoever holds `key`'s plain lock to let go; `false` if nobody
    /// holds it. The holder decides: it hears of the request only if it
    /// listens ([`LockGuard::release_requested`]), and keeps its lock
    /// until it releases. The request names the grant it asks (by its
    /// fencing token), so the next holder is not asked too; it stands
    /// for [`RELEASE_REQUEST_LIFE`]. Where a holder's fencing token cannot
    /// be read (PostgreSQL and MySQL, until it proclaims a value), it asks
    /// whoever holds the key while it stands.
    ///
    /// # Errors
    ///
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) where the
    /// backend cannot say who holds a key (Redlock, Redis with
    /// `fence=off`); [`LockError::InvalidKey`](crate::LockError::InvalidKey);
    /// the backend's errors; [`LockError::Timeout`](crate::LockError::Timeout)
    /// if another request for another grant still stands after 5 s.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let server = MemoryBackend::new();
    /// let (worker, operator) = (server.clone().into_locker(), server.into_locker());
    /// let guard = worker.lock("exporter").await?;
    /// assert!(operator.request_release("exporter").await?);
    /// guard.release_requested().await?; // the worker hears it ...
    /// assert!(!guard.is_lost()); // ... and decides when to let go
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn request_release(&self, key: impl AsRef<str>) -> Result<bool> {
        self.request_release_of(&LockKey::new(key.as_ref())?).await
    }

    /// Asks the leader of the election `name` to step down, as
    /// [`request_release`](Locker::request_release) asks a holder: its
    /// [`Leadership::release_requested`](crate::election::Leadership::release_requested)
    /// completes; it decides (by resigning) whether and when.
    ///
    /// # Errors
    ///
    /// As [`request_release`](Locker::request_release).
    pub async fn request_step_down(&self, name: impl AsRef<str>) -> Result<bool> {
        let key = crate::primitives::election::election_key(name.as_ref())?;
        self.request_release_of(&key).await
    }

    async fn request_release_of(&self, key: &LockKey) -> Result<bool> {
        let backend = &self.shared.backend;
        let Some(holder) = backend.holder(key).await? else {
            return Ok(false);
        };
        let asked = grant_name(holder.fence());
        let request = request_key(key)?;
        if let Some(standing) = backend.holder(&request).await? {
            if standing.value() == Some(asked.as_bytes()) {
                return Ok(true);
            }
        }
        let options = LockOptions::new()
            .lease(RELEASE_REQUEST_LIFE)
            .wait(Duration::from_secs(5));
        let guard = self.lock_with(request.as_str(), options).await?;
        backend
            .proclaim(&request, guard.token(), asked.as_bytes())
            .await?;
        // It stands until its lease ends.
        guard.leak();
        Ok(true)
    }
}

/// Completes once a release request names the grant of `key` with
/// `fence`.
pub(crate) async fn requested(
    backend: &dyn DynBackend,
    key: &LockKey,
    fence: Option<u64>,
) -> Result<()> {
    let request = request_key(key)?;
    let (mine, any) = (grant_name(fence), grant_name(None));
    loop {
        let seen = backend.holder(&request).await?;
        let asked = seen.as_ref().and_then(Holder::value);
        if asked == Some(mine.as_bytes()) || asked == Some(any.as_bytes()) {
            return Ok(());
        }
        backend.holder_changed(&request, seen.as_ref()).await?;
    }
}

impl LockGuard {
    /// Completes when someone asks this grant's holder to let go
    /// ([`Locker::request_release`]): a rolling deploy moving work off
    /// this process, an operator. Nothing is released for it: the holder
    /// decides, and keeps the lock until it releases. Costs a watch of the
    /// request key while it is polled (on PostgreSQL, MySQL and files, a
    /// read of it twice a second).
    ///
    /// # Errors
    ///
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) where the
    /// backend cannot say who holds a key, and for a read-write lock's or
    /// a semaphore's guard (requests ask plain locks' holders); the
    /// backend's errors.
    ///
    /// # Examples
    ///
    /// See [`Locker::request_release`].
    pub async fn release_requested(&self) -> Result<()> {
        let hold = self.hold();
        if hold.mode() != crate::backend::Mode::Exclusive {
            return Err(crate::LockError::Unsupported {
                backend: hold.shared.backend.name(),
                what: "release requests to read-write locks and semaphores",
            });
        }
        requested(&*hold.shared.backend, &hold.key, self.fencing_token()).await
    }
}

impl Leadership {
    /// Completes when someone asks this leader to step down
    /// ([`Locker::request_step_down`]): a rolling deploy moving the
    /// leadership elsewhere. Nothing changes for it: the leader decides,
    /// by [resigning](crate::Election::resign) when its work is at a safe point.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release_requested`].
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let server = MemoryBackend::new();
    /// let (node, deployer) = (server.clone().into_locker(), server.into_locker());
    /// let election = node.elect("scheduler")?;
    /// let leadership = election.lead().await?;
    /// assert!(deployer.request_step_down("scheduler").await?);
    /// leadership.release_requested().await?;
    /// election.resign().await?; // hand over: another candidate leads next
    /// # Ok(())
    /// # }
    /// ```
    pub async fn release_requested(&self) -> Result<()> {
        let (key, backend) = self.held_on();
        requested(&*backend, key, Some(self.term())).await
    }
}
