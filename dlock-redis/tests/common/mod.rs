//! What the waiting tests share.

use std::time::Duration;

use dlock_core::Locker;
use dlock_redis::{RedisBackend, RedisConfig};

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
