#![doc = include_str!("../README.md")]
//!
//! ## Why Redlock waiters choose their own place in line
//!
//! Every node keeps its own line, and a majority must grant the same
//! waiter. If each node placed tickets in the order they arrived, two
//! waiters that reach the nodes in different orders would be first on
//! different nodes: the votes split, nobody wins, and everyone backs off
//! and tries again, which is how plain Redlock behaves under contention.
//!
//! So a Redlock waiter brings its place: its clock, in µs, when it began
//! to wait. Every node orders the same tickets the same way, and once a
//! ticket has reached every node, all nodes agree on who is first. They
//! can disagree only for the moment a new ticket has reached some nodes
//! and not others; the waiter that won a minority then gives its grants
//! back, keeping its place, and the round that follows a short random
//! delay finds every ticket on every node.
//!
//! The price is fairness between clients whose clocks disagree: a client
//! whose clock is `s` behind goes ahead of waiters that came up to `s`
//! earlier. Exclusion does not depend on it: it rests on a majority of
//! owner-only grants, as before. The alternatives were worse: a number
//! from one node makes that node a single point of failure, which is what
//! Redlock exists to avoid, and agreeing on a number first costs every
//! wait another round trip to every node.
//!
//! One node places tickets by its own clock, after the last ticket.
//!
//! Clients of this version should not share keys with earlier ones, which
//! neither queue nor name the waiter they wake: they keep exclusion, but
//! they barge past the line.
//!
//! ## Read-write locks and semaphores (one node)
//!
//! A key's read-write lock and its semaphore are objects of their own on
//! the server (`…:rw`, `…:sem`): a sorted set of holders scored by when
//! each one's lease ends, a fence counter, and a waiting line as the
//! plain lock's. One script per step (acquire, release, renew) prunes the
//! holders whose lease ended, so a crashed holder's share or permits come
//! back when its lease runs out, and admits first come, first served: a
//! reader holds when no writer holds or waits ahead of it, permits when
//! everything ahead and its own fit the limit, a writer when nobody is
//! ahead. A release wakes, by name, exactly the waiters at the head of the
//! line it admits. Redlock does not offer them (`LockError::Unsupported`):
//! a majority of per-node holder sets is not one set of holders.

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
