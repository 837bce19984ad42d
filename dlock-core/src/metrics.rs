//! The metrics dlock records, through the [`metrics`] crate's facade, with
//! the `metrics` cargo feature on.
//!
//! The names below are what an exporter (Prometheus, StatsD, OpenTelemetry)
//! receives from whatever recorder the application installs; with no
//! recorder installed, recording costs a check of a global. Without the
//! feature, nothing is recorded, and this module holds only the names.
//!
//! | Name | Kind | Labels | What |
//! |------|------|--------|------|
//! | [`ACQUIRE_SECONDS`] | histogram | `backend`, `mode`, `outcome` | how long each acquisition took, from the call to its answer |
//! | [`HELD`] | gauge | `backend`, `mode` | locks this process holds now |
//! | [`LOST`] | counter | `backend`, `reason` | locks lost while held |
//! | [`RENEWALS`] | counter | `backend`, `outcome` | the watchdog's renewal round trips |
//! | [`RENEWAL_SECONDS`] | histogram | `backend` | how long each renewal round trip took |
//! | [`CONNECTION_STATES`] | counter | `backend`, `state` | changes of a backend's [`ConnectionState`](crate::ConnectionState), by the state entered |
//!
//! The labels' values:
//!
//! - `backend`: the backend's name (`redis`, `redlock`, `etcd`,
//!   `zookeeper`, `postgres`, `mysql`, `memory`).
//! - `mode`: `exclusive`, `read`, `write` or `permits`.
//! - `outcome` of an acquisition: `acquired`; `busy` (a `try_lock` found
//!   the key held); `timeout` (the wait limit passed); `error`; or
//!   `cancelled` (the caller dropped the future). A re-entry inside a
//!   scope asks no server and is not recorded.
//! - `reason` of a loss: `lease_expired`, `not_held` or `session_expired`
//!   (see [`LostReason`]).
//! - `outcome` of a renewal round trip: `ok`, `error` or `timeout`. One
//!   round trip renews every lock its tick found due.
//! - `state` entered: `connected`, `suspended`, `lost` or `reconnected`.
//!
//! No label holds a lock's key: keys are unbounded (one per order, per
//! user), and a label per key would grow an exporter's memory without
//! bound; they may also hold personal data.
//!
//! # Examples
//!
//! Reading what was recorded back, with a recorder of the application's
//! choice (here the `metrics-util` crate's debugging recorder):
//!
//! ```ignore
//! let recorder = metrics_util::debugging::DebuggingRecorder::new();
//! let snapshotter = recorder.snapshotter();
//! recorder.install()?;
//! drop(locker.lock("job").await?);
//! for (key, _, _, value) in snapshotter.snapshot().into_vec() {
//!     println!("{} {:?} {value:?}", key.key().name(), key.key().labels().collect::<Vec<_>>());
//! }
//! ```
//!
//! [`LostReason`]: crate::LostReason
//! [`metrics`]: https://docs.rs/metrics

/// Histogram, seconds: how long each acquisition took, labelled by
/// `backend`, `mode` and `outcome`.
pub const ACQUIRE_SECONDS: &str = "dlock_acquire_seconds";
/// Gauge: locks this process holds now, labelled by `backend` and `mode`.
pub const HELD: &str = "dlock_held";
/// Counter: locks lost while held, labelled by `backend` and `reason`.
pub const LOST: &str = "dlock_lost_total";
/// Counter: the watchdog's renewal round trips, labelled by `backend` and
/// `outcome`.
pub const RENEWALS: &str = "dlock_renewals_total";
/// Histogram, seconds: how long each renewal round trip took, labelled by
/// `backend`.
pub const RENEWAL_SECONDS: &str = "dlock_renewal_seconds";
/// Counter: changes of a backend's connection state, labelled by `backend`
/// and the `state` entered.
pub const CONNECTION_STATES: &str = "dlock_connection_states_total";

use std::time::Duration;

use crate::{backend::Mode, LostReason};

#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
fn mode_label(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "exclusive",
        Mode::Read => "read",
        Mode::Write => "write",
        Mode::Permits { .. } => "permits",
    }
}

#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
fn reason_label(reason: &LostReason) -> &'static str {
    match reason {
        LostReason::LeaseExpired => "lease_expired",
        LostReason::NotHeld => "not_held",
        LostReason::SessionExpired => "session_expired",
    }
}

/// How an acquisition ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcquireOutcome {
    Acquired,
    Busy,
    Timeout,
    Error,
}

impl AcquireOutcome {
    fn label(self) -> &'static str {
        match self {
            AcquireOutcome::Acquired => "acquired",
            AcquireOutcome::Busy => "busy",
            AcquireOutcome::Timeout => "timeout",
            AcquireOutcome::Error => "error",
        }
    }
}

/// Times one acquisition: [`finish`](Self::finish) records its outcome,
/// and dropping it unfinished records `cancelled`.
#[derive(Debug)]
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) struct AcquireTimer {
    backend: &'static str,
    mode: Mode,
    start: tokio::time::Instant,
    finished: bool,
}

impl AcquireTimer {
    pub(crate) fn start(backend: &'static str, mode: Mode, start: tokio::time::Instant) -> Self {
        AcquireTimer {
            backend,
            mode,
            start,
            finished: false,
        }
    }

    pub(crate) fn finish(mut self, outcome: AcquireOutcome) {
        self.finished = true;
        self.record(outcome.label());
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn record(&self, outcome: &'static str) {
        #[cfg(feature = "metrics")]
        metrics::histogram!(
            ACQUIRE_SECONDS,
            "backend" => self.backend,
            "mode" => mode_label(self.mode),
            "outcome" => outcome,
        )
        .record(self.start.elapsed());
    }
}

impl Drop for AcquireTimer {
    fn drop(&mut self) {
        if !self.finished {
            self.record("cancelled");
        }
    }
}

/// A lock is held (`+1`) or no longer (`-1`).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn held(backend: &'static str, mode: Mode, change: f64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!(HELD, "backend" => backend, "mode" => mode_label(mode)).increment(change);
}

/// A held lock was lost.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn lost(backend: &'static str, reason: &LostReason) {
    #[cfg(feature = "metrics")]
    metrics::counter!(LOST, "backend" => backend, "reason" => reason_label(reason)).increment(1);
}

/// A renewal round trip ended with `outcome` (`ok`, `error`, `timeout`)
/// after `took`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn renewal(backend: &'static str, outcome: &'static str, took: Duration) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(RENEWALS, "backend" => backend, "outcome" => outcome).increment(1);
        metrics::histogram!(RENEWAL_SECONDS, "backend" => backend).record(took);
    }
}

/// A backend's connection state changed to `state`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn connection_state(backend: &'static str, state: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(CONNECTION_STATES, "backend" => backend, "state" => state).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_documented_ones() {
        assert_eq!(mode_label(Mode::Permits { count: 1, limit: 3 }), "permits");
        assert_eq!(mode_label(Mode::Write), "write");
        assert_eq!(reason_label(&LostReason::SessionExpired), "session_expired");
        assert_eq!(AcquireOutcome::Busy.label(), "busy");
    }
}
