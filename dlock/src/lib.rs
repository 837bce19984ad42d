#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
//!
//! # The crate
//!
//! Everything of [`dlock_core`] is here: [`Locker`], [`DistMutex`],
//! [`DistRwLock`], [`DistSemaphore`], the guards, the options, the
//! errors, [`MemoryBackend`] and [`distributed_lock`]. Each backend crate
//! is here too, under its feature: [`redis`](crate::redis) (feature
//! `redis`), `etcd`, `zk`, `postgres`, `mysql` and `file`, for what their
//! configuration types offer beyond a URL.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), dlock::LockError> {
//! let locker = dlock::connect("memory").await?;
//! let stock = dlock::DistMutex::new(&locker, "stock:42", 10_u32);
//! *stock.lock().await? -= 1;
//! # Ok(())
//! # }
//! ```
//!
//! # The guide
//!
//! The manual is [`guide`]: each primitive, the attribute, reentrancy,
//! choosing a backend, what each guarantees, and running it in
//! production, with examples that run as doctests.

use std::sync::Arc;

#[cfg(feature = "blocking")]
#[cfg_attr(docsrs, doc(cfg(feature = "blocking")))]
pub mod blocking;
pub mod guide;
pub mod registry;

pub use dlock_core::*;

#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use dlock_etcd as etcd;
#[cfg(feature = "file")]
#[cfg_attr(docsrs, doc(cfg(feature = "file")))]
pub use dlock_file as file;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use dlock_mysql as mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use dlock_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use dlock_redis as redis;
#[cfg(feature = "zk")]
#[cfg_attr(docsrs, doc(cfg(feature = "zk")))]
pub use dlock_zk as zk;

/// A [`Locker`] on the backend `url` names (see [`connect_backend`]).
///
/// # Errors
///
/// As [`connect_backend`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// let locker = dlock::connect("memory").await?;
/// let guard = locker.lock("report:daily").await?;
/// guard.release().await?;
///
/// // A scheme whose feature is off says which feature it needs.
/// # #[cfg(not(feature = "etcd"))]
/// assert!(dlock::connect("etcd://127.0.0.1:2379/locks")
///     .await
///     .unwrap_err()
///     .to_string()
///     .contains("feature `etcd`"));
/// # Ok(())
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Locker> {
    connect_backend(url).await.map(Locker::from_arc)
}

/// A new client of the backend `url` names, by its scheme: `memory` (or
/// `memory://`: a new in-process backend, whose locks reach this process
/// only), `redis://`, `redis+redlock://`, `redis+cluster://` and
/// `redis+sentinel://`, `etcd://`, `zk://`,
/// `postgres://` (or `postgresql://`), `mysql://` (or `mariadb://`),
/// `file:///absolute/dir` (this machine only). Each
/// backend's URL takes the options its config type documents.
///
/// # Errors
///
/// [`LockError::InvalidOptions`] for a scheme dlock does not know, a
/// scheme whose cargo feature is off (the message names the feature), or
/// a malformed URL; the backend's error if it cannot connect.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// use dlock::backend::Backend;
///
/// let backend = dlock::connect_backend("memory").await?;
/// assert_eq!(backend.name(), "memory");
/// assert!(matches!(
///     dlock::connect_backend("ftp://example").await,
///     Err(dlock::LockError::InvalidOptions { .. })
/// ));
/// # Ok(())
/// # }
/// ```
pub async fn connect_backend(url: &str) -> Result<Arc<dyn backend::DynBackend>> {
    match registry::for_url(url) {
        Some(backend) => backend.connect(url).await,
        None => Err(InvalidReason::UnknownScheme {
            url: backend::redact_url(url).into_owned(),
            known: registry::urls(),
        }
        .into()),
    }
}

/// The workspace README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
