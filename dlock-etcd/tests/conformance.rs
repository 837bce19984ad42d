//! The whole conformance suite against a real single-node etcd. Every
//! client is a new `EtcdBackend` with a connection and session of its own.

use std::sync::Arc;

use dlock_core::backend::Backend;
use dlock_etcd::EtcdBackend;
use dlock_testkit::{fixture::EtcdServer, Harness};

fn single_node() -> Harness {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/dlock-test", server.endpoint());
    Harness::new("etcd", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn Backend> = Arc::new(EtcdBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .keep_alive(server)
}

dlock_testkit::conformance_tests!(single_node());
