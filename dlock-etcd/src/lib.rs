#![doc = include_str!("../README.md")]

mod backend;
mod config;
mod session;

pub use backend::EtcdBackend;
pub use config::EtcdConfig;
pub use etcd_client;
