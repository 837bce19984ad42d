//! Read-write locks and semaphores: `primitives`, and their contended
//! runs.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_core::{backend::Mode, LockOptions};
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{counted, serial, warm_up, Lockable, Unlock};
use crate::{report::Row, stats::Samples, Target};

/// dlock taking `mode` of a key rather than the whole key.
struct DlockMode(dlock_core::Locker, Mode, &'static str);

impl Lockable for DlockMode {
    fn label(&self) -> &str {
        self.2
    }

    fn lock<'a>(&'a self, _task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let options = LockOptions::new().wait(Duration::from_secs(120));
            let guard = self.0.lock_mode(key, self.1, options).await.expect("lock");
            Unlock(Box::pin(
                async move { guard.release().await.expect("release") },
            ))
        })
    }

    fn settle(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.0.wait_for_releases())
    }
}

/// The permits of the semaphore rows, and the share of writes in the
/// read-mostly row (one op in ten).
const PERMITS: u32 = 4;

const WRITE_EVERY: usize = 10;

/// Semaphores and read-write locks, where the backend has them: a permit
/// (1 of [`PERMITS`]) taken and given back serially against the plain
/// lock's raw floor; 16 tasks contending for the [`PERMITS`] permits; and
/// 16 tasks reading one key, one op in [`WRITE_EVERY`] a write.
pub(super) async fn primitives(target: &Target, serial_ops: usize, scale: usize) -> Vec<Row> {
    let locker = target.locker(None).await;
    let caps = locker.backend().capabilities();
    let mut rows = Vec::new();
    let permit = Mode::Permits {
        count: 1,
        limit: PERMITS,
    };
    if caps.supports(permit) {
        let subject = DlockMode(locker.clone(), permit, "permit 1 of 4");
        warm_up(&[&subject], None, serial_ops / 4).await;
        rows.extend(
            counted(target, Some(&subject), || async {
                Some(serial(target, &subject, serial_ops / 2).await)
            })
            .await,
        );
        rows.extend(
            counted(target, Some(&subject), || async {
                Some(
                    shared_contended(target, &locker, "permits-16", 100 / scale, move |_, _| {
                        permit
                    })
                    .await,
                )
            })
            .await,
        );
    }
    if caps.supports(Mode::Read) {
        rows.extend(
            counted(target, None, || async {
                let row =
                    shared_contended(target, &locker, "read-mostly-16", 100 / scale, |me, i| {
                        if (me + i) % WRITE_EVERY == 0 {
                            Mode::Write
                        } else {
                            Mode::Read
                        }
                    })
                    .await;
                locker.wait_for_releases().await;
                Some(row)
            })
            .await,
        );
    }
    rows
}

/// 16 tasks on one key, each op taking the mode `pick(task, op)` gives and
/// holding it 100 µs: ops/s, the wait, the most permits (or readers) held
/// at once, and writers that found anyone inside (must be 0).
async fn shared_contended(
    target: &Target,
    locker: &dlock_core::Locker,
    name: &str,
    per_task: usize,
    pick: impl Fn(usize, usize) -> Mode + Copy + Send + 'static,
) -> Row {
    const TASKS: usize = 16;
    let inside = Arc::new(AtomicUsize::new(0));
    let writing = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let broken = Arc::new(AtomicUsize::new(0));
    let requests = target.count_requests();
    let start = Instant::now();
    let handles: Vec<_> = (0..TASKS)
        .map(|me| {
            let locker = locker.clone();
            let (inside, writing, most, broken) = (
                inside.clone(),
                writing.clone(),
                most.clone(),
                broken.clone(),
            );
            tokio::spawn(async move {
                let mut waits = Vec::with_capacity(per_task);
                for i in 0..per_task {
                    let mode = pick(me, i);
                    let t = Instant::now();
                    let options = LockOptions::new().wait(Duration::from_secs(120));
                    let guard = locker
                        .lock_mode("bench:shared", mode, options)
                        .await
                        .expect("lock");
                    waits.push(t.elapsed());
                    if mode == Mode::Write {
                        if inside.load(Ordering::SeqCst) != 0
                            || writing.fetch_add(1, Ordering::SeqCst) != 0
                        {
                            broken.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_micros(100)).await;
                        writing.fetch_sub(1, Ordering::SeqCst);
                    } else {
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        if writing.load(Ordering::SeqCst) != 0 {
                            broken.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_micros(100)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
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
    let ops = (TASKS * per_task) as u64;
    let samples = Samples::new(waits);
    let most = most.load(Ordering::SeqCst);
    let broken = broken.load(Ordering::SeqCst);
    assert_eq!(broken, 0, "{name} on {}: a writer had company", target.name);
    if name.starts_with("permits") {
        assert!(most <= PERMITS as usize, "{name}: {most} permits at once");
    }
    Row {
        scenario: name.into(),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        requests: requests.per_op(ops),
        overlaps: Some(broken as u64),
        notes: format!(
            "wait times; at most {most} holders at once besides writers; writers with company 0"
        ),
        ..Row::default()
    }
}
