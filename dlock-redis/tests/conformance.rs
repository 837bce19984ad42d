//! The whole conformance suite against real `redis-server` processes: one
//! node (with fencing tokens, and without: `fence=off`), and Redlock over
//! five; and on one Sentinel deployment (a master, its replica and three
//! sentinels), in one test, every check but those of a crashed client's
//! lease, which run on one node above through the same code; and with
//! `fair=false`, the whole suite on one node, the plain locks' checks on
//! Redlock and four waiting checks on Sentinel, one test each. One test per
//! check on one node and on Redlock, each with keys of its own on servers
//! the binary's tests share. Every client is a new `RedisBackend` with
//! connections of its own, as another process would have.

use dlock_testkit::{
    fixture::{RedisSentinels, RedisServer, Shared},
    Harness,
};

/// One server for every single-node check, fenced or not, and five for
/// every Redlock check: each check has keys of its own.
static REDIS: Shared<RedisServer> = Shared::new(RedisServer::start);
static REDLOCK: Shared<Vec<RedisServer>> = Shared::new(|| RedisServer::start_many(5));

fn single_node() -> Harness {
    Harness::redis("redis", REDIS.get().url(), ()).lists()
}

/// One node with `fence=off`: the uncontended acquire is a plain `SET NX
/// PX`, and the suite checks that no fence is given.
fn single_node_unfenced() -> Harness {
    let url = format!("{}?fence=off", REDIS.get().url());
    Harness::redis("redis-unfenced", url, ())
}

/// One node with `fair=false`: every plain lock is taken unfairly (no
/// line, no turn, the holder's value marked by its waiters).
fn single_node_unfair() -> Harness {
    let url = format!("{}?fair=false", REDIS.get().url());
    Harness::redis("redis-unfair", url, ()).lists()
}

/// Redlock with `fair=false`: unfair on a majority.
fn redlock_unfair() -> Harness {
    let url = format!("{}?fair=false", RedisServer::redlock_url(REDLOCK.get()));
    Harness::redis("redlock-unfair", url, ())
}

fn redlock_of_five() -> Harness {
    Harness::redis("redlock", RedisServer::redlock_url(REDLOCK.get()), ())
}

/// The master a Sentinel deployment names, through its sentinels.
fn sentinel() -> Harness {
    let set = RedisSentinels::start().expect("start a master, a replica and 3 sentinels");
    let url = set.url();
    Harness::redis("redis-sentinel", url, set).lists()
}

/// The same deployment kind with `fair=false`: the unfair waits, which
/// follow the master as the fair ones do.
fn sentinel_unfair() -> Harness {
    let set = RedisSentinels::start().expect("start a master, a replica and 3 sentinels");
    let url = set.url();
    let join = if url.contains('?') { '&' } else { '?' };
    Harness::redis(
        "redis-sentinel-unfair",
        format!("{url}{join}fair=false"),
        set,
    )
}

dlock_testkit::conformance_tests!(suite unfair_sentinel_deployment, sentinel_unfair(), [
    mutual_exclusion,
    queued_waiters_get_an_expired_lock,
    dist_mutex_excludes_across_clients,
    cancel_safety,
]);

dlock_testkit::conformance_tests!(suite sentinel_deployment, sentinel(), [
    mutual_exclusion,
    try_lock_on_held_key_returns_none_at_once,
    wait_limit_gives_timeout,
    queued_waiters_get_an_expired_lock,
    dist_mutex_excludes_across_clients,
    zero_wait_makes_one_whole_attempt,
    stale_guard_cannot_release_or_renew,
    fencing_tokens_strictly_increase,
    drop_releases,
    reentry_inside_a_scope_asks_the_server_once,
    joined_futures_in_one_task_exclude_each_other,
    cancel_safety,
    dropped_futures_cost_the_clients_other_locks_nothing,
    watchdog_keeps_lock_past_its_lease,
    renewal_that_finds_another_owner_reports_lost,
    invalid_input_gives_typed_errors,
    awkward_keys_are_distinct_locks,
    readers_share_and_a_writer_excludes_everyone,
    a_waiting_writer_keeps_new_readers_out,
    permits_are_never_exceeded,
    cancelled_permit_waits_leave_nothing,
    cancelled_reads_never_undo_a_live_readers_hold,
    lock_all_in_opposite_orders_neither_deadlocks_nor_overlaps,
    lock_all_that_times_out_gives_back_what_it_took,
    one_lost_key_makes_the_whole_guard_lost,
    an_election_has_one_leader_at_a_time_and_rising_terms,
    followers_observe_every_change_of_leader,
    a_deposed_leader_is_told,
    holder_and_is_locked_read_without_locking,
    force_release_frees_the_key_and_tells_the_holder,
    a_note_shows_in_holder_and_list,
    list_pages_through_more_locks_than_one_page,
    a_released_lock_leaves_the_list,
    a_listing_sees_each_steady_key_once_while_others_come_and_go,
]);

// Unfair locking: the whole suite in one test on one node, and the plain
// locks' checks in one test on Redlock (its read-write locks and
// semaphores are refused either way).
dlock_testkit::conformance_tests!(suite unfair_single_node, single_node_unfair());
dlock_testkit::conformance_tests!(plain_locks unfair_redlock, redlock_unfair());

mod single {
    dlock_testkit::conformance_tests!(super::single_node());
}

mod single_unfenced {
    dlock_testkit::conformance_tests!(super::single_node_unfenced());
}

mod redlock {
    dlock_testkit::conformance_tests!(super::redlock_of_five());
}
