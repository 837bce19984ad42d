//! Redis Cluster (`redis+cluster://`), against a real cluster of 3 masters
//! with a replica each: the whole conformance suite, and a master killed
//! while it holds a lock.

use std::{sync::Arc, time::Duration};

use dlock_core::{backend::DynBackend, BackendExt, LockOptions};
use dlock_redis::RedisBackend;
use dlock_testkit::{fixture::RedisCluster, Harness};
use tokio::time::Instant;

fn cluster_harness() -> Harness {
    let cluster = RedisCluster::start(3, 1).expect("start a Redis Cluster");
    let url = cluster.url();
    Harness::new("redis cluster", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(RedisBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .keep_alive(cluster)
    .lists()
}

dlock_testkit::conformance_tests!(suite whole_suite_on_a_cluster, cluster_harness());

/// A locker on `cluster` whose waiters fall back to polling only every
/// 30 s, so that a wake-up seen sooner came on the release channel.
async fn woken_only_by_releases(cluster: &RedisCluster) -> dlock_core::Locker {
    let config = dlock_redis::RedisConfig::from_url(&cluster.url())
        .unwrap()
        .with_unwatched_poll(Duration::from_secs(30));
    RedisBackend::connect_with(config)
        .await
        .expect("connect to the cluster")
        .into_locker()
}

/// How many subscribers node `node` counts on `channel`, of `kind`
/// (`shardnumsub` or `numsub`).
fn subscribers(cluster: &RedisCluster, node: usize, kind: &str, channel: &str) -> u32 {
    cluster
        .cli(node, &["pubsub", kind, channel])
        .unwrap_or_default()
        .lines()
        .nth(1)
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or(0)
}

/// Node `node`'s shard subscribers on `channel`, once there is one or
/// 10 s have passed.
async fn until_shard_subscribed(cluster: &RedisCluster, node: usize, channel: &str) -> u32 {
    let started = Instant::now();
    while subscribers(cluster, node, "shardnumsub", channel) == 0
        && started.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    subscribers(cluster, node, "shardnumsub", channel)
}

/// A waiter is woken by the release on the key's shard channel: while it
/// waits, the master of the key's slot counts one shard subscriber on the
/// lock's channel (and no classic one), and the waiter is granted the
/// lock within 5 s of the release, with every fallback (the holder's
/// lease, the unwatched poll) at least 10 s away. A fair waiter, named by
/// the release, and an unfair one (`fair(false)`), told with everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_on_the_shard_channel() {
    let cluster = RedisCluster::start(3, 0).expect("start a Redis Cluster");
    for (key, fair) in [("wake", true), ("wake-unfair", false)] {
        let (holder, other) = (
            woken_only_by_releases(&cluster).await,
            woken_only_by_releases(&cluster).await,
        );
        let held = holder.lock(key).await.expect("the holder's lock");
        let waiter = tokio::spawn(async move {
            let options = LockOptions::new().wait(Duration::from_secs(25)).fair(fair);
            let guard = other.lock_with(key, options).await;
            (guard, Instant::now())
        });
        let master = cluster.master_of(key, 0).expect("the key's master");
        let channel = &format!("dlock:{{{key}}}:released");
        assert_eq!(
            until_shard_subscribed(&cluster, master, channel).await,
            1,
            "no shard subscriber on the lock's channel (fair {fair})"
        );
        assert_eq!(
            subscribers(&cluster, master, "numsub", channel),
            0,
            "a classic subscriber on a cluster"
        );
        // The unfair waiter marks the holder's value after it subscribed.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let released = Instant::now();
        held.release().await.expect("the release");
        let (guard, granted) = waiter.await.expect("the waiter's task");
        assert!(guard.is_ok(), "the waiter (fair {fair}): {guard:?}");
        assert!(
            granted - released < Duration::from_secs(5),
            "granted {:?} after the release (fair {fair}): not woken by it",
            granted - released
        );
    }
}

/// The master that owns a held lock's slot is killed (SIGKILL) after the
/// lock had time to reach its replica. While the replica takes over, and
/// after, nobody else is granted the lock, and its holder never hears it
/// lost: the watchdog renews it on the new master. Then a waiter queued
/// before the release is woken by it (on the shard channel, now served
/// by the new master), and new keys lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_hands_its_locks_to_the_replica() {
    let mut cluster = RedisCluster::start(3, 1).expect("start a Redis Cluster");
    let url = cluster.url();
    let connect = || async {
        RedisBackend::connect(&url)
            .await
            .expect("connect to the cluster")
            .into_locker()
    };
    let (holder, other) = (connect().await, connect().await);
    let key = "failover";
    let held = holder
        .lock(key)
        .await
        .expect("the lock before the failover");
    // Asynchronous replication: give the key time to reach the replica
    // (see the README's "In production" for what a failover inside this
    // window means).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let master = cluster.master_of(key, 0).expect("the key's master");
    cluster.nodes()[master].process().kill();
    let ask = (master + 1) % 6;
    let started = Instant::now();
    let mut took_over = false;
    let mut tries = 0;
    while started.elapsed() < Duration::from_secs(40) {
        // A try may wait for the cluster to move the slot: bounded here,
        // and not granted is all that counts.
        let taken = tokio::time::timeout(Duration::from_secs(2), other.try_lock(key)).await;
        tries += 1;
        if let Ok(Ok(Some(_))) = taken {
            panic!(
                "another client took the lock {:?} after the kill (holder lost: {})",
                started.elapsed(),
                held.is_lost()
            );
        }
        took_over = took_over || cluster.master_of(key, ask).is_ok_and(|now| now != master);
        // Keep trying for a while after the takeover.
        if took_over && tries >= 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(took_over, "no replica took over the killed master's slots");
    assert!(
        !held.is_lost(),
        "the holder heard its lock lost through a failover that kept it"
    );
    let waiter = tokio::spawn({
        let other = other.clone();
        async move {
            other
                .lock_with(key, LockOptions::new().wait(Duration::from_secs(20)))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    held.release().await.expect("the release on the new master");
    let woken = waiter.await.expect("the waiter's task");
    assert!(woken.is_ok(), "the waiter after the failover: {woken:?}");
    drop(woken);
    let fresh = holder
        .lock_with(
            "after-failover",
            LockOptions::new().wait(Duration::from_secs(10)),
        )
        .await;
    assert!(fresh.is_ok(), "a new key after the failover: {fresh:?}");
}

/// The slot of a key with a waiter moves to another master (as a reshard
/// does): the old owner unsubscribes the waiter's shard channel, and the
/// backend subscribes again, now on the new owner, which then counts the
/// subscriber; the release wakes the waiter there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_follows_its_channel_when_the_slot_moves() {
    let cluster = RedisCluster::start(3, 0).expect("start a Redis Cluster");
    let (holder, other) = (
        woken_only_by_releases(&cluster).await,
        woken_only_by_releases(&cluster).await,
    );
    let key = "moving";
    let held = holder.lock(key).await.expect("the holder's lock");
    let waiter = tokio::spawn(async move {
        other
            .lock_with(key, LockOptions::new().wait(Duration::from_secs(40)))
            .await
    });
    let channel = "dlock:{moving}:released";
    let from = cluster.master_of("moving", 0).expect("the key's master");
    assert_eq!(
        until_shard_subscribed(&cluster, from, channel).await,
        1,
        "the waiter never subscribed"
    );
    let to = (from + 1) % 3;
    cluster.move_slot("moving", to).expect("move the slot");
    assert_eq!(
        cluster.master_of("moving", to).unwrap(),
        to,
        "the slot moved"
    );
    assert_eq!(
        until_shard_subscribed(&cluster, to, channel).await,
        1,
        "the waiter's channel was not subscribed again on the slot's new master"
    );
    held.release().await.expect("the release");
    let granted = waiter.await.expect("the waiter's task");
    assert!(granted.is_ok(), "the waiter: {granted:?}");
}

/// Every master's script cache is flushed (a restart, `SCRIPT FLUSH`)
/// under a held lock: its renewals load the scripts again where they run
/// (`NOSCRIPT` answered by loading), so the lock stays held, and new
/// locks and releases work on every shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_script_caches_are_loaded_again_where_needed() {
    let cluster = RedisCluster::start(3, 0).expect("start a Redis Cluster");
    let lease = Duration::from_millis(900);
    let locker = dlock_core::Locker::builder(
        RedisBackend::connect(&cluster.url())
            .await
            .expect("connect to the cluster"),
    )
    .watchdog_lease(lease)
    .build()
    .unwrap();
    let held = locker.lock("flushed").await.expect("the lock");
    for node in 0..3 {
        cluster
            .cli(node, &["script", "flush"])
            .expect("SCRIPT FLUSH");
    }
    // Several renewals later, still held.
    tokio::time::sleep(lease * 3).await;
    assert!(!held.is_lost(), "the lock was lost after the flush");
    // Keys on every shard: each master needs the scripts again.
    for i in 0..12 {
        let guard = locker
            .lock_with(
                format!("flushed-{i}"),
                LockOptions::new().wait(Duration::from_secs(5)),
            )
            .await
            .unwrap_or_else(|e| panic!("key {i} after the flush: {e}"));
        guard.release().await.expect("release");
    }
    held.release().await.expect("the release");
}
