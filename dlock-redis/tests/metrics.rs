//! The metrics of Redis locks (one node, and Redlock over three), read back
//! through a debugging recorder (`dlock_testkit::check_metrics`).

use dlock_testkit::{fixture::RedisServer, Harness};

#[test]
fn redis_locks_record_their_metrics() {
    let server = RedisServer::start().expect("start redis-server");
    let url = server.url();
    dlock_testkit::check_metrics(&Harness::redis("redis", url, vec![server]), true);
}

#[test]
fn redlock_locks_record_their_metrics() {
    let servers = RedisServer::start_many(3).expect("start redis-server");
    let url = RedisServer::redlock_url(&servers);
    dlock_testkit::check_metrics(&Harness::redis("redlock", url, servers), true);
}
