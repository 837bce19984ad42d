//! One URL per backend: a client for whichever backend a URL names, so
//! that tests and helper processes switch backend without code changes.

use std::sync::Arc;

use dlock_core::{backend::DynBackend, LockError};

/// A new client of the backend `url` names: [`dlock::connect_backend`],
/// with every backend.
///
/// # Errors
///
/// [`LockError::InvalidOptions`] for another scheme or a malformed URL;
/// the backend's error if it cannot connect.
///
/// # Examples
///
/// ```no_run
/// # async fn f() -> Result<(), dlock_core::LockError> {
/// let client = dlock_testkit::connect("etcd://127.0.0.1:2379/locks").await?;
/// let locker = dlock_core::Locker::from_arc(client);
/// # Ok(())
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn DynBackend>, LockError> {
    dlock::connect_backend(url).await
}

/// Checks that `own` (a backend on the application's own client) and
/// `by_url` (one built from a URL with the same prefix) lock the same
/// keys: each excludes the other, and fencing tokens grow across both.
///
/// # Panics
///
/// When either takes a key the other holds, a fence does not grow, or a
/// call fails.
pub async fn assert_locks_are_shared(own: &dlock_core::Locker, by_url: &dlock_core::Locker) {
    let held = own
        .lock("shared")
        .await
        .expect("lock through the own client");
    assert!(
        by_url.try_lock("shared").await.expect("try_lock").is_none(),
        "the URL's client took a key held through the application's"
    );
    let first = held.fencing_token().expect("a fence");
    held.release().await.expect("release");
    let next = by_url.lock("shared").await.expect("lock through the URL");
    assert!(
        next.fencing_token().expect("a fence") > first,
        "fences went backwards"
    );
    assert!(
        own.try_lock("shared").await.expect("try_lock").is_none(),
        "the application's client took a key held through the URL's"
    );
    drop(next);
}

/// Checks that a client of each `(why, url)` is refused with a typed
/// [`LockError::Backend`] within 15 s: when `connect` connects, or (for a
/// client that connects lazily, or a server that accepts a handshake and
/// drops the connection at its first request) at its first `try_lock`.
/// For the servers' TLS tests: an untrusted server, a missing or foreign
/// client certificate, plain text to a TLS port.
///
/// # Panics
///
/// Naming `why`, when a client is not refused, refused otherwise, or late.
///
/// # Examples
///
/// ```no_run
/// # async fn f() {
/// use dlock_core::BackendExt;
///
/// let cases = [("nothing listens", "redis://127.0.0.1:1/".to_owned())];
/// dlock_testkit::assert_refused(&cases, |url| async move {
///     Ok(dlock_redis::RedisBackend::connect(&url).await?.into_locker())
/// })
/// .await;
/// # }
/// ```
pub async fn assert_refused<F, Fut>(cases: &[(&str, String)], connect: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<dlock_core::Locker, LockError>>,
{
    for (why, url) in cases {
        let started = tokio::time::Instant::now();
        let refused = match connect(url.clone()).await {
            Ok(locker) => locker.try_lock("refused").await.map(drop),
            Err(e) => Err(e),
        };
        assert!(
            matches!(refused, Err(LockError::Backend { .. })),
            "{why}: {refused:?}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(15),
            "{why}: refused only after {:?}",
            started.elapsed()
        );
    }
}
