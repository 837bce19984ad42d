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
    /// A URL, a lease or another option cannot be used: the
    /// [`InvalidReason`] says which and why.
    #[error("invalid lock options: {reason}")]
    InvalidOptions {
        /// What is wrong with them.
        reason: InvalidReason,
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
    /// The server refused for want of a right, and changed nothing: a
    /// ZooKeeper node whose ACL does not admit this session's
    /// credentials, or a [`force_release`](crate::Locker::force_release)
    /// on PostgreSQL or MySQL by a role that may not end the holder's
    /// session. The source names the right that is missing.
    #[error("the {backend} server refused: permission denied: {source}")]
    PermissionDenied {
        /// The backend's name.
        backend: &'static str,
        /// The server's refusal, and what right it takes.
        #[source]
        source: Arc<dyn StdError + Send + Sync>,
    },
    /// [`default_locker`](crate::default_locker) was called before
    /// [`set_default_locker`](crate::set_default_locker).
    #[error("no default locker is set; call dlock_core::set_default_locker at startup")]
    NoDefaultLocker,
    /// A lock was requested outside a Tokio runtime.
    #[error("dlock locks must be taken from within a Tokio runtime")]
    NoRuntime,
    /// dlock's blocking API was called from within a Tokio runtime, where
    /// blocking the thread would stall the runtime's other tasks: use the
    /// async API there.
    #[error(
        "dlock's blocking API was called from within a Tokio runtime; use the async API there"
    )]
    InsideRuntime,
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
    /// use dlock_core::{InvalidReason, LockError, LockKey};
    ///
    /// let key = LockKey::new("partner-api")?;
    /// let err = LockError::permit_limit_mismatch(&key, 5, 3);
    /// assert!(matches!(
    ///     err,
    ///     LockError::InvalidOptions { reason: InvalidReason::PermitLimitMismatch { theirs: 5, ours: 3, .. } }
    /// ));
    /// assert!(err.to_string().contains("has 5 permits"));
    /// # Ok::<(), LockError>(())
    /// ```
    pub fn permit_limit_mismatch(key: &crate::LockKey, theirs: u32, ours: u32) -> Self {
        InvalidReason::PermitLimitMismatch {
            key: key.to_string(),
            theirs,
            ours,
        }
        .into()
    }
}

impl From<InvalidReason> for LockError {
    fn from(reason: InvalidReason) -> Self {
        LockError::InvalidOptions { reason }
    }
}

