//! The conformance suite: one `pub async fn` per property of the design, run
//! against every backend. Each takes a [`Harness`] (a factory of independent
//! clients) and panics with a message when the backend misbehaves.
//!
//! The checks live in one file per group of properties: exclusion,
//! ownership, scope (reentrancy), cancel, leases, input, primitives,
//! undo (cleanup matches its effect) and multi (several keys at once).
//!
//! Every wait in here is bounded: checks use wait limits, and
//! [`conformance_tests!`](crate::conformance_tests) bounds each check as a
//! whole by [`CHECK_LIMIT`].

use std::{any::Any, fmt, future::Future, sync::Arc, time::Duration};

use dlock_core::{
    backend::{Backend, BoxFuture, Capabilities, DynBackend},
    LockGuard, LockOptions, Locker, LockerBuilder, Token,
};

mod cancel;
mod delay;
mod election;
mod exclusion;
mod input;
mod leases;
mod listing;
mod multi;
mod operators;
mod ownership;
mod periods;
mod primitives;
mod requests;
mod scope;
mod undo;

pub use cancel::*;
pub use delay::*;
pub use election::*;
pub use exclusion::*;
pub use input::*;
pub use leases::*;
pub use listing::*;
pub use multi::*;
pub use operators::*;
pub use ownership::*;
pub use periods::*;
pub use primitives::*;
pub use requests::*;
pub use scope::*;
pub use undo::*;

/// The longest any one check may take.
pub const CHECK_LIMIT: Duration = Duration::from_secs(120);

/// A wait limit long enough for any healthy backend on a loaded machine,
/// and a third of the default watchdog lease (30 s): a lock acquired
/// within it was released, not expired.
const PATIENCE: Duration = Duration::from_secs(dlock_core::DEFAULT_WATCHDOG_LEASE.as_secs() / 3);

/// Makes a new, independent client of the backend under test.
pub type ClientFactory =
    Arc<dyn Fn() -> BoxFuture<'static, dlock_core::Result<Arc<dyn DynBackend>>> + Send + Sync>;

/// What the suite runs against: a factory of independent clients (each as a
/// separate process would have: its own connections), and whatever must
/// live as long as the checks (a server fixture).
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::{Backend, DynBackend}, MemoryBackend};
/// use dlock_testkit::Harness;
/// use std::sync::Arc;
///
/// let server = MemoryBackend::new();
/// let harness = Harness::new("memory", move || {
///     let client: Arc<dyn DynBackend> = Arc::new(server.clone());
///     async move { Ok(client) }
/// });
/// # drop(harness);
/// ```
pub struct Harness {
    name: String,
    factory: ClientFactory,
    prefix: String,
    session: Option<Duration>,
    pub(crate) disconnect_releases: bool,
    pub(crate) lists: bool,
    keep: Vec<Box<dyn Any + Send + Sync>>,
}

