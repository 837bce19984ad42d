#![doc = include_str!("../README.md")]

mod backend;
mod dialect;
mod settings;
#[doc(hidden)]
pub mod testing;

pub use backend::SqlBackend;
pub use dialect::{
    busy, deployment_refused, is_busy, is_session_moved, session_moved, unsafe_deployment, Busy,
    ConnectOptions, Dialect, Granted, QueueEntry, ServerSession, SessionConn, SessionMoved,
    UnsafeDeployment,
};
pub use dlock_core::backend::key_hash;
pub use settings::{SqlConfig, SqlSettings};
/// The driver the dialects speak through.
pub use sqlx;
