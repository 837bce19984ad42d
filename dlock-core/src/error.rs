//! The error type of every dlock operation, and why a held lock can be lost.

use std::{error::Error as StdError, fmt, sync::Arc, time::Duration};

/// `Result` with [`LockError`] as the default error type.
pub type Result<T, E = LockError> = std::result::Result<T, E>;

/// Everything that can go wrong when taking, holding or releasing a lock.
///
/// The enum is `#[non_exhaustive]`: match the variants you handle and keep a
/// catch-all arm. It is `Clone` so that one error can be handed to several
/// waiters, and every backend failure keeps its source for `Error::source`.
///
/// # Examples
///
/// ```
/// use dlock_core::{LockError, Locker, MemoryBackend};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let locker = Locker::new(MemoryBackend::new());
/// let _held = locker.lock("job:nightly").await.unwrap();
///
/// let other = Locker::new(locker.backend().clone());
/// match other.lock_with("job:nightly", dlock_core::LockOptions::new().wait(Duration::from_millis(10))).await {
///     Err(LockError::Timeout { key, .. }) => assert_eq!(key, "job:nightly"),
///     other => panic!("expected a timeout, got {other:?}"),
/// }
/// # }
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lock was not acquired within the wait limit.
    #[error("timed out after {waited:?} waiting for lock `{key}`")]
    Timeout {
        /// The key that was asked for.
        key: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The lock is held by another owner and the caller asked not to wait.
    #[error("lock `{key}` is held by another owner")]
    WouldBlock {
        /// The key that was asked for.
        key: String,
    },
    /// The lock was held but is no longer: the lease ran out, the server no
    /// longer knows our token, or the session ended.
    #[error("lock `{key}` was lost: {reason}")]
    Lost {
        /// The key that was lost.
        key: String,
        /// Why it was lost.
        reason: LostReason,
    },
    /// The scope this runs in already holds this key (see
    /// [Reentrancy](crate::Locker#reentrancy)), and locking a
    /// [`DistMutex`](crate::DistMutex) on it would hand out a second
    /// `&mut T`, or wait for itself.
    #[error("lock `{key}` is already held in this scope; locking the mutex again would deadlock")]
    WouldDeadlock {
        /// The key that was asked for.
        key: String,
    },
    /// The backend does not offer this kind of lock (see
    /// [`Capabilities`](crate::backend::Capabilities)).
    #[error("the {backend} backend has no {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What it lacks, such as `"read-write locks"`.
        what: &'static str,
    },
    /// The key cannot be used as a lock key.
    #[error("invalid lock key {key:?}: {reason}")]
    InvalidKey {
        /// The key, shortened to its first 64 characters when it is long.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A lease, wait limit or other option is out of range.
    #[error("invalid lock options: {reason}")]
    InvalidOptions {
        /// What is wrong with them.
        reason: String,
    },
    /// The backend failed: the server could not be reached, answered with an
    /// error, or closed the connection.
    #[error("{backend} backend error: {source}")]
    Backend {
        /// The backend's name, as [`Backend::name`](crate::backend::Backend::name) gives it.
        backend: &'static str,
        /// The underlying error.
        #[source]
        source: Arc<dyn StdError + Send + Sync>,
    },
    /// The deployment cannot hold locks safely, and the backend refused it
    /// at connect: for example a pooler in transaction pooling between a
    /// database backend and its server, which moves statements between
    /// server sessions, so that a session-level lock would sit on a
    /// session the client no longer talks to. The reason says what to
    /// change.
    #[error("the {backend} deployment cannot hold locks safely: {reason}")]
    UnsafeDeployment {
        /// The backend's name.
        backend: &'static str,
        /// What is unsafe, and what to change.
        reason: String,
    },
    /// [`default_locker`](crate::default_locker) was called before
    /// [`set_default_locker`](crate::set_default_locker).
    #[error("no default locker is set; call dlock_core::set_default_locker at startup")]
    NoDefaultLocker,
    /// A lock was requested outside a Tokio runtime.
    #[error("dlock locks must be taken from within a Tokio runtime")]
    NoRuntime,
}

impl LockError {
    /// Wraps a backend's error.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::LockError;
    ///
    /// let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
    /// let err = LockError::backend("redis", io);
    /// assert!(matches!(err, LockError::Backend { backend: "redis", .. }));
    /// assert!(std::error::Error::source(&err).is_some());
    /// ```
    pub fn backend(backend: &'static str, source: impl StdError + Send + Sync + 'static) -> Self {
        LockError::Backend {
            backend,
            source: Arc::new(source),
        }
    }

    /// Builds [`LockError::InvalidKey`], shortening a long key for the message.
    pub(crate) fn invalid_key(key: &str, reason: &'static str) -> Self {
        const SHOWN: usize = 64;
        let shown = match key.char_indices().nth(SHOWN) {
            Some((cut, _)) => format!("{}…", &key[..cut]),
            None => key.to_owned(),
        };
        LockError::InvalidKey { key: shown, reason }
    }

    /// Builds the [`LockError::InvalidOptions`] for a semaphore acquire that
    /// names `ours` permits where the key's holders and waiters name
    /// `theirs`: every client of one semaphore must name the same limit.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{LockError, LockKey};
    ///
    /// let key = LockKey::new("partner-api")?;
    /// let err = LockError::permit_limit_mismatch(&key, 5, 3);
    /// assert!(matches!(err, LockError::InvalidOptions { .. }));
    /// assert!(err.to_string().contains("has 5 permits"));
    /// # Ok::<(), LockError>(())
    /// ```
    pub fn permit_limit_mismatch(key: &crate::LockKey, theirs: u32, ours: u32) -> Self {
        LockError::InvalidOptions {
            reason: format!(
                "semaphore `{key}` has {theirs} permits, and this acquire says {ours}: \
                 every client of a semaphore must name the same limit"
            ),
        }
    }

    pub(crate) fn invalid_options(reason: impl Into<String>) -> Self {
        LockError::InvalidOptions {
            reason: reason.into(),
        }
    }
}

/// Why a held lock was lost.
///
/// # Examples
///
/// ```
/// use dlock_core::LostReason;
///
/// assert_eq!(LostReason::LeaseExpired.to_string(), "the lease ran out before it was renewed");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The lease ran out by the holder's own clock: a fixed lease ended, or the
    /// watchdog could not renew it in time (server unreachable or too slow).
    LeaseExpired,
    /// The server no longer holds this guard's token: the key expired there
    /// or belongs to another owner now.
    NotHeld,
    /// The backend's session that kept the lock alive ended (an etcd lease
    /// or a ZooKeeper session expired).
    SessionExpired,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::LeaseExpired => "the lease ran out before it was renewed",
            LostReason::NotHeld => "the server no longer holds this owner's token",
            LostReason::SessionExpired => "the backend session that kept the lock ended",
        })
    }
}
