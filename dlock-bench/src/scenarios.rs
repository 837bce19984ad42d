//! The scenarios, each measured with dlock and, where one exists, with the
//! raw client floor in the same run.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_core::{LockOptions, Token};
use dlock_testkit::{CountingBackend, OverlapDetector};
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::{stats::Samples, Row, Target};

/// Something that locks a key: dlock, or a peer's recipe. `lock` returns the
/// unlock, to await when done.
pub(crate) trait Lockable: Send + Sync {
    /// What the rows call it (`dlock` for ours).
    fn label(&self) -> &str;

    /// Locks `key` for `task` (peers whose ownership is per lease keep one
    /// per task), and returns the unlock.
    fn lock<'a>(&'a self, task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>>;
}

/// The unlock of a held lock.
pub(crate) struct Unlock<'a>(pub(crate) BoxFuture<'a, ()>);

impl Unlock<'_> {
    /// Unlocks.
    pub(crate) async fn unlock(self) {
        self.0.await;
    }
}

/// dlock through a [`dlock_core::Locker`] (one client, as in a service).
pub(crate) struct Dlock(pub(crate) dlock_core::Locker);

impl Lockable for Dlock {
    fn label(&self) -> &str {
        "dlock"
    }

    fn lock<'a>(&'a self, _task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let guard = self
                .0
                .lock_with(key, LockOptions::new().wait(Duration::from_secs(120)))
                .await
                .expect("lock");
            Unlock(Box::pin(
                async move { guard.release().await.expect("release") },
            ))
        })
    }
}

/// The scenario's name, with the subject's label unless it is dlock.
fn scenario(subject: &dyn Lockable, name: String) -> String {
    match subject.label() {
        "dlock" => name,
        peer => format!("{name} ({peer})"),
    }
}

/// Every scenario for `target`.
pub(crate) async fn run_all(target: &Target, quick: bool) -> Vec<Row> {
    let scale = if quick { 5 } else { 1 };
    let serial_ops = if target.raw.is_none() { 100_000 } else { 2_000 } / scale;
    warm_up(target, serial_ops / 2).await;
    let dlock: Arc<dyn Lockable> = Arc::new(Dlock(target.locker(None).await));
    let mut rows = lock_scenarios(target, dlock, serial_ops, scale).await;
    match crate::multiproc::contended(target, 4, 8, 100 / scale).await {
        Some(Ok(row)) => rows.push(row),
        Some(Err(e)) => panic!("contended across processes on {}: {e}", target.name),
        None => {}
    }
    rows.push(reentrant(target, 100_000 / scale).await);
    rows.push(held(target, 10_000 / scale).await);
    for peer in crate::peers::of(target).await {
        rows.extend(lock_scenarios(target, peer, serial_ops, scale).await);
    }
    rows
}

/// Scenarios 1–3 for dlock or a peer.
async fn lock_scenarios(
    target: &Target,
    subject: Arc<dyn Lockable>,
    serial_ops: usize,
    scale: usize,
) -> Vec<Row> {
    vec![
        serial(target, &*subject, serial_ops).await,
        distinct(target, subject.clone(), 64, 40 / scale).await,
        contended(target, subject, 16, 100 / scale).await,
    ]
}

/// Runs dlock and the raw floor alike before anything is measured: a JVM
/// server (ZooKeeper) is several times slower until its JIT has warmed up,
/// which would otherwise count against whichever is measured first.
async fn warm_up(target: &Target, ops: usize) {
    let locker = target.locker(None).await;
    let token = Token::generate().to_string();
    for _ in 0..ops {
        locker
            .lock("bench:warm")
            .await
            .expect("lock")
            .release()
            .await
            .expect("release");
        if let Some(raw) = &target.raw {
            raw.lock_unlock("bench-raw-warm", &token).await;
        }
    }
}

async fn serial(target: &Target, subject: &dyn Lockable, ops: usize) -> Row {
    let mut samples = Vec::with_capacity(ops);
    // Server time first: its INFO then counts before the request count starts.
    let usec_before = target.redis_server_usec(&["evalsha"]);
    let requests = target.count_requests();
    let start = Instant::now();
    for _ in 0..ops {
        let t = Instant::now();
        subject.lock(0, "bench:serial").await.unlock().await;
        samples.push(t.elapsed());
    }
    let elapsed = start.elapsed();
    let requests = requests.per_op(ops as u64);
    // dlock sends only scripts; the raw floor a SET and a script.
    let server_us = usec_before
        .zip(target.redis_server_usec(&["evalsha"]))
        .map(|(before, after)| (after - before) as f64 / ops as f64);
    let samples = Samples::new(samples);
    let mut row = Row {
        scenario: scenario(subject, "serial".into()),
        notes: requests_note(requests).trim_start_matches("; ").to_owned(),
        backend: target.name.into(),
        ops: ops as u64,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        ..Row::default()
    };
    if let Some(raw) = &target.raw {
        let token = Token::generate().to_string();
        let raw_usec_before = target.redis_server_usec(&["set", "evalsha"]);
        let mut floor = Vec::with_capacity(ops);
        for _ in 0..ops {
            let t = Instant::now();
            raw.lock_unlock("bench-raw-serial", &token).await;
            floor.push(t.elapsed());
        }
        let floor = Samples::new(floor).quantile(0.5);
        let raw_server_us = raw_usec_before
            .zip(target.redis_server_usec(&["set", "evalsha"]))
            .map(|(before, after)| (after - before) as f64 / ops as f64);
        if let (Some(dlock), Some(raw)) = (server_us, raw_server_us) {
            row.notes += &format!("; Redis busy {dlock:.1} µs/op (raw {raw:.1})");
        }
        row.raw_p50 = Some(floor);
        row.ratio = Some(row.p50.as_secs_f64() / floor.as_secs_f64());
    }
    row
}

