//! Asking a holder to let go: a release request is a lock of its own on
//! a request key that names the key and the grant asked
//! (`release-request:{fence}:{key}`, or `any` for a grant whose fencing
//! token cannot be read), held by the asker's [`ReleaseRequest`] for at
//! most [`RELEASE_REQUEST_LIFE`]. The holder hears of it only if it
//! listens ([`LockGuard::release_requested`],
//! [`Leadership::release_requested`]), and decides: nothing is released
//! for it. The `release-request:` prefix is dlock's.

use std::time::Duration;

use crate::{
    backend::{key_hash, DynBackend},
    error::Result,
    key::LockKey,
    locker::{guard::LockGuard, options::LockOptions, Locker},
    primitives::election::Leadership,
};

/// The longest a release request stands, even if its asker keeps it.
pub const RELEASE_REQUEST_LIFE: Duration = Duration::from_secs(30);

/// Where the locks of release requests live: dlock's, and left out of a
/// [`Locker::list`](crate::Locker::list) whose prefix is not of them.
pub(crate) const REQUEST_PREFIX: &str = "release-request:";

/// The lock a request to let go of `key`'s grant `fence` is held on
/// (`None`: whatever grant holds it). A key too long to be named in full
/// is named by its hash.
fn request_key(key: &LockKey, fence: Option<u64>) -> Result<LockKey> {
    let grant = fence.map_or_else(|| "any".to_owned(), |fence| fence.to_string());
    LockKey::new(format!("{REQUEST_PREFIX}{grant}:{key}")).or_else(|_| {
        LockKey::new(format!(
            "{REQUEST_PREFIX}{grant}:#{:016x}",
            key_hash("", key.as_str())
        ))
    })
}

/// A release request, standing while this lives (at most
/// [`RELEASE_REQUEST_LIFE`]): dropping it withdraws it. From
/// [`Locker::request_release`].
#[derive(Debug)]
pub struct ReleaseRequest {
    locker: Locker,
    key: LockKey,
    /// The grant asked, if its fencing token could be read.
    asked: Option<u64>,
    /// Our request's lock: `None` where another asker's request for the
    /// same grant stands already.
    request: Option<LockGuard>,
}

impl ReleaseRequest {
    /// Withdraws the request and waits until it is (dropping it withdraws
    /// it in the background).
    ///
    /// # Errors
    ///
    /// The backend's errors; a request whose life ended already is
    /// withdrawn all the same.
    pub async fn withdraw(mut self) -> Result<()> {
        match self.request.take() {
            Some(request) => match request.release().await {
                Err(crate::LockError::Lost { .. }) => Ok(()),
                other => other,
            },
            None => Ok(()),
        }
    }

    /// Completes when the grant asked no longer holds the key: it let go
    /// (or lost it). Where the grant's fencing token cannot be read
    /// (PostgreSQL, MySQL), when the key is seen free, which a waiter that
    /// takes it at once can hide: bound the wait.
    ///
    /// # Errors
    ///
    /// The backend's errors.
    pub async fn answered(&self) -> Result<()> {
        let backend = &*self.locker.shared.backend;
        loop {
            let holder = backend.holder(&self.key).await?;
            let same = holder
                .as_ref()
                .is_some_and(|h| self.asked.is_none() || h.fence() == self.asked);
            if !same {
                return Ok(());
            }
            // Not every backend tells of a plain release (Redis tells
            // only of a proclaimed holder's): look again within a poll.
            let changed = backend.holder_changed(&self.key, holder.as_ref());
            if let Ok(changed) = tokio::time::timeout(crate::backend::HOLDER_POLL, changed).await {
                changed?;
            }
        }
    }
}

