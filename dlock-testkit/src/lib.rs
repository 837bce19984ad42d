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
//!   client session.
//!
//! A backend's test file is one line plus its harness:
//!
//! ```text
//! fn harness() -> dlock_testkit::Harness { /* start a server, return a client factory */ }
//! dlock_testkit::conformance_tests!(harness());
//! ```

mod captured;
pub mod conformance;
mod connect;
mod counting;
mod detector;
mod fenced_store;
pub mod fixture;
mod hold_log;
mod rng;
pub mod session_faults;

pub use captured::CapturedLog;
pub use conformance::Harness;
pub use connect::connect;
pub use counting::CountingBackend;
pub use detector::{OverlapDetector, Section};
pub use fenced_store::{FencedStore, StoreWrite};
pub use hold_log::{monotonic_ns, HoldLog, Interval};
pub use rng::Rng;
