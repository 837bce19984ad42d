//! What holding costs: `reentrant` (a re-lock, no I/O), `held` (the
//! renewal of many held locks) and `retained` (heap left per lock once
//! released).

use std::{sync::Arc, time::Duration};

use dlock_testkit::CountingBackend;
use tokio::time::Instant;

use crate::{report::Row, Target};

pub(super) async fn reentrant(target: &Target, ops: usize) -> Row {
    let locker = target.locker(None).await;
    let outer = locker.lock("bench:reentrant").await.expect("lock");
    let start = Instant::now();
    outer
        .scope(async {
            for _ in 0..ops {
                drop(locker.lock("bench:reentrant").await.expect("re-lock"));
            }
        })
        .await;
    let elapsed = start.elapsed();
    outer.release().await.expect("release");
    locker.wait_for_releases().await;
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

pub(super) async fn held(target: &Target, locks: usize) -> Row {
    // Ticks (a third of it) far enough apart that a renewal of all the
    // locks (500,000 scripts on Redlock-5), counted through `MONITOR` on
    // one pinned CPU, ends before the next begins. At a 6 s lease (2 s
    // ticks), Redlock-5's renewals of 100,000 locks timed out on this
    // 2-CPU machine and 59,315 locks were lost.
    let lease = Duration::from_secs(15);
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
    // The window starts and ends with no renewal on its way, so that it
    // counts whole renewals (a pipeline of 100,000 commands takes a while).
    let settled = || async {
        let until = Instant::now() + lease;
        while Instant::now() < until {
            if counting.renewals_answered() == counting.renewals() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("renewals kept coming without a pause for a whole lease");
    };
    // Two watchdog ticks (a third of the lease each) as the application
    // sees them: the heap is sampled meanwhile and its lowest reading kept
    // (what the held locks cost, not the buffers of a renewal batch in
    // flight), and the locks lost are counted at their end.
    settled().await;
    let renewals_before = counting.renewals();
    let until = Instant::now() + lease * 2 / 3 + Duration::from_millis(100);
    let mut heap = isize::MAX;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
        heap = heap.min(crate::alloc::live_bytes());
    }
    settled().await;
    let heap_per_lock = (heap - heap_before) as f64 / locks as f64;
    let ticks_renewals = counting.renewals() - renewals_before;
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    // Then two more, with every server's requests counted. Counting
    // slows the servers (Redis's `MONITOR` prints every command a script
    // runs, too: Redlock-5's renewal of 100,000 locks took 1.5 s without
    // it and 4 to 5 s with it, and lost locks), so nothing above comes
    // from this window.
    let _pass = target.counting_pass();
    let requests = target.count_requests();
    settled().await;
    let (counted_before, requests_before) = (counting.renewals(), requests.so_far());
    tokio::time::sleep(lease * 2 / 3 + Duration::from_millis(100)).await;
    settled().await;
    let counted = counting.renewals() - counted_before;
    let lost_counted = guards.iter().filter(|g| g.is_lost()).count() - lost;
    let server_requests = requests_before
        .zip(requests.so_far())
        .map(|(before, after)| (after - before) as f64 / counted.max(1) as f64);
    drop(guards);
    // Settled before the next scenario: its requests are not these
    // releases'.
    locker.wait_for_releases().await;
    Row {
        scenario: format!("held-{locks}"),
        backend: target.name.into(),
        ops: locks as u64,
        ops_per_sec: locks as f64 / acquired_in.as_secs_f64(),
        notes: format!(
            "{heap_per_lock:.0} heap bytes per held lock; {ticks_renewals} renew calls in 2 watchdog ticks (0 = the session keepalive covers them){}; lost {lost} ({lost_counted} more while the requests were counted)",
            match (counted, server_requests) {
                (0, Some(n)) => format!(", {:.0} server requests in them", n),
                (_, Some(n)) => format!(", {n:.0} server requests per call"),
                (_, None) => String::new(),
            },
        ),
        ..Row::default()
    }
}

/// How the `retained` scenario's tasks give their lock back.
#[derive(Debug, Clone, Copy)]
pub(super) enum Release {
    /// `release().await`.
    Explicit,
    /// Dropping the guard (the release runs in a task of its own).
    Drop,
}

/// `tasks` tasks, 64 at a time on 64 keys, each locking and releasing once:
/// the heap bytes still allocated per task once every release has settled.
/// Anything a lock leaves behind after its release grows this number.
pub(super) async fn retained(target: &Target, tasks: usize, release: Release) -> Row {
    const AT_ONCE: usize = 64;
    let locker = target.locker(None).await;
    let run = |count: usize| {
        let locker = locker.clone();
        async move {
            for batch in 0..count.div_ceil(AT_ONCE) {
                let handles: Vec<_> = (0..AT_ONCE.min(count - batch * AT_ONCE))
                    .map(|i| {
                        let locker = locker.clone();
                        tokio::spawn(async move {
                            let guard = locker
                                .lock(format!("bench:retained:{i}"))
                                .await
                                .expect("lock");
                            match release {
                                Release::Explicit => guard.release().await.expect("release"),
                                Release::Drop => drop(guard),
                            }
                        })
                    })
                    .collect();
                for h in handles {
                    h.await.expect("task");
                }
            }
            locker.wait_for_releases().await;
        }
    };
    // The first rounds grow what is reused later (connection buffers, the
    // runtime's task slabs, the server-side maps of a memory backend).
    run(tasks / 10).await;
    let before = crate::alloc::live_bytes();
    let start = Instant::now();
    run(tasks).await;
    let elapsed = start.elapsed();
    let after = crate::alloc::live_bytes();
    let per_task = (after - before) as f64 / tasks as f64;
    let how = match release {
        Release::Explicit => "release().await",
        Release::Drop => "drop",
    };
    Row {
        scenario: format!("retained-{tasks} ({how})"),
        backend: target.name.into(),
        ops: tasks as u64,
        ops_per_sec: tasks as f64 / elapsed.as_secs_f64(),
        notes: format!(
            "{per_task:.1} heap bytes retained per task after lock + {how} and settled releases ({} in all)",
            after - before
        ),
        ..Row::default()
    }
}
