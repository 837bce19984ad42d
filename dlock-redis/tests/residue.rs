//! What dlock leaves on a Redis server: only the fencing counters, for at
//! most ten minutes, once every lock is released and the leases have
//! passed; and the fencing tokens still grow after the counter that made
//! them was set back or lost (a failover to a lagging replica, a restart
//! from an older snapshot, `FLUSHALL`).

use std::time::Duration;

use dlock_core::{DistSemaphore, LockOptions, LockerBuilder};
use dlock_redis::{redis, RedisBackend};
use dlock_testkit::fixture::RedisServer;

async fn keys(server: &RedisServer) -> Vec<String> {
    let mut conn = server.connection().await;
    redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .expect("KEYS")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_server_holds_only_fence_counters_once_the_leases_have_passed() {
    let server = RedisServer::start().expect("redis-server");
    let lease = Duration::from_millis(300);
    let locker = LockerBuilder::from_arc(std::sync::Arc::new(
        RedisBackend::connect(&server.url()).await.expect("connect"),
    ))
    .watchdog_lease(lease)
    .build()
    .expect("options");
    for i in 0..50 {
        let key = format!("order:{i}");
        // Watchdog leases, released both ways; fixed leases; one leaked.
        locker
            .lock(&key)
            .await
            .expect("lock")
            .release()
            .await
            .expect("release");
        drop(locker.lock(&key).await.expect("lock"));
        let fixed = LockOptions::new().lease(lease);
        let guard = locker.lock_with(&key, fixed).await.expect("lock");
        if i == 0 {
            guard.leak();
        } else {
            guard.release().await.expect("release");
        }
    }
    locker.wait_for_releases().await;
    assert!(
        !keys(&server).await.is_empty(),
        "the fence counters live while the leases could"
    );
    // Twice the lease, and a margin: the locks, lines and values are gone.
    tokio::time::sleep(2 * lease + Duration::from_millis(700)).await;
    let left = keys(&server).await;
    let others: Vec<_> = left.iter().filter(|k| !k.ends_with(":fence")).collect();
    assert!(others.is_empty(), "keys left on an idle server: {others:?}");
    // The counters outlive a short lease (so that a clock stepped back
    // cannot reseed them lower), for ten minutes at most.
    assert_eq!(left.len(), 50, "one counter per key: {left:?}");
    let mut conn = server.connection().await;
    for key in &left {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .expect("PTTL");
        assert!(
            (500_000..=600_000).contains(&ttl),
            "{key} expires in {ttl} ms"
        );
    }
}

/// Sets every fencing counter on `server` back by 1,000 (keeping its
/// TTL), as a failover to a replica that missed the last increments, or a
/// restart from an older snapshot, leaves it.
async fn set_counters_back(server: &RedisServer) -> usize {
    let mut conn = server.connection().await;
    let counters: Vec<String> = keys(server)
        .await
        .into_iter()
        .filter(|k| k.ends_with(":fence"))
        .collect();
    for key in &counters {
        let value: i64 = redis::cmd("GET")
            .arg(key)
            .query_async(&mut conn)
            .await
            .expect("GET");
        let () = redis::cmd("SET")
            .arg(key)
            .arg(value - 1_000)
            .arg("KEEPTTL")
            .query_async(&mut conn)
            .await
            .expect("SET");
    }
    counters.len()
}

/// Fences of a mutex, a write lock and a semaphore are above every
/// earlier one after the counters were set back, and after `FLUSHALL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_only_grow_after_the_counter_is_set_back_or_flushed() {
    let server = RedisServer::start().expect("redis-server");
    let locker = dlock_core::BackendExt::into_locker(
        RedisBackend::connect(&server.url()).await.expect("connect"),
    );
    let semaphore = DistSemaphore::new(&locker, "stale:semaphore", 2);
    let fences = || async {
        let mut fences = Vec::new();
        for _ in 0..3 {
            let guard = locker.lock("stale:mutex").await.expect("lock");
            fences.push(("mutex", guard.fencing_token().expect("a fence")));
            guard.release().await.expect("release");
            let guard = locker.write("stale:rw").await.expect("write");
            fences.push(("write", guard.fencing_token().expect("a fence")));
            guard.release().await.expect("release");
            let permit = semaphore.acquire().await.expect("permit");
            let fence = permit.fencing_token().expect("a fence");
            fences.push(("permit", fence));
            permit.release().await.expect("release");
        }
        fences
    };
    let mut last = std::collections::HashMap::new();
    let mut check = |round: &str, fences: Vec<(&'static str, u64)>| {
        for (kind, fence) in fences {
            let before = last.insert(kind, fence).unwrap_or(0);
            assert!(
                fence > before,
                "{round}: a {kind} fence {fence} after {before}"
            );
        }
    };
    check("first", fences().await);
    assert_eq!(set_counters_back(&server).await, 3, "one counter per lock");
    check("after the counters were set back", fences().await);
    let mut conn = server.connection().await;
    let () = redis::cmd("FLUSHALL")
        .query_async(&mut conn)
        .await
        .expect("FLUSHALL");
    check("after FLUSHALL", fences().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_keep_growing_after_the_counter_went_away_with_the_lock() {
    let server = RedisServer::start().expect("redis-server");
    let locker = dlock_core::BackendExt::into_locker(
        RedisBackend::connect(&server.url()).await.expect("connect"),
    );
    let lease = Duration::from_millis(50);
    let short = LockOptions::new().lease(lease);
    let mut last = 0;
    for round in 0..4 {
        let guard = locker.lock_with("fenced", short).await.expect("lock");
        let fence = guard
            .fencing_token()
            .expect("single-node Redis gives fences");
        assert!(fence > last, "round {round}: fence {fence} after {last}");
        last = fence;
        guard.release().await.expect("release");
        if round % 2 == 1 {
            // The counter is lost (evicted, or expired after ten idle
            // minutes): the next token comes from the clock.
            let mut conn = server.connection().await;
            let deleted: i64 = redis::cmd("DEL")
                .arg("dlock:{fenced}:fence")
                .query_async(&mut conn)
                .await
                .expect("DEL");
            assert_eq!(deleted, 1, "the counter's name");
        }
    }
}