impl fmt::Debug for Harness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Harness")
            .field("name", &self.name)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Harness {
    /// A harness whose clients come from `factory`.
    pub fn new<F, Fut>(name: impl Into<String>, factory: F) -> Harness
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = dlock_core::Result<Arc<dyn DynBackend>>> + Send + 'static,
    {
        Harness {
            name: name.into(),
            factory: Arc::new(move || Box::pin(factory())),
            prefix: format!("dlock-test/{}", Token::generate()),
            session: None,
            disconnect_releases: false,
            lists: false,
            keep: Vec::new(),
        }
    }

    /// A harness whose every client is a new `RedisBackend` on `url`, with
    /// connections of its own (as another process would have), keeping
    /// `servers` (the fixtures, and their certificates) alive.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use dlock_testkit::{fixture::RedisServer, Harness};
    ///
    /// let server = RedisServer::start()?;
    /// let harness = Harness::redis("redis", server.url(), server);
    /// # drop(harness);
    /// # Ok::<(), dlock_testkit::fixture::FixtureError>(())
    /// ```
    #[cfg(feature = "redis")]
    pub fn redis(name: &str, url: String, servers: impl Any + Send + Sync) -> Harness {
        Harness::new(name, move || {
            let url = url.clone();
            async move {
                let client: Arc<dyn DynBackend> =
                    Arc::new(dlock_redis::RedisBackend::connect(&url).await?);
                Ok(client)
            }
        })
        .keep_alive(servers)
    }

    /// Keeps `value` (a server fixture) alive as long as the harness.
    pub fn keep_alive(mut self, value: impl Any + Send + Sync) -> Harness {
        self.keep.push(Box::new(value));
        self
    }

    /// Says that a client's locks live on a session with this timeout,
    /// set by the client's configuration (ZooKeeper's `session_timeout`):
    /// a crashed client's locks then last that long, whatever the watchdog
    /// lease. Without it, they last the watchdog lease.
    pub fn session_timeout(mut self, timeout: Duration) -> Harness {
        self.session = Some(timeout);
        self
    }

    /// Says that the server ends a client's locks the moment its
    /// connection closes (PostgreSQL's session locks): a client whose
    /// runtime shut down lets others in at once, not after its lease. A
    /// client that stopped with its connections open still holds its locks
    /// for its lease or session timeout.
    pub fn disconnect_releases(mut self) -> Harness {
        self.disconnect_releases = true;
        self
    }

    /// Says that the backend lists held locks by key prefix, with their
    /// holders' notes ([`Locker::list`](dlock_core::Locker::list)): the
    /// listing checks then fail on a refusal, where without it they
    /// accept a typed `Unsupported`.
    pub fn lists(mut self) -> Harness {
        self.lists = true;
        self
    }

    /// The backend's name, for messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A new independent client.
    ///
    /// # Panics
    ///
    /// If the factory fails five times in a row: the check cannot run, and
    /// must not pass.
    pub async fn client(&self) -> Arc<dyn DynBackend> {
        // Connecting is not what the checks are about: servers next to a
        // busy test (a ZooKeeper ensemble under CPU load) get a few tries.
        let mut tries = 0;
        loop {
            match (self.factory)().await {
                Ok(client) => return client,
                Err(e) if tries >= 4 => panic!("[{}] could not make a client: {e}", self.name),
                Err(_) => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// The same clients and keys, without the fixtures it keeps alive: for
    /// a client on a thread of its own, while this harness (and its
    /// servers) outlive it.
    fn detached(&self) -> Harness {
        Harness {
            name: self.name.clone(),
            factory: self.factory.clone(),
            prefix: self.prefix.clone(),
            session: self.session,
            disconnect_releases: self.disconnect_releases,
            lists: self.lists,
            keep: Vec::new(),
        }
    }

    /// A locker over a new client, with default options.
    pub async fn locker(&self) -> Locker {
        Locker::from_arc(self.client().await)
    }

    /// A locker over a new client, with options set by `build`.
    pub async fn locker_with(&self, build: impl FnOnce(LockerBuilder) -> LockerBuilder) -> Locker {
        match build(LockerBuilder::from_arc(self.client().await)).build() {
            Ok(locker) => locker,
            Err(e) => panic!("[{}] invalid locker options in a check: {e}", self.name),
        }
    }

    /// A key no other check (nor another run against the same server) uses.
    pub fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    async fn capabilities(&self) -> Capabilities {
        self.client().await.capabilities()
    }
}

/// One check of a suite, as [`run_suite`] takes it (some checks' futures
/// are not `Send`; a suite runs them all in its test's own task).
#[doc(hidden)]
pub type Check<'a> = futures_util::future::LocalBoxFuture<'a, ()>;

/// How many checks of one suite run at once, in the suite's own task: a
/// suite of servers too costly to start per check then takes about a third
/// as long, with the load of three one-check tests side by side (most
/// checks wait on leases and timers, not on the CPU). Each check
/// has keys of its own, so checks of one harness never see each other's
/// locks, and no check blocks its task (a client that must stop runs on a
/// thread of its own, awaited), so none stops another's clock.
pub const SUITE_CONCURRENCY: usize = 3;

/// Runs the checks `checks`, named, against `harness`,
/// [`SUITE_CONCURRENCY`] at a time, each bounded by [`CHECK_LIMIT`]; panics
/// with the first check that fails or overruns. What
/// `conformance_tests!(suite …)` expands to.
#[doc(hidden)]
pub async fn run_suite(harness: &Harness, checks: Vec<(&'static str, Check<'_>)>) {
    use futures_util::StreamExt;
    futures_util::stream::iter(checks.into_iter().map(|(name, check)| async move {
        let started = tokio::time::Instant::now();
        if tokio::time::timeout(CHECK_LIMIT, check).await.is_err() {
            panic!(
                "[{}] check {name} did not finish within {CHECK_LIMIT:?}",
                harness.name()
            );
        }
        println!(
            "[{}] {name} passed in {:?}",
            harness.name(),
            started.elapsed()
        );
    }))
    .buffer_unordered(SUITE_CONCURRENCY)
    .collect::<()>()
    .await;
}

/// Generates the conformance tests for a harness made by `$harness` (an
/// expression).
///
/// - `conformance_tests!(harness)`: one `#[tokio::test]` per check, each
///   with a harness of its own (evaluated per test).
/// - `conformance_tests!(suite test_name, harness)`: one test that runs
///   every check against one harness, [`SUITE_CONCURRENCY`] at a time,
///   for servers too costly to start once per check (a cluster).
/// - `conformance_tests!(suite test_name, harness, [check, check, …])`:
///   the same for the checks named, for a variant of a backend whose
///   other checks run elsewhere.
///
/// Each check is bounded by [`CHECK_LIMIT`].
///
/// # Examples
///
/// ```text
/// dlock_testkit::conformance_tests!(my_backend_harness());
/// dlock_testkit::conformance_tests!(suite whole_suite_on_a_cluster, my_cluster_harness());
/// // The checks of plain locks only, in one test: for a layout that
/// // changes nothing else (another tool's key layout, say).
/// dlock_testkit::conformance_tests!(plain_locks in_the_other_layout, my_layout_harness());
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (suite $name:ident, $harness:expr, [$($check:ident),* $(,)?]) => {
        $crate::conformance_tests!(@run [suite $name $harness] $($check),*);
    };
    (plain_locks $name:ident, $harness:expr) => {
        $crate::conformance_tests!(@run [suite $name $harness]
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
            a_renewal_of_many_locks_answers_each_in_its_place,
            extend_moves_a_fixed_lease_and_checks_the_owner,
            awkward_keys_are_distinct_locks,
            lock_all_in_opposite_orders_neither_deadlocks_nor_overlaps,
            an_election_has_one_leader_at_a_time_and_rising_terms,
            holder_and_is_locked_read_without_locking,
            force_release_frees_the_key_and_tells_the_holder,
        );
    };
    (suite $name:ident, $harness:expr) => {
        $crate::conformance_tests!(@list [suite $name $harness]);
    };
    ($harness:expr) => {
        $crate::conformance_tests!(@list [each $harness]);
    };
    (@list $how:tt) => {
        $crate::conformance_tests!(@run $how
            // exclusion.rs
            mutual_exclusion,
            try_lock_on_held_key_returns_none_at_once,
            wait_limit_gives_timeout,
            queued_waiters_get_an_expired_lock,
            dist_mutex_excludes_across_clients,
            zero_wait_makes_one_whole_attempt,
            // ownership.rs
            stale_guard_cannot_release_or_renew,
            fencing_tokens_strictly_increase,
            drop_releases,
            // scope.rs
            reentry_inside_a_scope_asks_the_server_once,
            reentry_at_depth_through_the_attribute_and_with_lock,
            lock_outside_a_scope_is_not_reentrant,
            joined_futures_in_one_task_exclude_each_other,
            work_outside_the_scope_contends,
            dist_mutex_in_its_own_scope_would_deadlock,
            // cancel.rs
            cancel_safety,
            dropped_futures_cost_the_clients_other_locks_nothing,
            // leases.rs
            crashed_holder_with_fixed_lease,
            crashed_holder_with_watchdog,
            crashed_client_lets_others_in_after_its_lease,
            stopped_client_lets_others_in_after_its_lease,
            watchdog_keeps_lock_past_its_lease,
            fixed_lease_reports_lost_before_others_acquire,
            a_fixed_lease_counts_from_the_grant,
            renewal_that_finds_another_owner_reports_lost,
            a_renewal_of_many_locks_answers_each_in_its_place,
            extend_moves_a_fixed_lease_and_checks_the_owner,
            abort_on_lost_drops_the_body_the_server_took_the_lock_from,
            // periods.rs
            hold_at_least_keeps_a_released_lock_until_its_time,
            hold_at_least_runs_each_tick_once,
            hold_at_least_never_keeps_a_key_given_back_unused,
            // delay.rs
            lock_delay_keeps_a_lost_key_and_not_a_released_one,
            // input.rs
            invalid_input_gives_typed_errors,
            awkward_keys_are_distinct_locks,
            // primitives.rs
            readers_share_and_a_writer_excludes_everyone,
            a_waiting_writer_keeps_new_readers_out,
            a_waiting_writer_keeps_out_the_readers_own_client,
            permits_are_never_exceeded,
            available_counts_the_permits_held,
            a_crashed_permit_holder_gives_them_back_after_its_lease,
            cancelled_permit_waits_leave_nothing,
            stale_permits_cannot_release_or_renew,
            bad_permit_counts_are_typed_errors,
            // undo.rs
            cancelled_reads_never_undo_a_live_readers_hold,
            a_release_cut_off_mid_statement_is_not_sent_twice,
            // multi.rs
            lock_all_in_opposite_orders_neither_deadlocks_nor_overlaps,
            lock_all_that_times_out_gives_back_what_it_took,
            lock_all_cancel_storm_leaves_nothing,
            one_lost_key_makes_the_whole_guard_lost,
            lock_all_never_returns_a_lost_part,
            lock_all_rejects_empty_and_repeated_lists,
            // election.rs
            an_election_has_one_leader_at_a_time_and_rising_terms,
            a_proclaimed_value_lives_exactly_as_long_as_its_hold,
            followers_read_the_leader_and_its_value,
            a_proclaimed_value_lasts_while_the_lock_is_renewed,
            followers_observe_every_change_of_leader,
            dropping_an_election_says_resigned,
            an_election_renews_whatever_the_default_lease,
            a_deposed_leader_is_told,
            holder_and_is_locked_read_without_locking,
            force_release_frees_the_key_and_tells_the_holder,
            // requests.rs
            a_release_request_reaches_its_holder_who_decides,
            a_leader_asked_to_step_down_hands_over,
            // listing.rs
            a_note_shows_in_holder_and_list,
            list_pages_through_more_locks_than_one_page,
            a_released_lock_leaves_the_list,
            a_listing_sees_each_steady_key_once_while_others_come_and_go,
        );
    };
    (@run [each $harness:expr] $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let harness = $harness;
                $crate::conformance_tests!(@one harness $check);
            }
        )*
    };
    (@run [suite $name:ident $harness:expr] $($check:ident),* $(,)?) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let harness = $harness;
            $crate::conformance::run_suite(&harness, ::std::vec![
                $((
                    stringify!($check),
                    ::std::boxed::Box::pin($crate::conformance::$check(&harness))
                        as $crate::conformance::Check<'_>,
                )),*
            ])
            .await;
        }
    };
    (@one $harness:ident $check:ident) => {
        let check = $crate::conformance::$check(&$harness);
        if ::tokio::time::timeout($crate::conformance::CHECK_LIMIT, check).await.is_err() {
            panic!("[{}] check {} did not finish within {:?}",
                $harness.name(), stringify!($check), $crate::conformance::CHECK_LIMIT);
        }
    };
}

