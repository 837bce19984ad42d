#![doc = include_str!("../README.md")]
//!
//! ## Why Redlock waiters choose their own place in line
//!
//! Each node keeps its own line, and a majority must grant the same
//! waiter. Placed in arrival order, two waiters that reach the nodes in
//! different orders would be first on different nodes and split the
//! votes. So a Redlock waiter brings its place, its clock in µs when it
//! began to wait, and every node orders the tickets alike; a minority win
//! while a new ticket has not reached every node is given back, keeping
//! the place. The price is fairness between clients whose clocks
//! disagree; exclusion still rests on a majority of owner-only grants.
//! One node places tickets by its own clock, after the last ticket.
//!
//! Read-write locks and semaphores (one node only) are described in
//! [dlock's guide](https://docs.rs/dlock/latest/dlock/guide/primitives/index.html).

mod backend;
mod config;
mod eviction;
mod keys;
mod node;
mod scripts;
mod sentinel;
mod subscriber;

pub use backend::RedisBackend;
pub use config::RedisConfig;
pub use redis;
