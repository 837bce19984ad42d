//! The Redis backend of dlock: distributed locks on one Redis node, or with
//! Redlock over several independent nodes.
//!
//! ```no_run
//! use dlock_core::{BackendExt, DistMutex};
//! use dlock_redis::RedisBackend;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), dlock_core::LockError> {
//! let locker = RedisBackend::connect("redis://127.0.0.1:6379/").await?.into_locker();
//! dlock_core::set_default_locker(locker.clone());
//!
//! let stock = DistMutex::new(&locker, "stock:42", 300_u32);
//! *stock.lock().await? -= 1;
//! # Ok(())
//! # }
//! ```
//!
//! See [`RedisBackend`] for how it locks, and [`RedisConfig`] for the URLs.
//! The `redis` crate is re-exported, so its version need not be matched.

mod backend;
mod config;
mod keys;
mod node;
mod scripts;
mod subscriber;

pub use backend::RedisBackend;
pub use config::RedisConfig;
pub use redis;
