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
