//! Shared code of the dlock examples, so that the tests run exactly what the
//! programs run.
//!
//! - [`stock`]: the stock demo, in one process or several;
//! - [`orders`]: an axum service whose handlers run under
//!   `#[distributed_lock]`;
//! - [`job`]: a scheduled job that exactly one instance runs per tick;
//! - [`limits`]: a rate-limited worker pool (semaphore) and a config cache
//!   (read-write lock);
//! - [`backend`]: `--backend URL`, the in-process backend by default;
//! - [`map_backend`]: a complete, minimal backend written from outside
//!   dlock (one in-process map with simulated leases), which
//!   `tests/map_backend_conformance.rs` runs the whole conformance suite
//!   against: the worked example of the guide "Writing a backend"
//!   (`dlock-testkit/README.md`).

pub mod backend;
pub mod job;
pub mod limits;
pub mod map_backend;
pub mod orders;
pub mod stock;
