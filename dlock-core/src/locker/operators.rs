//! What a locker answers without taking a lock, and the operators'
//! control: the connection state, a key's holder, a forced release.

use super::Locker;
use crate::{error::Result, key::LockKey};

impl Locker {
    /// What the backend knows of its connection to the servers, as a
    /// watch: [`Connected`](crate::ConnectionState::Connected),
    /// [`Suspended`](crate::ConnectionState::Suspended) while it cannot
    /// tell whether its leases live, [`Lost`](crate::ConnectionState::Lost)
    /// when they may be gone, then
    /// [`Reconnected`](crate::ConnectionState::Reconnected). Each backend's
    /// docs say which of its signals move it; the in-process and file
    /// backends stay `Connected`.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, ConnectionState, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let locker = MemoryBackend::new().into_locker();
    /// let mut state = locker.state();
    /// tokio::spawn(async move {
    ///     while state.changed().await.is_ok() {
    ///         if *state.borrow() == ConnectionState::Suspended {
    ///             // pause work that must not run without its lock
    ///         }
    ///     }
    /// });
    /// # }
    /// ```
    pub fn state(&self) -> tokio::sync::watch::Receiver<crate::ConnectionState> {
        self.shared.backend.connection_state()
    }

    /// Who holds `key`'s lock now, as the server says: the holder's
    /// fencing token, what it [proclaimed](crate::Election::proclaim), its
    /// [note](crate::LockOptions::holder_note), mode, age and lease left
    /// where the backend records them, or `None` if the key is free. One read: it takes no lock and waits
    /// for none, and the answer may be stale by the time it arrives.
    ///
    /// It reads the key's plain lock (what [`lock`](Locker::lock),
    /// [`DistMutex`](crate::DistMutex) and elections take), not a
    /// read-write lock's shares or a semaphore's permits. A lock this
    /// process holds is reported like any other.
    ///
    /// # Errors
    ///
    /// - [`LockError::Unsupported`](crate::LockError::Unsupported) where the backend cannot know: Redlock
    ///   (a holder read on a majority is not one holder) and Redis with
    ///   `fence=off` store no fencing token to answer with;
    /// - [`LockError::InvalidKey`](crate::LockError::InvalidKey); [`LockError::Backend`](crate::LockError::Backend) when the server
    ///   fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = MemoryBackend::new().into_locker();
    /// assert!(locker.holder("report").await?.is_none());
    /// let guard = locker.lock("report").await?;
    /// let holder = locker.holder("report").await?.expect("held");
    /// assert_eq!(holder.fence(), guard.fencing_token());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn holder(&self, key: impl AsRef<str>) -> Result<Option<crate::backend::Holder>> {
        let key = LockKey::new(key.as_ref())?;
        self.shared.backend.holder(&key).await
    }

    /// Whether anyone holds `key`'s lock now: [`holder`](Locker::holder)
    /// is `Some`. One read, no lock taken; the answer may be stale by the
    /// time it arrives, so it is for dashboards and operators, never a
    /// substitute for [`try_lock`](Locker::try_lock).
    ///
    /// # Errors
    ///
    /// As [`holder`](Locker::holder).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = MemoryBackend::new().into_locker();
    /// let guard = locker.lock("report").await?;
    /// assert!(locker.is_locked("report").await?);
    /// guard.release().await?;
    /// assert!(!locker.is_locked("report").await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn is_locked(&self, key: impl AsRef<str>) -> Result<bool> {
        Ok(self.holder(key).await?.is_some())
    }

    /// Frees `key`'s lock, whoever holds it: for operators, when a holder
    /// is stuck or gone in a way its lease does not cover. Returns whether
    /// a holder was removed. The first waiter in line gets the lock next.
    ///
    /// **Dangerous**: the holder may still be inside its critical
    /// section, and only the next holder's greater fencing token protects
    /// data from it. Its guard reports lost
    /// ([`LostReason::NotHeld`](crate::LostReason::NotHeld)); each
    /// backend's docs say how soon (see
    /// [`Backend::force_release`](crate::backend::Backend::force_release)).
    /// It frees the key's plain lock, not a read-write lock's shares or a
    /// semaphore's permits.
    ///
    /// # Errors
    ///
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) where the backend cannot take a lock
    /// from its holder (the file backend: an `flock` belongs to its
    /// process); [`LockError::PermissionDenied`](crate::LockError::PermissionDenied)
    /// where the server refuses to end the holder's session (PostgreSQL
    /// without the holder's role or `pg_signal_backend`, MySQL without
    /// `CONNECTION ADMIN`) or to delete its node (a ZooKeeper ACL);
    /// [`LockError::InvalidKey`](crate::LockError::InvalidKey); [`LockError::Backend`](crate::LockError::Backend).
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
    /// let stuck = worker.lock("nightly").await?;
    /// assert!(operator.force_release("nightly").await?);
    /// assert!(stuck.is_lost());
    /// assert!(operator.try_lock("nightly").await?.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn force_release(&self, key: impl AsRef<str>) -> Result<bool> {
        let key = LockKey::new(key.as_ref())?;
        self.shared.backend.force_release(&key).await
    }
}
