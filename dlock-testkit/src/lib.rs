//! The conformance suite every dlock backend passes, and fixtures that start
//! real lock servers for it.
//!
//! - [`conformance`]: plain `pub async fn`s, one per safety property (such
//!   as [`conformance::mutual_exclusion`]), each taking a [`Harness`] that
//!   makes independent clients, as separate processes would have.
//!   [`conformance_tests!`] turns the whole list into one `#[tokio::test]`
//!   per check, or into one test that runs them all on one cluster.
//! - [`fixture`]: starts a server binary on a free loopback port in a temp
//!   dir, waits until it accepts connections, and stops it by its own PID.
//! - [`OverlapDetector`], [`HoldLog`] (across processes) and
//!   [`CountingBackend`]: the instruments the checks measure with.
//! - [`session_faults`]: fault checks for backends whose locks live on a
//!   client session; [`database_faults`]: those of the database backends.
//!
//! A backend's test file is one line plus its harness:
//!
//! ```text
//! fn harness() -> dlock_testkit::Harness { /* start a server, return a client factory */ }
//! dlock_testkit::conformance_tests!(harness());
//! ```
//!
//! # Writing a backend
//!
//! The guide [Writing a backend] (in this crate's README) shows the
//! [`Backend`](dlock_core::backend::Backend) trait and what each method
//! must guarantee, the conformance entry point ([`conformance_tests!`] and
//! [`Harness`]), and the [`fixture`]s and instruments a backend may reuse.
//! Its worked example is a complete backend written from outside dlock,
//! [`examples/src/map_backend.rs`], which
//! [`examples/tests/map_backend_conformance.rs`] runs the whole suite
//! against.
//!
//! [Writing a backend]: https://github.com/dlock-rs/dlock/blob/main/dlock-testkit/README.md#writing-a-backend
//! [`examples/src/map_backend.rs`]: https://github.com/dlock-rs/dlock/blob/main/examples/src/map_backend.rs
//! [`examples/tests/map_backend_conformance.rs`]: https://github.com/dlock-rs/dlock/blob/main/examples/tests/map_backend_conformance.rs
//!
//! # Features
//!
//! By default every server backend is in (`redis`, `etcd`, `zk`,
//! `postgres`, `mysql`): [`connect`] then knows every URL scheme. With
//! `default-features = false` only the in-process `memory` backend is, and
//! nothing needs `protoc` or a server's client: that is how `dlock-core`'s
//! own tests use the suite.

mod captured;
pub mod conformance;
mod connect;
mod counting;
pub mod database_faults;
mod detector;
mod fenced_store;
pub mod fixture;
mod hold_log;
mod metrics;
mod rng;
pub mod session_faults;
pub mod sql;

pub use captured::CapturedLog;
pub use conformance::Harness;
pub use connect::{assert_locks_are_shared, assert_refused, connect};
pub use counting::CountingBackend;
pub use detector::{OverlapDetector, Section};
pub use fenced_store::{FencedStore, StoreWrite};
pub use hold_log::{monotonic_ns, HoldLog, Interval};
pub use metrics::check_metrics;
pub use rng::Rng;

/// Every fallback timer of the handoff checks across processes (the
/// watchdog lease, so a holder's TTL stays between 20 and 30 s, and Redis's
/// unwatched poll), for the test and its helper processes alike: a waiter
/// granted within a small fraction of it was woken by the release, not by
/// a timer.
///
/// # Examples
///
/// ```
/// // A grant must follow its release well inside the fallbacks.
/// let prompt = dlock_testkit::HANDOFF_FALLBACKS / 15;
/// assert_eq!(prompt, std::time::Duration::from_secs(2));
/// ```
pub const HANDOFF_FALLBACKS: std::time::Duration = std::time::Duration::from_secs(30);
