#![doc = include_str!("../README.md")]

mod backend;
mod config;

pub use backend::{MySqlBackend, MySqlDialect, MySqlSession};
pub use config::{FenceSource, MySqlConfig};
/// The driver, for [`MySqlConfig::from_options`].
pub use sqlx;