fn must<T>(h: &Harness, what: &str, result: dlock_core::Result<T>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => panic!("[{}] {what}: unexpected error: {e}", h.name),
    }
}

/// `try_lock` through `locker` finds `key` held elsewhere; panics with
/// `why` if it gets it (or with `what` on an error).
async fn taken(h: &Harness, what: &str, locker: &Locker, key: &str, why: &str) {
    let got = must(h, what, locker.try_lock(key).await);
    assert!(got.is_none(), "[{}] {why}", h.name);
}

/// `try_lock` through `locker` gets `key`, and returns its guard; panics
/// with `why` if the key is held (or with `what` on an error).
async fn free(h: &Harness, what: &str, locker: &Locker, key: &str, why: &str) -> LockGuard {
    let got = must(h, what, locker.try_lock(key).await);
    got.unwrap_or_else(|| panic!("[{}] {why}", h.name))
}

/// Releases `guard`'s lock through the backend, behind the guard's back
/// (someone with the token: a confused operator, a stale script), and
/// checks the server released it.
async fn release_behind_its_back(h: &Harness, locker: &Locker, guard: &LockGuard) {
    let key = dlock_core::LockKey::new(guard.key()).expect("valid key");
    let released = must(
        h,
        "release behind the guard's back",
        locker
            .backend()
            .release(&key, guard.mode(), guard.token())
            .await,
    );
    assert_eq!(
        released,
        dlock_core::backend::ReleaseOutcome::Released,
        "[{}] the release behind the guard's back found nothing",
        h.name
    );
}