async fn distinct(
    target: &Target,
    subject: Arc<dyn Lockable>,
    tasks: usize,
    per_task: usize,
) -> Row {
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let subject = subject.clone();
            tokio::spawn(async move {
                let key = format!("bench:distinct:{i}");
                let mut samples = Vec::with_capacity(per_task);
                for _ in 0..per_task {
                    let t = Instant::now();
                    subject.lock(i, &key).await.unlock().await;
                    samples.push(t.elapsed());
                }
                samples
            })
        })
        .collect();
    let mut samples = Vec::new();
    for h in handles {
        samples.extend(h.await.expect("task"));
    }
    let elapsed = start.elapsed();
    let ops = (tasks * per_task) as u64;
    let samples = Samples::new(samples);
    let mut row = Row {
        scenario: scenario(&*subject, format!("distinct-{tasks}")),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        ..Row::default()
    };
    if let Some(raw) = &target.raw {
        // Spawned tasks too, as dlock's are (and as a service's would be):
        // futures joined in one task would share its wake-ups and writes.
        let start = Instant::now();
        let runs: Vec<_> = (0..tasks)
            .map(|i| {
                let raw = raw.clone();
                tokio::spawn(async move {
                    let (key, token) = (
                        format!("bench-raw-distinct-{i}"),
                        Token::generate().to_string(),
                    );
                    for _ in 0..per_task {
                        raw.lock_unlock(&key, &token).await;
                    }
                })
            })
            .collect();
        for run in runs {
            run.await.expect("raw task");
        }
        let raw_ops = ops as f64 / start.elapsed().as_secs_f64();
        row.raw_ops_per_sec = Some(raw_ops);
        row.ratio = Some(raw_ops / row.ops_per_sec);
    }
    row
}

/// What a contended run saw, from one process or several.
#[derive(Default)]
pub(crate) struct Contention {
    pub(crate) waits: Vec<Duration>,
    pub(crate) holds: Vec<Duration>,
    pub(crate) owner_changes: usize,
    pub(crate) overlaps: usize,
}

impl Contention {
    /// The row: wait percentiles, owner changes, overlaps, and the wait p99
    /// against `contenders` × (hold + handoff), where hold + handoff is the
    /// measured time per operation.
    pub(crate) fn row(
        self,
        scenario: String,
        target: &Target,
        ops: u64,
        elapsed: Duration,
        requests_per_op: Option<f64>,
        contenders: usize,
    ) -> Row {
        let per_op = elapsed / ops.max(1) as u32;
        let mean_hold = self.holds.iter().sum::<Duration>() / self.holds.len().max(1) as u32;
        let waits = Samples::new(self.waits);
        let turn = per_op * contenders as u32;
        Row {
            scenario,
            backend: target.name.into(),
            ops,
            ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
            p50: waits.quantile(0.5),
            p99: waits.quantile(0.99),
            max: waits.max(),
            notes: format!(
                "wait times; owner changes {} of {ops}; overlaps {}; hold {:.0} µs + handoff {:.0} µs; wait p99 = {:.2} × {contenders}·(hold + handoff){}",
                self.owner_changes,
                self.overlaps,
                micros(mean_hold),
                micros(per_op.saturating_sub(mean_hold)),
                waits.quantile(0.99).as_secs_f64() / turn.as_secs_f64(),
                requests_note(requests_per_op),
            ),
            ..Row::default()
        }
    }
}

