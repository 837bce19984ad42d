//! The whole conformance suite against real ZooKeeper: a standalone server
//! (one test per check, each with keys of its own on one server the
//! binary's tests share), a 3-server ensemble (the whole suite in one
//! test, on one ensemble), and the checks of plain locks in Curator's
//! layout (in one test). Every client is a new `ZkBackend` with a session
//! of its own; an ensemble's clients know every server.

use std::{sync::Arc, time::Duration};

use dlock_core::backend::DynBackend;
use dlock_testkit::{
    fixture::{Shared, ZooKeeperServer},
    Harness,
};
use dlock_zk::ZkBackend;

/// One standalone server for every check, in either layout: each check has
/// keys of its own.
static ZOOKEEPER: Shared<ZooKeeperServer> = Shared::new(ZooKeeperServer::start);

/// `session` is short, so that crashed clients let others in quickly.
fn harness(name: &str, servers: &[ZooKeeperServer], session: Duration) -> Harness {
    harness_with(name, servers, session, "")
}

fn harness_with(
    name: &str,
    servers: &[ZooKeeperServer],
    session: Duration,
    query: &str,
) -> Harness {
    let endpoints: Vec<String> = servers.iter().map(ZooKeeperServer::endpoint).collect();
    let url = format!(
        "zk://{}/dlock-test?session_timeout={}ms{query}",
        endpoints.join(","),
        session.as_millis()
    );
    Harness::new(name, move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(ZkBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
}

fn standalone() -> Harness {
    harness(
        "zookeeper",
        std::slice::from_ref(ZOOKEEPER.get()),
        Duration::from_secs(2),
    )
    .lists()
}

fn ensemble_of_three() -> Harness {
    let servers = ZooKeeperServer::ensemble(3).expect("start a ZooKeeper ensemble");
    // Three JVMs share the two cores with the rest of the suite.
    harness("zookeeper-3", &servers, Duration::from_secs(4))
        .lists()
        .keep_alive(servers)
}

/// Plain locks named as Curator's `InterProcessMutex` names its nodes
/// (see `curator_mutex_and_dlock_exclude_each_other` in `zk.rs`).
fn curator_layout() -> Harness {
    harness_with(
        "zookeeper-curator-layout",
        std::slice::from_ref(ZOOKEEPER.get()),
        Duration::from_secs(2),
        "&layout=curator",
    )
}

dlock_testkit::conformance_tests!(standalone());
dlock_testkit::conformance_tests!(suite whole_suite_on_a_3_server_ensemble, ensemble_of_three());
// The checks of plain locks, the only ones the layout changes.
dlock_testkit::conformance_tests!(plain_locks plain_locks_in_the_curator_layout, curator_layout());
