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
use tokio::time::Instant;

use crate::{stats::Samples, Row, Target};

/// Every scenario for `target`.
pub(crate) async fn run_all(target: &Target, quick: bool) -> Vec<Row> {
    let scale = if quick { 5 } else { 1 };
    let serial_ops = if target.raw.is_none() { 100_000 } else { 2_000 } / scale;
    warm_up(target, serial_ops / 2).await;
    vec![
        serial(target, serial_ops).await,
        distinct(target, 64, 40 / scale).await,
        contended(target, 16, 100 / scale).await,
        reentrant(target, 100_000 / scale).await,
        held(
            target,
            if target.raw.is_none() { 10_000 } else { 2_000 } / scale,
        )
        .await,
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

async fn serial(target: &Target, ops: usize) -> Row {
    let locker = target.locker(None).await;
    let mut samples = Vec::with_capacity(ops);
    let start = Instant::now();
    for _ in 0..ops {
        let t = Instant::now();
        let guard = locker.lock("bench:serial").await.expect("lock");
        guard.release().await.expect("release");
        samples.push(t.elapsed());
    }
    let elapsed = start.elapsed();
    let samples = Samples::new(samples);
    let mut row = Row {
        scenario: "serial".into(),
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
        let mut floor = Vec::with_capacity(ops);
        for _ in 0..ops {
            let t = Instant::now();
            raw.lock_unlock("bench-raw-serial", &token).await;
            floor.push(t.elapsed());
        }
        let floor = Samples::new(floor).quantile(0.5);
        row.raw_p50 = Some(floor);
        row.ratio = Some(row.p50.as_secs_f64() / floor.as_secs_f64());
    }
    row
}

async fn distinct(target: &Target, tasks: usize, per_task: usize) -> Row {
    let locker = target.locker(None).await;
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let key = format!("bench:distinct:{i}");
                let mut samples = Vec::with_capacity(per_task);
                for _ in 0..per_task {
                    let t = Instant::now();
                    locker
                        .lock(&key)
                        .await
                        .expect("lock")
                        .release()
                        .await
                        .expect("release");
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
        scenario: format!("distinct-{tasks}"),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        ..Row::default()
    };
    if let Some(raw) = &target.raw {
        let start = Instant::now();
        let runs = (0..tasks).map(|i| async move {
            let (key, token) = (
                format!("bench-raw-distinct-{i}"),
                Token::generate().to_string(),
            );
            for _ in 0..per_task {
                raw.lock_unlock(&key, &token).await;
            }
        });
        futures_util::future::join_all(runs).await;
        let raw_ops = ops as f64 / start.elapsed().as_secs_f64();
        row.raw_ops_per_sec = Some(raw_ops);
        row.ratio = Some(raw_ops / row.ops_per_sec);
    }
    row
}

async fn contended(target: &Target, tasks: usize, per_task: usize) -> Row {
    let locker = target.locker(None).await;
    let detector = Arc::new(OverlapDetector::default());
    let last_owner = Arc::new(AtomicUsize::new(usize::MAX));
    let changes = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|me| {
            let (locker, detector) = (locker.clone(), detector.clone());
            let (last_owner, changes) = (last_owner.clone(), changes.clone());
            tokio::spawn(async move {
                let mut waits = Vec::with_capacity(per_task);
                for _ in 0..per_task {
                    let t = Instant::now();
                    let guard = locker
                        .lock_with(
                            "bench:contended",
                            LockOptions::new().wait(Duration::from_secs(120)),
                        )
                        .await
                        .expect("lock");
                    waits.push(t.elapsed());
                    {
                        let _section = detector.enter();
                        if last_owner.swap(me, Ordering::SeqCst) != me {
                            changes.fetch_add(1, Ordering::SeqCst);
                        }
                        // A short critical section.
                        tokio::time::sleep(Duration::from_micros(100)).await;
                    }
                    guard.release().await.expect("release");
                }
                waits
            })
        })
        .collect();
    let mut waits = Vec::new();
    for h in handles {
        waits.extend(h.await.expect("task"));
    }
    let elapsed = start.elapsed();
    let ops = (tasks * per_task) as u64;
    let waits = Samples::new(waits);
    Row {
        scenario: format!("contended-{tasks}"),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: waits.quantile(0.5),
        p99: waits.quantile(0.99),
        max: waits.max(),
        notes: format!(
            "wait times; owner changes {} of {ops}; overlaps {}",
            changes.load(Ordering::SeqCst),
            detector.overlaps()
        ),
        ..Row::default()
    }
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
    let counting = Arc::new(CountingBackend::new(base.backend().clone()));
    let locker = dlock_core::LockerBuilder::from_arc(counting.clone())
        .watchdog_lease(lease)
        .build()
        .expect("options");
    let start = Instant::now();
    let tasks: Vec<_> = (0..64)
        .map(|t| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let mut guards = Vec::new();
                for i in (t..locks).step_by(64) {
                    guards.push(locker.lock(format!("bench:held:{i}")).await.expect("lock"));
                }
                guards
            })
        })
        .collect();
    let mut guards = Vec::new();
    for t in tasks {
        guards.extend(t.await.expect("task"));
    }
    let acquired_in = start.elapsed();
    let before = counting.renewals();
    // Two watchdog ticks (a third of the lease each).
    tokio::time::sleep(lease * 2 / 3 + Duration::from_millis(100)).await;
    let ticks_renewals = counting.renewals() - before;
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    drop(guards);
    Row {
        scenario: format!("held-{locks}"),
        backend: target.name.into(),
        ops: locks as u64,
        ops_per_sec: locks as f64 / acquired_in.as_secs_f64(),
        notes: format!(
            "renew calls in 2 ticks: {ticks_renewals} (0 = the backend's session keepalive covers them); lost {lost}"
        ),
        ..Row::default()
    }
}
