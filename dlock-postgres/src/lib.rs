#![doc = include_str!("../README.md")]

mod backend;
mod config;

pub use backend::{CallerConnection, ConnLock, PgBackend, TxLock};
pub use config::PgConfig;
/// The driver, for [`PgConfig::from_options`].
pub use sqlx;
