#![doc = include_str!("../README.md")]

mod backend;
mod config;
mod keys;
mod node;
mod scripts;
mod sentinel;
mod subscriber;

pub use backend::RedisBackend;
pub use config::RedisConfig;
pub use redis;
