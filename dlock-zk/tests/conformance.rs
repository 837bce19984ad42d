//! The whole conformance suite against a real standalone ZooKeeper. Every
//! client is a new `ZkBackend` with a session of its own.

use std::sync::Arc;

use dlock_core::backend::Backend;
use dlock_testkit::{fixture::ZooKeeperServer, Harness};
use dlock_zk::ZkBackend;

fn standalone() -> Harness {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    // A short session, so that crashed clients let others in quickly.
    let url = format!("zk://{}/dlock-test?session_timeout=2s", server.endpoint());
    Harness::new("zookeeper", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn Backend> = Arc::new(ZkBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .keep_alive(server)
}

dlock_testkit::conformance_tests!(standalone());
