//! Shared code of the dlock examples, so that the tests run exactly what the
//! programs run.
//!
//! - [`stock`]: the stock demo, in one process or several;
//! - [`orders`]: an axum service whose handlers run under
//!   `#[distributed_lock]`;
//! - [`job`]: a scheduled job that exactly one instance runs per tick;
//! - [`limits`]: a rate-limited worker pool (semaphore) and a config cache
//!   (read-write lock);
//! - [`backend`]: `--backend URL`, the in-process backend by default.

pub mod backend;
pub mod job;
pub mod limits;
pub mod orders;
pub mod stock;
