//! `--backend URL`: every example runs on the embedded in-process backend by
//! default, and on any server backend given by URL.

use dlock::{LockError, Locker};

/// The URLs `--backend` accepts, for usage messages.
pub fn urls() -> &'static str {
    dlock::registry::urls()
}

/// A [`Locker`] on the backend `url` names, through [`dlock::connect`];
/// `None` or `"memory"` is the in-process backend (locks shared by this
/// process only).
///
/// Each backend is a cargo feature of the examples, passed on to dlock's:
/// `file`, `redis` and `zk` are on by default, `etcd` (its client's build needs
/// `protoc`), `postgres` and `mysql` are not; a URL of a backend left out
/// is an error that names the feature.
///
/// # Errors
///
/// [`LockError::InvalidOptions`] for an unknown scheme, a backend left
/// out, or a malformed URL; the backend's error if it cannot connect.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// let locker = dlock_examples::backend::locker(None).await?;
/// let guard = locker.lock("order:1").await?;
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
pub async fn locker(url: Option<&str>) -> Result<Locker, LockError> {
    dlock::connect(url.unwrap_or("memory")).await
}

/// Whether `url` names the in-process backend, whose locks do not reach
/// other processes.
///
/// # Examples
///
/// ```
/// use dlock_examples::backend::is_in_process;
///
/// assert!(is_in_process(None) && is_in_process(Some("memory")));
/// assert!(!is_in_process(Some("redis://127.0.0.1:6379")));
/// ```
pub fn is_in_process(url: Option<&str>) -> bool {
    url.is_none_or(|url| url == "memory")
}

/// How to show the backend `url` in output: its password replaced by
/// `***`, and `memory` when there is none. Output is copied into tickets
/// and logs, where a password must never go.
///
/// # Examples
///
/// ```
/// use dlock_examples::backend::shown;
///
/// assert_eq!(shown(None), "memory");
/// assert_eq!(shown(Some("postgres://app:s3cret@db/app")), "postgres://app:***@db/app");
/// ```
pub fn shown(url: Option<&str>) -> std::borrow::Cow<'_, str> {
    url.map_or(
        std::borrow::Cow::Borrowed("memory"),
        dlock::backend::redact_url,
    )
}
