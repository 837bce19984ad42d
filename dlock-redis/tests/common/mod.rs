//! What the Redis test binaries share.
#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use dlock_core::Locker;
use dlock_redis::{redis, RedisBackend, RedisConfig};
use dlock_testkit::fixture::RedisServer;

/// A client of its own (its own connections), as another process would be,
/// whose every fallback timer is long: the waiter's poll without pub/sub
/// and, through `lease`, the holder's TTL and the ticket's refresh.
pub(crate) async fn client(url: &str, lease: Duration) -> Locker {
    let config = RedisConfig::from_url(url)
        .expect("url")
        .with_unwatched_poll(Duration::from_secs(60));
    let backend = RedisBackend::connect_with(config).await.expect("connect");
    Locker::builder(backend)
        .watchdog_lease(lease)
        .build()
        .expect("locker")
}

/// How many times `server` ran `command` (`INFO commandstats`).
pub(crate) async fn calls(server: &RedisServer, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut server.connection().await)
        .await
        .expect("INFO");
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}
