#![doc = include_str!("../README.md")]

mod backend;
mod dialect;
mod settings;

pub use backend::SqlBackend;
pub use dialect::{
    busy, deployment_refused, is_busy, is_session_moved, session_moved, unsafe_deployment, Busy,
    Dialect, Granted, QueueEntry, ServerSession, SessionMoved, UnsafeDeployment,
};
pub use dlock_core::backend::key_hash;
pub use settings::SqlSettings;
/// The driver the dialects speak through.
pub use sqlx;

#[doc(hidden)]
pub mod __private {
    pub use dlock_core::{
        backend::{
            AcquireRequest, Acquired, Backend, BoxFuture, Capabilities, Holder, Mode,
            ReleaseOutcome, RenewOutcome, RenewRequest,
        },
        ConnectionState, LockKey, Result, Token,
    };
    pub use tokio::{sync::watch::Receiver, time::Instant};
}
