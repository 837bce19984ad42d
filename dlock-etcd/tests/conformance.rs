//! The whole conformance suite against real etcd: a single node (one test
//! per check), a 3-member cluster (the whole suite in one test), and the
//! checks of plain locks on a single node in `etcdctl lock`'s layout (in
//! one test). Every client is a new `EtcdBackend` with a connection and
//! session of its own; a cluster's clients know every member.

use std::sync::Arc;

use dlock_core::backend::Backend;
use dlock_etcd::EtcdBackend;
use dlock_testkit::{fixture::EtcdServer, Harness};

fn harness(name: &str, servers: Vec<EtcdServer>) -> Harness {
    harness_with(name, servers, "")
}

fn harness_with(name: &str, servers: Vec<EtcdServer>, query: &str) -> Harness {
    let endpoints: Vec<String> = servers.iter().map(EtcdServer::endpoint).collect();
    let url = format!("etcd://{}/dlock-test{query}", endpoints.join(","));
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

/// Plain locks where `etcdctl lock` puts them (see
/// `etcdctl_lock_and_dlock_exclude_each_other` in `etcd.rs`).
fn etcdctl_layout() -> Harness {
    harness_with(
        "etcd-etcdctl-layout",
        vec![EtcdServer::start().expect("start etcd")],
        "?layout=etcdctl",
    )
}

dlock_testkit::conformance_tests!(single_node());
// The checks of plain locks, the only ones the layout changes.
dlock_testkit::conformance_tests!(suite plain_locks_in_the_etcdctl_layout, etcdctl_layout(), [
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
    awkward_keys_are_distinct_locks,
    lock_all_in_opposite_orders_neither_deadlocks_nor_overlaps,
    an_election_has_one_leader_at_a_time_and_rising_terms,
    holder_and_is_locked_read_without_locking,
    force_release_frees_the_key_and_tells_the_holder,
]);
dlock_testkit::conformance_tests!(suite whole_suite_on_a_3_member_cluster, cluster_of_three());