/// `; N server requests/op`, or nothing without a count.
pub(crate) fn requests_note(per_op: Option<f64>) -> String {
    per_op.map_or_else(String::new, |n| format!("; {n:.2} server requests/op"))
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

async fn contended(
    target: &Target,
    subject: Arc<dyn Lockable>,
    tasks: usize,
    per_task: usize,
) -> Row {
    let detector = Arc::new(OverlapDetector::default());
    let last_owner = Arc::new(AtomicUsize::new(usize::MAX));
    let changes = Arc::new(AtomicUsize::new(0));
    let requests = target.count_requests();
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|me| {
            let (subject, detector) = (subject.clone(), detector.clone());
            let (last_owner, changes) = (last_owner.clone(), changes.clone());
            tokio::spawn(async move {
                let (mut waits, mut holds) = (Vec::new(), Vec::new());
                for _ in 0..per_task {
                    let t = Instant::now();
                    let unlock = subject.lock(me, "bench:contended").await;
                    let held = Instant::now();
                    waits.push(held - t);
                    {
                        let _section = detector.enter();
                        if last_owner.swap(me, Ordering::SeqCst) != me {
                            changes.fetch_add(1, Ordering::SeqCst);
                        }
                        // A short critical section.
                        tokio::time::sleep(Duration::from_micros(100)).await;
                    }
                    holds.push(held.elapsed());
                    unlock.unlock().await;
                }
                (waits, holds)
            })
        })
        .collect();
    let mut contention = Contention::default();
    for h in handles {
        let (waits, holds) = h.await.expect("task");
        contention.waits.extend(waits);
        contention.holds.extend(holds);
    }
    let elapsed = start.elapsed();
    let ops = (tasks * per_task) as u64;
    contention.owner_changes = changes.load(Ordering::SeqCst);
    contention.overlaps = detector.overlaps();
    contention.row(
        scenario(&*subject, format!("contended-{tasks}")),
        target,
        ops,
        elapsed,
        requests.per_op(ops),
        tasks,
    )
}

async fn reentrant(target: &Target, ops: usize) -> Row {
    let locker = target.locker(None).await;
    let outer = locker.lock("bench:reentrant").await.expect("lock");
    let start = Instant::now();
    for _ in 0..ops {
        drop(locker.lock("bench:reentrant").await.expect("re-lock"));
    }
    let elapsed = start.elapsed();
    outer.release().await.expect("release");
    let per_op = elapsed / ops as u32;
    Row {
        scenario: "reentrant".into(),
        backend: target.name.into(),
        ops: ops as u64,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: per_op,
        p99: per_op,
        max: per_op,
        notes: "mean per re-lock; no I/O".into(),
        ..Row::default()
    }
}

async fn held(target: &Target, locks: usize) -> Row {
    let lease = Duration::from_secs(3);
    let base = target.locker(Some(lease)).await;
    // One lock first: the session, connections and caches any first lock
    // sets up are not a per-lock cost.
    base.lock("bench:held:first")
        .await
        .expect("lock")
        .release()
        .await
        .expect("release");
    let counting = Arc::new(CountingBackend::new(base.backend().clone()));
    let locker = dlock_core::LockerBuilder::from_arc(counting.clone())
        .watchdog_lease(lease)
        .build()
        .expect("options");
    let keys: Vec<String> = (0..locks).map(|i| format!("bench:held:{i}")).collect();
    let heap_before = crate::alloc::live_bytes();
    let start = Instant::now();
    let tasks: Vec<_> = (0..64)
        .map(|t| {
            let locker = locker.clone();
            let keys: Vec<String> = keys.iter().skip(t).step_by(64).cloned().collect();
            tokio::spawn(async move {
                let mut guards = Vec::with_capacity(keys.len());
                for key in keys {
                    guards.push(locker.lock(key).await.expect("lock"));
                }
                guards
            })
        })
        .collect();
    let mut guards = Vec::with_capacity(locks);
    for t in tasks {
        guards.extend(t.await.expect("task"));
    }
    let acquired_in = start.elapsed();
    let before = counting.renewals();
    let requests = target.count_requests();
    // Two watchdog ticks (a third of the lease each). The heap is sampled
    // meanwhile and its lowest reading kept: what the held locks cost, not
    // the buffers of a renewal batch in flight.
    let until = Instant::now() + lease * 2 / 3 + Duration::from_millis(100);
    let mut heap = isize::MAX;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
        heap = heap.min(crate::alloc::live_bytes());
    }
    let heap_per_lock = (heap - heap_before) as f64 / locks as f64;
    let ticks_renewals = counting.renewals() - before;
    let server_requests = requests.per_op(ticks_renewals.max(1) as u64);
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    drop(guards);
    Row {
        scenario: format!("held-{locks}"),
        backend: target.name.into(),
        ops: locks as u64,
        ops_per_sec: locks as f64 / acquired_in.as_secs_f64(),
        notes: format!(
            "{heap_per_lock:.0} heap bytes per held lock; {ticks_renewals} renew calls in 2 watchdog ticks (0 = the session keepalive covers them){}; lost {lost}",
            match (ticks_renewals, server_requests) {
                (0, Some(n)) => format!(", {:.0} server requests in them", n),
                (_, Some(n)) => format!(", {n:.0} server requests per call"),
                (_, None) => String::new(),
            },
        ),
        ..Row::default()
    }
}
