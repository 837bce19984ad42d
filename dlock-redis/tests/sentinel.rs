//! Redis Sentinel against real servers: a master, its replica and three
//! `redis-sentinel` processes, started by the fixture. The master is
//! killed under held locks, a queued waiter and a stream of lock holders;
//! the backend follows the master the sentinels promote.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_core::{LockOptions, Locker};
use dlock_redis::{redis, RedisBackend};
use dlock_testkit::{fixture::RedisSentinels, OverlapDetector};
use tokio::time::Instant;

async fn locker(url: &str, lease: Duration) -> Locker {
    let backend = RedisBackend::connect(url)
        .await
        .expect("connect through the sentinels");
    Locker::builder(backend)
        .watchdog_lease(lease)
        .build()
        .unwrap()
}

/// Waits until the replica has every write the master has (`WAIT`), so
/// that a failover loses nothing by accident.
async fn replicated(set: &mut RedisSentinels) {
    let mut conn = set.master().connection().await;
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(acked, 1, "the replica did not acknowledge the writes");
}

/// The master is killed while one client holds two locks and another
/// waits in line for one of them. The sentinels promote the replica; the
/// backend follows it. The promoted master then lacks one lock's key (a
/// write that asynchronous replication lost, made here by deleting it):
/// that guard reports lost at its next renewal, while the other stays
/// held. Fences keep rising, and the queued waiter is granted the kept
/// lock when its holder releases it on the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_keeps_what_the_new_master_has_and_reports_what_it_lost() {
    let mut set = RedisSentinels::start().expect("start a master, a replica and 3 sentinels");
    let url = set.url();
    // Longer than the failover takes (the master is declared down after
    // 1 s, then the sentinels elect a leader and promote): a lease that
    // runs out while no master answers is lost, rightly.
    let lease = Duration::from_secs(9);
    let (holder, other) = (locker(&url, lease).await, locker(&url, lease).await);
    let kept = holder.lock("kept").await.unwrap();
    let dropped = holder.lock("dropped").await.unwrap();
    let waiter = tokio::spawn(async move {
        let guard = other
            .lock_with("kept", LockOptions::new().wait(Duration::from_secs(60)))
            .await;
        guard.map(|g| (Instant::now(), g.fencing_token()))
    });
    // Queued behind the holder before the failover.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "the waiter was granted a held lock");
    replicated(&mut set).await;
    let before = kept.fencing_token().max(dropped.fencing_token());

    let mut set = tokio::task::spawn_blocking(move || set.fail_over().map(|()| set))
        .await
        .unwrap()
        .expect("the replica takes over");
    let mut promoted = set.master().connection().await;
    let deleted: i64 = redis::cmd("DEL")
        .arg("dlock:{dropped}")
        .query_async(&mut promoted)
        .await
        .unwrap();
    assert_eq!(deleted, 1, "the promoted master never had the lock's key");

    let told = tokio::time::timeout(Duration::from_secs(15), dropped.lost()).await;
    assert!(
        told.is_ok(),
        "the guard whose key the new master lacks never reported lost"
    );
    // The renewal that found the key gone renewed the other lock in the
    // same round; and one round later it is still held.
    assert!(!kept.is_lost(), "{:?}", kept.state());
    tokio::time::sleep(lease / 3).await;
    assert!(
        !kept.is_lost(),
        "a lock the new master holds was reported lost: {:?}",
        kept.state()
    );

    let fresh = holder
        .lock("fresh")
        .await
        .expect("a lock on the new master");
    assert!(
        fresh.fencing_token() > before,
        "fences went backwards across the failover: {:?} after {before:?}",
        fresh.fencing_token()
    );
    let kept_fence = kept.fencing_token();
    let released = Instant::now();
    kept.release().await.expect("released on the new master");
    let (granted, fence) = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the queued waiter was never granted after the failover")
        .unwrap()
        .expect("the waiter's lock");
    assert!(fence > kept_fence, "{fence:?} after {kept_fence:?}");
    assert!(
        granted.duration_since(released) < Duration::from_secs(5),
        "granted {:?} after the release",
        granted.duration_since(released)
    );
}

/// Four tasks on two clients (made by `dlock::connect_backend`, as an
/// application names the deployment by URL) take turns at one key, each
/// holding it for a few milliseconds, while the master is killed and the
/// replica promoted: holds resume on the new master, and none overlaps.
/// The killed master grants nothing, so this cannot make a split brain:
/// it shows that a stream of holders rides through a failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_resume_on_the_new_master_after_a_failover_without_overlap() {
    let mut set = RedisSentinels::start().expect("start a master, a replica and 3 sentinels");
    let url = set.url();
    let lease = Duration::from_secs(2);
    // Through `dlock::connect_backend`, as an application names it by URL.
    let client = || async {
        let backend = dlock_testkit::connect(&url).await.expect("connect by URL");
        dlock_core::LockerBuilder::from_arc(backend)
            .watchdog_lease(lease)
            .build()
            .unwrap()
    };
    let clients = [client().await, client().await];
    let detector = Arc::new(OverlapDetector::default());
    let stop = Arc::new(AtomicBool::new(false));
    let after_failover = Arc::new(AtomicBool::new(false));
    let held_after = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let locker = clients[i % 2].clone();
        let (detector, stop) = (detector.clone(), stop.clone());
        let (after_failover, held_after) = (after_failover.clone(), held_after.clone());
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            while !stop.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(90) {
                let options = LockOptions::new().wait(Duration::from_secs(2));
                let Ok(guard) = locker.lock_with("stream", options).await else {
                    // No master yet: an error may come at once.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                {
                    let _section = detector.enter();
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(5)) => {}
                        _ = guard.lost() => {}
                    }
                }
                if after_failover.load(Ordering::SeqCst) {
                    held_after.fetch_add(1, Ordering::SeqCst);
                }
                let _ = guard.release().await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = detector.entries();
    assert!(before > 0, "no hold before the failover");
    let set = tokio::task::spawn_blocking(move || set.fail_over().map(|()| set))
        .await
        .unwrap()
        .expect("the replica takes over");
    after_failover.store(true, Ordering::SeqCst);
    let resumed = Instant::now();
    while held_after.load(Ordering::SeqCst) < 20 && resumed.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("a holder task never ended")
            .unwrap();
    }
    assert!(
        held_after.load(Ordering::SeqCst) >= 20,
        "holds did not resume on the new master: {} after the failover",
        held_after.load(Ordering::SeqCst)
    );
    drop(set);
    assert_eq!(
        detector.overlaps(),
        0,
        "{} of {} holds overlapped",
        detector.overlaps(),
        detector.entries()
    );
}

