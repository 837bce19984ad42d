//! The whole conformance suite against real `redis-server` processes: one
//! node (with fencing tokens, and without: `fence=off`), and Redlock over
//! five. Every client is a new `RedisBackend` with
//! connections of its own, as another process would have.

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

fn single_node() -> Harness {
    let server = RedisServer::start().expect("start redis-server");
    let url = server.url();
    harness("redis", vec![server], url)
}

/// One node with `fence=off`: the uncontended acquire is a plain `SET NX
/// PX`, and the suite checks that no fence is given.
fn single_node_unfenced() -> Harness {
    let server = RedisServer::start().expect("start redis-server");
    let url = format!("{}?fence=off", server.url());
    harness("redis-unfenced", vec![server], url)
}

fn redlock_of_five() -> Harness {
    let servers = RedisServer::start_many(5).expect("start redis-server");
    let url = RedisServer::redlock_url(&servers);
    harness("redlock", servers, url)
}

mod single {
    dlock_testkit::conformance_tests!(super::single_node());
}

mod single_unfenced {
    dlock_testkit::conformance_tests!(super::single_node_unfenced());
}

mod redlock {
    dlock_testkit::conformance_tests!(super::redlock_of_five());
}