/// Why a URL, a lease or another option was refused: the reason of
/// [`LockError::InvalidOptions`].
///
/// `#[non_exhaustive]`: match the reasons you handle and keep a catch-all
/// arm. Every reason's `Display` is the sentence the error shows.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::BackendUrl, InvalidReason, LockError};
///
/// let mut url = BackendUrl::parse("etcd", "etcd://h:2379?request_timout=2s")?;
/// match url.finish(&["request_timeout"]) {
///     Err(LockError::InvalidOptions { reason: InvalidReason::UnknownParameter { name, valid, .. } }) => {
///         assert_eq!(name, "request_timout");
///         assert_eq!(valid, ["request_timeout"]);
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), LockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidReason {
    /// A backend URL that cannot be used.
    #[error("bad {backend} URL `{url}`: {problem}")]
    Url {
        /// The backend the URL is for.
        backend: &'static str,
        /// The URL, its password replaced by `***`.
        url: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A backend URL names a parameter its backend does not read.
    #[error(
        "bad {backend} URL `{url}`: unknown parameter `{name}`; the valid ones are {}",
        quoted(valid)
    )]
    UnknownParameter {
        /// The backend the URL is for.
        backend: &'static str,
        /// The URL, its password replaced by `***`.
        url: String,
        /// The parameter.
        name: String,
        /// The parameters the backend reads.
        valid: Vec<String>,
    },
    /// A URL whose scheme names no backend dlock has.
    #[error("`{url}` names no backend; use one of: {known}")]
    UnknownScheme {
        /// The URL, its password replaced by `***`.
        url: String,
        /// The schemes dlock knows.
        known: &'static str,
    },
    /// A URL whose backend this build leaves out: its cargo feature is off.
    #[error(
        "this build has no {feature} backend: turn on dlock's feature `{feature}` \
         (cargo add dlock --features {feature})"
    )]
    FeatureOff {
        /// The feature to turn on.
        feature: &'static str,
    },
    /// Text that is not a duration ([`parse_duration`](crate::parse_duration)).
    #[error(
        "malformed duration `{text}` ({problem}): write numbers with units, such as \
         \"500ms\", \"5s\" or \"1m30s\""
    )]
    Duration {
        /// The text.
        text: String,
        /// What the parser says.
        problem: String,
    },
    /// A lease outside what dlock allows.
    #[error("{}", lease_message(*lease, *min, *max))]
    Lease {
        /// The lease asked for.
        lease: std::time::Duration,
        /// The shortest lease allowed.
        min: std::time::Duration,
        /// The longest lease allowed.
        max: std::time::Duration,
    },
    /// A [`hold_at_least`](crate::LockOptions::hold_at_least) longer than
    /// the fixed lease (or than [`MAX_LEASE`](crate::MAX_LEASE)).
    #[error("hold_at_least {at_least:?} is longer than {}", match lease {
        Some(lease) => format!("the fixed lease ({lease:?})"),
        None => format!("the longest lease ({:?})", crate::MAX_LEASE),
    })]
    HoldAtLeast {
        /// The hold asked for.
        at_least: std::time::Duration,
        /// The fixed lease, if the lock has one.
        lease: Option<std::time::Duration>,
    },
    /// A [`lock_delay`](crate::LockOptions::lock_delay) over
    /// [`MAX_LOCK_DELAY`](crate::MAX_LOCK_DELAY).
    #[error("lock_delay {delay:?} is longer than {:?}", crate::MAX_LOCK_DELAY)]
    LockDelay {
        /// The delay asked for.
        delay: std::time::Duration,
    },
    /// A [`holder_note`](crate::LockOptions::holder_note) longer than
    /// [`MAX_HOLDER_NOTE`](crate::backend::MAX_HOLDER_NOTE) bytes.
    #[error("a holder note is at most {max} bytes: got {len}")]
    HolderNote {
        /// The note's length, in bytes.
        len: usize,
        /// The longest note.
        max: usize,
    },
    /// A permit count outside 1 to the limit, or a limit of 0.
    #[error(
        "a semaphore acquire takes 1 to `limit` permits of at least 1: got {count} of {limit}"
    )]
    Permits {
        /// The permits asked for.
        count: u32,
        /// The semaphore's limit.
        limit: u32,
    },
    /// A semaphore acquire names another limit than the key's holders do.
    #[error(
        "semaphore `{key}` has {theirs} permits, and this acquire says {ours}: \
         every client of a semaphore must name the same limit"
    )]
    PermitLimitMismatch {
        /// The semaphore's key.
        key: String,
        /// The limit its holders and waiters name.
        theirs: u32,
        /// The limit this acquire names.
        ours: u32,
    },
    /// `lock_all` names a key twice.
    #[error("lock_all names the key {key:?} twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// `lock_all` names no key.
    #[error("lock_all needs at least one key")]
    NoKeys,
    /// A proclaimed value longer than a leader may publish.
    #[error("a proclaimed value is at most {max} bytes, not {len}")]
    ProclaimedValueTooLong {
        /// The value's length.
        len: usize,
        /// The longest allowed.
        max: usize,
    },
    /// [`LockGuard::extend`](crate::LockGuard::extend) on a lock the
    /// watchdog renews: only a fixed lease has an end to move.
    #[error("only a fixed lease can be extended; this lock is renewed by the watchdog")]
    NotFixedLease,
    /// The election candidate resigned before it led.
    #[error("the candidate resigned")]
    Resigned,
    /// A TLS file that cannot be read or used.
    #[error("{}", tls_file_message(path.as_deref(), problem))]
    TlsFile {
        /// The file, when the problem is known to be in one.
        path: Option<std::path::PathBuf>,
        /// What is wrong.
        problem: String,
    },
    /// A backend's own check, in words.
    #[error("{0}")]
    Other(String),
}

fn quoted(names: &[String]) -> String {
    let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    names.join(", ")
}

fn tls_file_message(path: Option<&std::path::Path>, problem: &str) -> String {
    match path {
        Some(path) => format!("cannot read the TLS file `{}`: {problem}", path.display()),
        None => format!("bad TLS file: {problem}"),
    }
}

fn lease_message(
    lease: std::time::Duration,
    min: std::time::Duration,
    max: std::time::Duration,
) -> String {
    if lease < min {
        format!("a lease of {lease:?} is shorter than the minimum of {min:?}")
    } else {
        format!("a lease of {lease:?} is longer than the maximum of {max:?}")
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
