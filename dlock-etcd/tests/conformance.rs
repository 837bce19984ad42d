//! The whole conformance suite against real etcd: a single node (one test
//! per check, each with keys of its own on one server the binary's tests
//! share), a 3-member cluster (the whole suite in one test), and the
//! checks of plain locks on a single node in `etcdctl lock`'s layout (in
//! one test). Every client is a new `EtcdBackend` with a connection and
//! session of its own; a cluster's clients know every member.

use std::sync::Arc;

use dlock_core::backend::DynBackend;
use dlock_etcd::EtcdBackend;
use dlock_testkit::{
    fixture::{EtcdServer, Shared},
    Harness,
};

/// One server for every single-node check, in either layout: each check has
/// keys of its own.
static ETCD: Shared<EtcdServer> = Shared::new(EtcdServer::start);

fn harness(name: &str, servers: &[EtcdServer]) -> Harness {
    harness_with(name, servers, "")
}

fn harness_with(name: &str, servers: &[EtcdServer], query: &str) -> Harness {
    let endpoints: Vec<String> = servers.iter().map(EtcdServer::endpoint).collect();
    let url = format!("etcd://{}/dlock-test{query}", endpoints.join(","));
    Harness::new(name, move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(EtcdBackend::connect(&url).await?);
            Ok(client)
        }
    })
}

fn single_node() -> Harness {
    harness("etcd", std::slice::from_ref(ETCD.get())).lists()
}

fn cluster_of_three() -> Harness {
    let servers = EtcdServer::cluster(3).expect("start an etcd cluster");
    harness("etcd-3", &servers).lists().keep_alive(servers)
}

/// Plain locks where `etcdctl lock` puts them (see
/// `etcdctl_lock_and_dlock_exclude_each_other` in `etcd.rs`).
fn etcdctl_layout() -> Harness {
    harness_with(
        "etcd-etcdctl-layout",
        std::slice::from_ref(ETCD.get()),
        "?layout=etcdctl",
    )
}

dlock_testkit::conformance_tests!(single_node());
// The checks of plain locks, the only ones the layout changes.
dlock_testkit::conformance_tests!(plain_locks plain_locks_in_the_etcdctl_layout, etcdctl_layout());
dlock_testkit::conformance_tests!(suite whole_suite_on_a_3_member_cluster, cluster_of_three());
