//! The whole conformance suite against real etcd: a single node (one test
//! per check), and a 3-member cluster (the whole suite in one test, on one
//! cluster). Every client is a new `EtcdBackend` with a connection and
//! session of its own; a cluster's clients know every member.

use std::sync::Arc;

use dlock_core::backend::Backend;
use dlock_etcd::EtcdBackend;
use dlock_testkit::{fixture::EtcdServer, Harness};

fn harness(name: &str, servers: Vec<EtcdServer>) -> Harness {
    let endpoints: Vec<String> = servers.iter().map(EtcdServer::endpoint).collect();
    let url = format!("etcd://{}/dlock-test", endpoints.join(","));
    Harness::new(name, move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn Backend> = Arc::new(EtcdBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .keep_alive(servers)
}

fn single_node() -> Harness {
    harness("etcd", vec![EtcdServer::start().expect("start etcd")])
}

fn cluster_of_three() -> Harness {
    harness(
        "etcd-3",
        EtcdServer::cluster(3).expect("start an etcd cluster"),
    )
}

dlock_testkit::conformance_tests!(single_node());
dlock_testkit::conformance_tests!(suite whole_suite_on_a_3_member_cluster, cluster_of_three());