/// With `wait_replicas=1`, a grant or a renewal counts only once the
/// replica has acknowledged it. With the replica paused, a held guard's
/// renewals are not acknowledged, so it reports lost when its lease runs
/// out; an acquisition fails with a backend error that names
/// `wait_replicas`, and gives the key back (a client without the option
/// takes it). With the replica back, grants go through again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_replicas_a_grant_counts_only_once_a_replica_has_it() {
    let mut set = RedisSentinels::start().expect("start a master, a replica and 3 sentinels");
    let url = format!("{}?wait_replicas=1&wait_timeout=200ms", set.url());
    let lease = Duration::from_secs(2);
    let (waiting, plain) = (locker(&url, lease).await, locker(&set.url(), lease).await);
    let held = waiting
        .lock("held")
        .await
        .expect("granted with the replica up");

    set.replica().process().pause().unwrap();
    let told = tokio::time::timeout(lease * 3, held.lost()).await;
    let refused = waiting
        .lock_with("next", LockOptions::new().wait(Duration::from_secs(5)))
        .await;
    let given_back = plain
        .lock_with("next", LockOptions::new().wait(Duration::from_secs(3)))
        .await;
    set.replica().process().resume().unwrap();
    assert!(
        told.is_ok(),
        "renewals no replica acknowledged kept the guard: {:?}",
        held.state()
    );
    match refused {
        Err(e @ dlock_core::LockError::Backend { .. }) => {
            assert!(e.to_string().contains("wait_replicas"), "{e}")
        }
        other => panic!("granted without the replica's acknowledgement: {other:?}"),
    }
    let given_back = given_back.expect("the unacknowledged grant was not given back");
    given_back.release().await.unwrap();

    let mut again = None;
    for _ in 0..50 {
        match waiting.try_lock("next").await {
            Ok(Some(guard)) => {
                again = Some(guard);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert!(again.is_some(), "no grant once the replica was back");
}

/// The master is cut off from the sentinels and its replica (not killed)
/// while it runs on and takes writes from a client that still reaches its
/// own port; the sentinels promote the replica. With `wait_replicas=1`, as
/// the README promises: the old master grants nothing its client could act
/// on (an acquisition there fails, naming `wait_replicas`), its holder
/// reports lost by its own clock, the new master grants that lock (to a
/// client without the option: it has no replica) only after, and every
/// fence the new master gives is above the old master's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_replicas_a_partitioned_master_grants_nothing_to_act_on() {
    let mut set = RedisSentinels::start_partitionable()
        .await
        .expect("start a master behind a proxy, a replica and 3 sentinels");
    let query = "wait_replicas=1&wait_timeout=200ms";
    let lease = Duration::from_secs(3);
    let stuck = locker(&format!("{}?{query}", set.master().url()), lease).await;
    // Without `wait_replicas`: the new master has no replica to wait for.
    let follower = locker(&set.url(), lease).await;
    let held = stuck
        .lock("held")
        .await
        .expect("granted with the replica up");
    let old_fence = held.fencing_token().expect("a fence");

    set.partition_master()
        .expect("the sentinels promote the replica");
    // The old master runs on and takes writes from a client that reaches it.
    let mut old = set.replica().connection().await;
    let () = redis::cmd("SET")
        .arg("partitioned:write")
        .arg(1)
        .query_async(&mut old)
        .await
        .expect("the partitioned master takes writes");
    let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut old).await.unwrap();
    assert_eq!(
        role.first(),
        Some(&redis::Value::BulkString(b"master".to_vec())),
        "the partitioned server is no master any more: {role:?}"
    );

    let refused = stuck
        .lock_with("fresh", LockOptions::new().wait(Duration::from_secs(2)))
        .await;
    match refused {
        Err(e @ dlock_core::LockError::Backend { .. }) => {
            assert!(e.to_string().contains("wait_replicas"), "{e}")
        }
        other => panic!("the partitioned master granted: {other:?}"),
    }
    let told = tokio::time::timeout(lease * 3, held.lost()).await;
    assert!(
        told.is_ok(),
        "the holder on the partitioned master never heard"
    );

    let taken = follower
        .lock_with("held", LockOptions::new().wait(lease * 4))
        .await
        .expect("the new master grants the lock once its lease ran out");
    assert!(held.is_lost(), "granted twice: the old holder still holds");
    let fresh = follower.lock("fresh").await.expect("a fresh lock");
    for guard in [&taken, &fresh] {
        let fence = guard.fencing_token().expect("a fence");
        assert!(fence > old_fence, "fence {fence} after {old_fence}");
    }
    assert_ne!(taken.fencing_token(), fresh.fencing_token());
    taken.release().await.unwrap();
    fresh.release().await.unwrap();
}
