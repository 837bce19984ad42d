//! Distributed locks for Tokio services.
//!
//! dlock gives a Tokio program mutual exclusion across processes and
//! machines, through a lock server of your choice: Redis (single node or
//! Redlock), etcd or ZooKeeper, each in its own crate, or the in-process
//! [`MemoryBackend`] here. This crate holds everything the backends share:
//!
//! - [`Locker`]: takes locks by key (`lock`, `try_lock`, `lock_with`,
//!   `with_lock`), reentrant inside the scope of a held lock (the future
//!   that runs under it; see [Reentrancy](Locker#reentrancy));
//! - [`LockGuard`]: releases on drop through its own owner token, carries a
//!   [fencing token](LockGuard::fencing_token), and
//!   [says when the lock was lost](LockGuard::lost);
//! - [`DistMutex<T>`]: a value behind a distributed lock, used like
//!   `tokio::sync::Mutex<T>`;
//! - the [`backend::Backend`] trait every backend implements;
//! - [`distributed_lock`] (feature `macros`, on by default): an attribute
//!   that runs an async fn's body under the lock, and
//!   [`set_default_locker`] / [`default_locker`], the locker it uses unless
//!   told otherwise.
//!
//! The source has four rooms: `locker/` (the [`Locker`] and what it
//! hands out: guards, scopes, leases, the watchdog, releases, options),
//! `primitives/` (mutex, read-write lock, semaphore, election, multi-key
//! locks), [`backend`] (the trait and the kit for backend authors: URLs,
//! sessions, timers, backoff, [the wait engine](backend::wait)) and
//! `memory/` (the in-process backend).
//!
//! The manual, with a glossary of the words these docs use in a sense of
//! their own (*hold*, *scope*, *lease*, *line*, *ticket*, *turn*, ...), is
//! [`dlock::guide`](https://docs.rs/dlock/latest/dlock/guide/index.html).
//!
//! # Safety properties
//!
//! Every backend provides: at most one live guard per key at a time; a
//! crashed holder's lock ends after its lease; release and renewal compare
//! the owner token on the server; a guard reports its loss no later than
//! another owner could take the lock; fencing tokens that only grow (where a
//! backend cannot promise that, [`LockGuard::fencing_token`] is `None`);
//! cancel-safe acquisition; waiters woken by the server, not by polling; and
//! typed errors for bad input and failing servers.
//!
//! # Examples
//!
//! ```
//! use dlock_core::{DistMutex, Locker, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), dlock_core::LockError> {
//! let locker = Locker::new(MemoryBackend::new());
//!
//! // A data-less lock, reentrant inside its scope:
//! let guard = locker.lock("report:daily").await?;
//! assert!(!guard.is_lost());
//! guard.scope(async { /* locker.lock("report:daily") re-enters here */ }).await;
//! guard.release().await?;
//!
//! // A value behind a distributed lock:
//! let stock = DistMutex::new(&locker, "stock:42", 300_u32);
//! let mut left = stock.lock().await?;
//! *left -= 1;
//! # Ok(())
//! # }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
mod duration;
mod error;
mod key;
mod locker;
mod memory;
pub mod metrics;
mod primitives;
mod token;

pub use primitives::election;

pub use duration::parse_duration;
pub use error::{InvalidReason, LockError, LostReason, Result};
pub use key::LockKey;
pub use locker::builder::{BackendExt, LockerBuilder};
pub use locker::connection::ConnectionState;
pub use locker::default_locker::{default_locker, set_default_locker};
pub use locker::guard::{HoldState, LockGuard};
pub use locker::list::Listing;
pub use locker::options::{
    Lease, LockOptions, MAX_LEASE, MAX_LOCK_DELAY, MIN_LEASE, MIN_WATCHDOG_LEASE,
};
pub use locker::requests::{ReleaseRequest, RELEASE_REQUEST_LIFE};
pub use locker::scope::Scoped;
pub use locker::{Locker, DEFAULT_WATCHDOG_LEASE};
pub use memory::MemoryBackend;
pub use primitives::election::Election;
pub use primitives::multi::MultiGuard;
pub use primitives::mutex::{DistMutex, DistMutexGuard, OwnedDistMutexGuard};
pub use primitives::rwlock::{DistRwLock, DistRwLockReadGuard, DistRwLockWriteGuard};
pub use primitives::semaphore::{DistSemaphore, Permit};
pub use token::{Token, TokenHex};

#[cfg(feature = "macros")]
#[doc(inline)]
pub use dlock_macros::distributed_lock;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
