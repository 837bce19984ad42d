//! What dlock leaves on a Redis server: nothing, once every lock is
//! released and the leases have passed; and the fencing tokens still grow
//! after the counter that made them went away with the lock.

use std::time::Duration;

use dlock_core::{LockOptions, LockerBuilder};
use dlock_redis::{redis, RedisBackend};
use dlock_testkit::fixture::RedisServer;

async fn keys(server: &RedisServer) -> Vec<String> {
    let client = redis::Client::open(server.url()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .expect("KEYS")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_server_holds_no_dlock_keys_once_the_leases_have_passed() {
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
    // Twice the lease (the counters' life), and a margin.
    tokio::time::sleep(2 * lease + Duration::from_millis(700)).await;
    let left = keys(&server).await;
    assert!(left.is_empty(), "keys left on an idle server: {left:?}");
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
            // Past the counter's life (twice the lease): it is gone, and
            // the next token comes from a fresh seed.
            tokio::time::sleep(lease * 2 + Duration::from_millis(200)).await;
            assert!(keys(&server).await.is_empty());
        }
    }
}