impl Locker {
    /// Asks whoever holds `key`'s plain lock to let go: `None` if nobody
    /// holds it. The request names the grant it asks (by its fencing
    /// token), so the next holder is not asked too; where a holder's
    /// fencing token cannot be read (PostgreSQL and MySQL, until it
    /// proclaims a value), it asks whoever holds the key while it stands.
    /// It stands while the [`ReleaseRequest`] lives, for at most
    /// [`RELEASE_REQUEST_LIFE`]; keep it until
    /// [`answered`](ReleaseRequest::answered). The holder decides: it hears
    /// of the request only if it listens ([`LockGuard::release_requested`]),
    /// and keeps its lock until it releases.
    ///
    /// # Errors
    ///
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) where the
    /// backend cannot say who holds a key (Redlock, Redis with
    /// `fence=off`); [`LockError::InvalidKey`](crate::LockError::InvalidKey);
    /// the backend's errors. (Keys that start with `release-request:` are
    /// dlock's own.)
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
    /// let request = operator.request_release("exporter").await?.expect("held");
    /// guard.release_requested().await?; // the worker hears it ...
    /// assert!(!guard.is_lost()); // ... and decides when to let go
    /// guard.release().await?;
    /// request.answered().await?; // the asker sees it let go
    /// # Ok(())
    /// # }
    /// ```
    pub async fn request_release(&self, key: impl AsRef<str>) -> Result<Option<ReleaseRequest>> {
        self.request_release_of(LockKey::new(key.as_ref())?).await
    }

    /// Asks the leader of the election `name` to step down, as
    /// [`request_release`](Locker::request_release) asks a holder: its
    /// [`Leadership::release_requested`] completes; it decides (by
    /// resigning) whether and when.
    ///
    /// # Errors
    ///
    /// As [`request_release`](Locker::request_release).
    pub async fn request_step_down(&self, name: impl AsRef<str>) -> Result<Option<ReleaseRequest>> {
        let key = crate::primitives::election::election_key(name.as_ref())?;
        self.request_release_of(key).await
    }

    async fn request_release_of(&self, key: LockKey) -> Result<Option<ReleaseRequest>> {
        let Some(holder) = self.shared.backend.holder(&key).await? else {
            return Ok(None);
        };
        let asked = holder.fence();
        let request = request_key(&key, asked)?;
        let options = LockOptions::new().lease(RELEASE_REQUEST_LIFE);
        // Held already: another asker's request for this grant stands.
        let ours = self.try_lock_with(request.as_str(), options).await?;
        if let Some(ours) = &ours {
            // Proclaimed, so that listeners whose backend wakes them on a
            // holder's value (Redis) hear of it.
            let backend = &self.shared.backend;
            if !backend.proclaim(&request, ours.token(), b"").await? {
                return Err(crate::LockError::Lost {
                    key: request.to_string(),
                    reason: crate::LostReason::NotHeld,
                });
            }
        }
        Ok(Some(ReleaseRequest {
            locker: self.clone(),
            key,
            asked,
            request: ours,
        }))
    }
}

/// Completes once a release request names the grant of `key` with
/// `fence`, or whatever grant holds it.
pub(crate) async fn requested(
    backend: &dyn DynBackend,
    key: &LockKey,
    fence: Option<u64>,
) -> Result<()> {
    let any = request_key(key, None)?;
    let mine = fence
        .map(|fence| request_key(key, Some(fence)))
        .transpose()?;
    loop {
        if backend.holder(&any).await?.is_some() {
            return Ok(());
        }
        let Some(mine) = &mine else {
            backend.holder_changed(&any, None).await?;
            continue;
        };
        if backend.holder(mine).await?.is_some() {
            return Ok(());
        }
        tokio::select! {
            changed = backend.holder_changed(&any, None) => changed?,
            changed = backend.holder_changed(mine, None) => changed?,
        }
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
    /// let request = deployer.request_step_down("scheduler").await?.expect("a leader");
    /// leadership.release_requested().await?;
    /// election.resign().await?; // hand over: another candidate leads next
    /// request.answered().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn release_requested(&self) -> Result<()> {
        let (key, backend) = self.held_on();
        requested(&*backend, key, Some(self.term())).await
    }
}
