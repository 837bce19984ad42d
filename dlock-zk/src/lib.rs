#![doc = include_str!("../README.md")]

mod backend;
mod config;
mod session;

pub use backend::ZkBackend;
pub use config::ZkConfig;
pub use zookeeper_client;
