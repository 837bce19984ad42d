#![doc = include_str!("../README.md")]

mod backend;
mod dialect;
mod settings;
#[doc(hidden)]
pub mod testing;

pub use backend::SqlBackend;
pub use dialect::{
    ConnectOptions, Dialect, Granted, QueueEntry, Refusal, ServerSession, SessionConn,
};
pub use dlock_core::backend::key_hash;
pub use settings::{SqlConfig, SqlSettings};
/// The driver the dialects speak through.
pub use sqlx;
