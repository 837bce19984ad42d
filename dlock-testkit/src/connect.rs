//! One URL per backend: a client for whichever backend a URL names, so
//! that tests and helper processes switch backend without code changes.

use std::sync::Arc;

use dlock_core::{backend::Backend, LockError};

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
pub async fn connect(url: &str) -> Result<Arc<dyn Backend>, LockError> {
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
