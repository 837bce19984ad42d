//! The metrics of Redis locks (one node, and Redlock over three), read back
//! through a debugging recorder (`dlock_testkit::check_metrics`).

use std::sync::Arc;

use dlock_core::backend::Backend;
use dlock_redis::RedisBackend;
use dlock_testkit::{fixture::RedisServer, Harness};

fn harness(name: &str, servers: Vec<RedisServer>, url: String) -> Harness {
    Harness::new(name, move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .keep_alive(servers)
}

#[test]
fn redis_locks_record_their_metrics() {
    let server = RedisServer::start().expect("start redis-server");
    let url = server.url();
    dlock_testkit::check_metrics(&harness("redis", vec![server], url), true);
}

#[test]
fn redlock_locks_record_their_metrics() {
    let servers = RedisServer::start_many(3).expect("start redis-server");
    let url = RedisServer::redlock_url(&servers);
    dlock_testkit::check_metrics(&harness("redlock", servers, url), true);
}
