//! Contention on one key: `contended-16` (tasks of one client) and
//! `contended-clients-16` (independent clients), and what a contended
//! run saw, from one process or several.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_testkit::OverlapDetector;
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{counted, scenario, warm_up, Lockable, Unlock};
use crate::{contention::Contention, report::Row, Target};

/// The independent clients of `contended-clients`.
const CLIENTS: usize = 16;

/// Pairs of lock + unlock each client of `contended-clients` runs first.
const CLIENT_WARM_UP: usize = 20;

/// One client per task, each with its own connections and session, as
/// separate processes would have: task `i` locks through client `i`.
struct PerTask(Vec<Arc<dyn Lockable>>);

impl Lockable for PerTask {
    fn label(&self) -> &str {
        self.0[0].label()
    }

    fn lock<'a>(&'a self, task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        self.0[task % self.0.len()].lock(task, key)
    }

    fn redis_commands(&self) -> &'static [&'static str] {
        self.0[0].redis_commands()
    }

    fn settle(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            for client in &self.0 {
                client.settle().await;
            }
        })
    }
}

/// `contended-clients-16`: [`CLIENTS`] independent clients made by `make`
/// (dlock's, or a peer's), one task each, on one key: what 16 processes
/// contending look like, without the processes. Each client is warmed
/// first, alike.
pub(super) async fn contended_clients<F, Fut>(target: &Target, make: F, per_task: usize) -> Row
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Arc<dyn Lockable>>,
{
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        clients.push(make().await);
    }
    let sides: Vec<&dyn Lockable> = clients.iter().map(|c| &**c).collect();
    warm_up(&sides, None, CLIENT_WARM_UP).await;
    let clients: Arc<dyn Lockable> = Arc::new(PerTask(clients));
    let name = format!("contended-clients-{CLIENTS}");
    let row = counted(target, Some(&*clients), || async {
        Some(contended(target, clients.clone(), &name, CLIENTS, per_task).await)
    })
    .await;
    row.expect("a contended row")
}

pub(super) async fn contended(
    target: &Target,
    subject: Arc<dyn Lockable>,
    name: &str,
    tasks: usize,
    per_task: usize,
) -> Row {
    let detector = Arc::new(OverlapDetector::default());
    let last_owner = Arc::new(AtomicUsize::new(usize::MAX));
    let changes = Arc::new(AtomicUsize::new(0));
    let requests = target.count_requests();
    let cpu = target.cpu_open();
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
    contention.cpu = target.cpu_close(cpu);
    let ops = (tasks * per_task) as u64;
    let requests = requests.per_op(ops);
    contention.owner_changes = changes.load(Ordering::SeqCst);
    contention.overlaps = detector.overlaps();
    contention.row(
        scenario(&*subject, name.to_owned()),
        target,
        ops,
        elapsed,
        requests,
        tasks,
    )
}
