//! The whole conformance suite against real ZooKeeper: a standalone server
//! (one test per check), a 3-server ensemble (the whole suite in one
//! test, on one ensemble), and the checks of plain locks in Curator's
//! layout (in one test). Every client is a new `ZkBackend` with a session
//! of its own; an ensemble's clients know every server.

use std::{sync::Arc, time::Duration};

use dlock_core::backend::Backend;
use dlock_testkit::{fixture::ZooKeeperServer, Harness};
use dlock_zk::ZkBackend;

/// `session` is short, so that crashed clients let others in quickly.
fn harness(name: &str, servers: Vec<ZooKeeperServer>, session: Duration) -> Harness {
    harness_with(name, servers, session, "")
}

fn harness_with(
    name: &str,
    servers: Vec<ZooKeeperServer>,
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
            let client: Arc<dyn Backend> = Arc::new(ZkBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
    .keep_alive(servers)
}

fn standalone() -> Harness {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    harness("zookeeper", vec![server], Duration::from_secs(2))
}

fn ensemble_of_three() -> Harness {
    let servers = ZooKeeperServer::ensemble(3).expect("start a ZooKeeper ensemble");
    // Three JVMs share the two cores with the rest of the suite.
    harness("zookeeper-3", servers, Duration::from_secs(4))
}

/// Plain locks named as Curator's `InterProcessMutex` names its nodes
/// (see `curator_mutex_and_dlock_exclude_each_other` in `zk.rs`).
fn curator_layout() -> Harness {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    harness_with(
        "zookeeper-curator-layout",
        vec![server],
        Duration::from_secs(2),
        "&layout=curator",
    )
}

dlock_testkit::conformance_tests!(standalone());
dlock_testkit::conformance_tests!(suite whole_suite_on_a_3_server_ensemble, ensemble_of_three());
// The checks of plain locks, the only ones the layout changes.
dlock_testkit::conformance_tests!(suite plain_locks_in_the_curator_layout, curator_layout(), [
    mutual_exclusion,
    try_lock_on_held_key_returns_none_at_once,
    wait_limit_gives_timeout,
    queued_waiters_get_an_expired_lock,
    dist_mutex_excludes_across_clients,
    zero_wait_makes_one_whole_attempt,
    stale_guard_cannot_release_or_renew,
    fencing_tokens_strictly_increase,
    drop_releases,
    joined_futures_in_one_task_exclude_each_other,
    cancel_safety,
    dropped_futures_cost_the_clients_other_locks_nothing,
    crashed_holder_with_watchdog,
    renewal_that_finds_another_owner_reports_lost,
    extend_moves_a_fixed_lease_and_checks_the_owner,
    awkward_keys_are_distinct_locks,
    lock_all_in_opposite_orders_neither_deadlocks_nor_overlaps,
    an_election_has_one_leader_at_a_time_and_rising_terms,
    holder_and_is_locked_read_without_locking,
    force_release_frees_the_key_and_tells_the_holder,
]);
