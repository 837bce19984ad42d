//! The check that a backend's locks record the metrics `dlock_core::metrics`
//! documents, read back through a debugging recorder.

use std::{collections::HashMap, time::Duration};

use dlock_core::{metrics as names, LockError, LockOptions};
use metrics_util::{
    debugging::{DebugValue, DebuggingRecorder, Snapshotter},
    CompositeKey,
};

use crate::Harness;

/// What the snapshots held, added up, by metric name and sorted labels: a
/// counter's or gauge's value, or a histogram's number of samples.
#[derive(Debug, Default)]
struct Seen(HashMap<(String, Vec<(String, String)>), f64>);

impl Seen {
    fn add(&mut self, snapshotter: &Snapshotter) {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let name = key_of(&key);
            let slot = self.0.entry(name).or_default();
            // A snapshot hands over what changed since the last one (and
            // zeroes the recorder's values): a gauge's increments, a
            // counter's, a histogram's samples.
            *slot += match value {
                DebugValue::Counter(v) => v as f64,
                DebugValue::Gauge(v) => v.into_inner(),
                DebugValue::Histogram(samples) => samples.len() as f64,
            };
        }
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        labels.sort();
        self.0
            .get(&(name.to_string(), labels))
            .copied()
            .unwrap_or(0.0)
    }
}

fn key_of(key: &CompositeKey) -> (String, Vec<(String, String)>) {
    let mut labels: Vec<(String, String)> = key
        .key()
        .labels()
        .map(|l| (l.key().to_string(), l.value().to_string()))
        .collect();
    labels.sort();
    (key.key().name().to_string(), labels)
}

/// Runs one backend's locks through each outcome the metrics name, on a
/// current-thread runtime whose thread records into a debugging recorder,
/// and checks every number read back: acquisitions by outcome (acquired,
/// busy, timeout, cancelled), the held gauge up and back down, a loss by
/// its reason, and (if `renewed`, for backends the watchdog renews) the
/// renewal round trips. No label value may hold a lock's key.
///
/// # Panics
///
/// When a number differs from what happened, naming it.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::{Backend, DynBackend}, MemoryBackend};
/// use std::sync::Arc;
///
/// let server = MemoryBackend::new();
/// let harness = dlock_testkit::Harness::new("memory", move || {
///     let client: Arc<dyn DynBackend> = Arc::new(server.clone());
///     async move { Ok(client) }
/// });
/// dlock_testkit::check_metrics(&harness, true);
/// ```
pub fn check_metrics(h: &Harness, renewed: bool) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
    runtime.block_on(async {
        let name = h.name();
        let mut seen = Seen::default();
        let lease = Duration::from_millis(600);
        let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
        let b = h.locker().await;
        let backend = a.backend().name();
        let key = h.key("metrics");
        let acquired = [
            ("backend", backend),
            ("mode", "exclusive"),
            ("outcome", "acquired"),
        ];
        let outcome = |o| [("backend", backend), ("mode", "exclusive"), ("outcome", o)];
        let held = [("backend", backend), ("mode", "exclusive")];

        let guard = a.lock(&key).await.expect("the first lock");
        seen.add(&snapshotter);
        assert_eq!(
            seen.get(names::HELD, &held),
            1.0,
            "[{name}] held while held"
        );
        assert_eq!(
            seen.get(names::ACQUIRE_SECONDS, &acquired),
            1.0,
            "[{name}] acquired"
        );

        let busy = b.try_lock(&key).await.expect("a try on a held key");
        assert!(busy.is_none(), "[{name}] a held key was granted");
        let timeout = b
            .lock_with(&key, LockOptions::new().wait(Duration::from_millis(100)))
            .await;
        assert!(
            matches!(timeout, Err(LockError::Timeout { .. })),
            "[{name}] a wait on a held key: {timeout:?}"
        );
        let cancelled = tokio::time::timeout(
            Duration::from_millis(50),
            b.lock_with(&key, LockOptions::new().wait(Duration::from_secs(10))),
        )
        .await;
        assert!(cancelled.is_err(), "[{name}] a wait on a held key ended");
        // Past a lease's worth of renewals (one per third of it).
        tokio::time::sleep(lease + lease / 6).await;
        seen.add(&snapshotter);
        assert_eq!(
            seen.get(names::ACQUIRE_SECONDS, &outcome("busy")),
            1.0,
            "[{name}] busy"
        );
        assert_eq!(
            seen.get(names::ACQUIRE_SECONDS, &outcome("timeout")),
            1.0,
            "[{name}] timeout"
        );
        assert_eq!(
            seen.get(names::ACQUIRE_SECONDS, &outcome("cancelled")),
            1.0,
            "[{name}] cancelled"
        );
        if renewed {
            let ok = seen.get(names::RENEWALS, &[("backend", backend), ("outcome", "ok")]);
            assert!(ok >= 2.0, "[{name}] {ok} renewal round trips in a lease");
            assert_eq!(
                seen.get(names::RENEWAL_SECONDS, &[("backend", backend)]),
                ok,
                "[{name}] a duration per renewal round trip"
            );
        }
        drop(guard);
        seen.add(&snapshotter);
        assert_eq!(
            seen.get(names::HELD, &held),
            0.0,
            "[{name}] held after the drop"
        );

        let fixed = a
            .lock_with(&key, LockOptions::new().lease(Duration::from_millis(200)))
            .await
            .expect("a lock on a fixed lease");
        let reason = tokio::time::timeout(Duration::from_secs(10), fixed.lost()).await;
        assert!(reason.is_ok(), "[{name}] a fixed lease never ended");
        drop(fixed);
        a.wait_for_releases().await;
        seen.add(&snapshotter);
        let lost = [("backend", backend), ("reason", "lease_expired")];
        assert_eq!(seen.get(names::LOST, &lost), 1.0, "[{name}] the loss");
        assert_eq!(
            seen.get(names::ACQUIRE_SECONDS, &acquired),
            2.0,
            "[{name}] acquired twice"
        );
        assert_eq!(
            seen.get(names::HELD, &held),
            0.0,
            "[{name}] held after the loss"
        );

        for (metric, labels) in seen.0.keys() {
            for (label, value) in labels {
                assert!(
                    *value != key && !value.contains("/metrics"),
                    "[{name}] {metric} has a key in label {label}={value}"
                );
            }
        }
    });
}
