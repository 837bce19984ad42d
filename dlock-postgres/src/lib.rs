#![doc = include_str!("../README.md")]

mod backend;
mod config;

pub use backend::{CallerConnection, ConnLock, PgBackend, PgDialect, PgSession, TxLock};
pub use config::PgConfig;
/// The driver, for [`PgConfig::from_options`].
pub use sqlx;
