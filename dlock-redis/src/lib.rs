#![doc = include_str!("../README.md")]
//!
//! ## The waiting line
//!
//! The words *line*, *ticket*, *turn* and *hold* are used as
//! [dlock's glossary](https://docs.rs/dlock/latest/dlock/guide/glossary/index.html)
//! defines them.
//!
//! - **First come, first served, across processes.** Each key has a line
//!   on the server: tickets in a sorted set, ordered by place. A release
//!   that finds someone in line does not free the key: it hands the lock
//!   to the first live ticket (the key names that waiter until its ticket
//!   lapses), so a client that releases and locks again at once queues
//!   behind the waiters already there, in any process, and a free key can
//!   be taken without reading the line. Within one process, waiters for a
//!   key wait for their turn locally first and only the one whose turn it
//!   is stands in the server's line: a process holds at most one ticket
//!   per key.
//! - **The acquire script** takes a free key, counting a fencing token (a
//!   first attempt that counts none, Redlock's or one with `fence=off`, is
//!   a plain `SET NX PX`); otherwise it puts the caller in the key's line,
//!   or refreshes its ticket there, and answers how long until it is worth
//!   checking again.
//! - **One waiter woken per release.** The release names the waiter it
//!   handed the lock to in its pub/sub message, and only that waiter,
//!   wherever it runs, is woken; it subscribes before its last check, so
//!   the message cannot slip between the two. There is no fixed-interval
//!   polling.
//! - **A departed waiter leaves, a crashed one lapses.** A waiter that
//!   gives up, or whose future is dropped, takes its ticket out (and
//!   passes the lock on if it had been handed to it). A ticket lapses its
//!   life (the waiter's lease, at most two response timeouts: 10 s by
//!   default) after its waiter last refreshed it (at every attempt, and at
//!   least every third of that), and a lock handed to a waiter lasts only
//!   as long as its ticket: a crashed waiter holds up the line for
//!   seconds, whatever its lease. The line's keys expire with their last
//!   ticket. Only a crash leaves a key free with waiters in line (a
//!   holder's lease, or a handed lock, that ran out); whoever asks next
//!   takes it, and the release after that serves the line in order again.
//! - **Redlock** sends each step to every node at once, with a per-node
//!   timeout much shorter than the lease, and holds the lock only with a
//!   majority and time left on the lease; otherwise it gives back what it
//!   won.
//!
//! ## Why Redlock waiters choose their own place in line
//!
//! Every node keeps its own line, and a majority must grant the same
//! waiter. If each node placed tickets in the order they arrived, two
//! waiters that reach the nodes in different orders would be first on
//! different nodes: the votes split, nobody wins, and everyone backs off
//! and tries again, which is how plain Redlock behaves under contention
//! (far fewer locks a second than a client that polls: the round that
//! measured it is in BENCHMARKS.md's history).
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