fn patient() -> LockOptions {
    LockOptions::new().wait(PATIENCE)
}

#[cfg(test)]
mod tests {
    use std::{
        panic::AssertUnwindSafe,
        sync::atomic::{AtomicUsize, Ordering},
    };

    use dlock_core::MemoryBackend;
    use futures_util::FutureExt;

    use super::*;

    fn harness() -> Harness {
        let server = MemoryBackend::new();
        Harness::new("memory", move || {
            let client: Arc<dyn DynBackend> = Arc::new(server.clone());
            async move { Ok(client) }
        })
    }

    /// A suite runs every check it is given, `SUITE_CONCURRENCY` of them
    /// at once (each stays running a while, so that every one the suite
    /// started overlaps), and not more.
    #[tokio::test]
    async fn a_suite_runs_its_checks_suite_concurrency_at_a_time() {
        let h = harness();
        let (ran, running, most) = (
            AtomicUsize::new(0),
            AtomicUsize::new(0),
            AtomicUsize::new(0),
        );
        let check = || -> Check<'_> {
            Box::pin(async {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                ran.fetch_add(1, Ordering::SeqCst);
            })
        };
        run_suite(&h, (0..6).map(|_| ("check", check())).collect()).await;
        assert_eq!(
            ran.load(Ordering::SeqCst),
            6,
            "a check of the suite never ran"
        );
        assert_eq!(
            most.load(Ordering::SeqCst),
            SUITE_CONCURRENCY,
            "not SUITE_CONCURRENCY checks at a time"
        );
    }

    /// A check that fails fails its suite, even beside checks that pass.
    #[tokio::test]
    async fn a_failing_check_fails_its_suite() {
        let h = harness();
        let checks: Vec<(&'static str, Check<'_>)> = vec![
            ("passes", Box::pin(async {})),
            ("fails", Box::pin(async { panic!("the check failed") })),
            ("passes too", Box::pin(async {})),
        ];
        let outcome = AssertUnwindSafe(run_suite(&h, checks)).catch_unwind().await;
        assert!(outcome.is_err(), "a suite with a failing check passed");
    }
}
