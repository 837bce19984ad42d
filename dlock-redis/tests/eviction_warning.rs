//! A node whose `maxmemory-policy` can evict lock keys is warned about when
//! dlock connects. Alone in its test binary: tracing caches which callsites
//! are enabled process-wide.

use dlock_redis::{redis, RedisBackend};
use dlock_testkit::fixture::RedisServer;

async fn set_policy(server: &RedisServer, policy: &str) {
    let mut conn = server.connection().await;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(policy)
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET");
}

#[test]
fn a_node_that_can_evict_lock_keys_is_warned_about_and_a_safe_one_is_not() {
    let captured = dlock_testkit::CapturedLog::default();
    let logged = || captured.text();
    captured.block_on(tracing::Level::WARN, async {
        let server = RedisServer::start().expect("redis-server");
        set_policy(&server, "noeviction").await;
        drop(RedisBackend::connect(&server.url()).await.expect("connect"));
        assert!(
            !logged().contains("maxmemory-policy"),
            "warned about noeviction: {}",
            logged()
        );
        set_policy(&server, "volatile-lru").await;
        drop(RedisBackend::connect(&server.url()).await.expect("connect"));
    });
    let logged = logged();
    assert!(
        logged.contains("maxmemory-policy") && logged.contains("volatile-lru"),
        "no warning for volatile-lru: {logged:?}"
    );
}
