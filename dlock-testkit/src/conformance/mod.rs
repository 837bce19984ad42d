//! The conformance suite: one `pub async fn` per property of the design, run
//! against every backend. Each takes a [`Harness`] (a factory of independent
//! clients) and panics with a message when the backend misbehaves.
//!
//! Every wait in here is bounded: checks use wait limits, and
//! [`conformance_tests!`](crate::conformance_tests) bounds each check as a
//! whole by [`CHECK_LIMIT`].

use std::{
    any::Any,
    fmt,
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{
    backend::{Backend, BoxFuture, Capabilities, ReleaseOutcome, RenewOutcome, RenewRequest},
    DistMutex, LockError, LockKey, LockOptions, Locker, LockerBuilder, LostReason, Token,
};
use tokio::time::Instant;

use crate::{OverlapDetector, Rng};

mod scope;
pub use scope::*;

/// The longest any one check may take.
pub const CHECK_LIMIT: Duration = Duration::from_secs(120);

/// A wait limit long enough for any healthy backend on a loaded machine,
/// and far shorter than the default watchdog lease (30 s): a lock acquired
/// within it was released, not expired.
const PATIENCE: Duration = Duration::from_secs(10);

/// Makes a new, independent client of the backend under test.
pub type ClientFactory =
    Arc<dyn Fn() -> BoxFuture<'static, dlock_core::Result<Arc<dyn Backend>>> + Send + Sync>;

/// What the suite runs against: a factory of independent clients (each as a
/// separate process would have: its own connections), and whatever must
/// live as long as the checks (a server fixture).
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::Backend, MemoryBackend};
/// use dlock_testkit::Harness;
/// use std::sync::Arc;
///
/// let server = MemoryBackend::new();
/// let harness = Harness::new("memory", move || {
///     let client: Arc<dyn Backend> = Arc::new(server.clone());
///     async move { Ok(client) }
/// });
/// # drop(harness);
/// ```
pub struct Harness {
    name: String,
    factory: ClientFactory,
    prefix: String,
    session: Option<Duration>,
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
        Fut: Future<Output = dlock_core::Result<Arc<dyn Backend>>> + Send + 'static,
    {
        Harness {
            name: name.into(),
            factory: Arc::new(move || Box::pin(factory())),
            prefix: format!("dlock-test/{}", Token::generate()),
            session: None,
            keep: Vec::new(),
        }
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
    pub async fn client(&self) -> Arc<dyn Backend> {
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

/// Generates the conformance tests for a harness made by `$harness` (an
/// expression).
///
/// - `conformance_tests!(harness)`: one `#[tokio::test]` per check, each
///   with a harness of its own (evaluated per test).
/// - `conformance_tests!(suite test_name, harness)`: one test that runs
///   every check in turn against one harness, for servers too costly to
///   start once per check (a cluster).
///
/// Each check is bounded by [`CHECK_LIMIT`].
///
/// # Examples
///
/// ```text
/// dlock_testkit::conformance_tests!(my_backend_harness());
/// dlock_testkit::conformance_tests!(suite whole_suite_on_a_cluster, my_cluster_harness());
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (suite $name:ident, $harness:expr) => {
        $crate::conformance_tests!(@list [suite $name $harness]);
    };
    ($harness:expr) => {
        $crate::conformance_tests!(@list [each $harness]);
    };
    (@list $how:tt) => {
        $crate::conformance_tests!(@run $how
            mutual_exclusion,
            try_lock_on_held_key_returns_none_at_once,
            wait_limit_gives_timeout,
            stale_guard_cannot_release_or_renew,
            fencing_tokens_strictly_increase,
            reentry_inside_a_scope_asks_the_server_once,
            reentry_at_depth_through_the_attribute_and_with_lock,
            lock_outside_a_scope_is_not_reentrant,
            joined_futures_in_one_task_exclude_each_other,
            work_outside_the_scope_contends,
            dist_mutex_in_its_own_scope_would_deadlock,
            drop_releases,
            queued_waiters_get_an_expired_lock,
            cancel_safety,
            crashed_holder_with_fixed_lease,
            crashed_holder_with_watchdog,
            crashed_client_lets_others_in_after_its_lease,
            watchdog_keeps_lock_past_its_lease,
            fixed_lease_reports_lost_before_others_acquire,
            renewal_that_finds_another_owner_reports_lost,
            dist_mutex_excludes_across_clients,
            zero_wait_makes_one_whole_attempt,
            invalid_input_gives_typed_errors,
            awkward_keys_are_distinct_locks,
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
            $(
                let started = ::tokio::time::Instant::now();
                $crate::conformance_tests!(@one harness $check);
                println!("[{}] {} passed in {:?}", harness.name(), stringify!($check), started.elapsed());
            )*
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

fn patient() -> LockOptions {
    LockOptions::new().wait(PATIENCE)
}

/// At most one holder at a time among 32 contenders: 8 clients with 4 tasks
/// each, 8 rounds apiece, half released explicitly and half by drop.
pub async fn mutual_exclusion(h: &Harness) {
    const CLIENTS: usize = 8;
    const TASKS: usize = 4;
    const ROUNDS: usize = 8;
    let key = h.key("exclusion");
    let detector = Arc::new(OverlapDetector::default());
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let locker = h.locker().await;
        for t in 0..TASKS {
            let (locker, key, detector) = (locker.clone(), key.clone(), detector.clone());
            let name = h.name.clone();
            tasks.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let guard = match locker
                        .lock_with(&key, LockOptions::new().wait(4 * PATIENCE))
                        .await
                    {
                        Ok(g) => g,
                        Err(e) => panic!("[{name}] contender could not lock: {e}"),
                    };
                    {
                        let _section = detector.enter();
                        tokio::time::sleep(Duration::from_micros(200)).await;
                        assert!(
                            !guard.is_lost(),
                            "[{name}] guard lost during a short section"
                        );
                    }
                    if (t + round) % 2 == 0 {
                        if let Err(e) = guard.release().await {
                            panic!("[{name}] release failed: {e}");
                        }
                    } else {
                        drop(guard);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("contender task panicked");
    }
    assert_eq!(
        detector.entries(),
        CLIENTS * TASKS * ROUNDS,
        "[{}] every round ran",
        h.name
    );
    assert_eq!(
        detector.overlaps(),
        0,
        "[{}] two holders overlapped",
        h.name
    );
}

/// `try_lock` on a key another client holds answers `None` without waiting.
pub async fn try_lock_on_held_key_returns_none_at_once(h: &Harness) {
    let key = h.key("try");
    let (a, b) = (h.locker().await, h.locker().await);
    let held = must(h, "lock a free key", a.lock_with(&key, patient()).await);
    let start = Instant::now();
    let other = must(h, "try_lock a held key", b.try_lock(&key).await);
    assert!(other.is_none(), "[{}] try_lock got a held key", h.name);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "[{}] try_lock waited {:?} instead of answering at once",
        h.name,
        start.elapsed()
    );
    must(h, "release", held.release().await);
    let after = must(h, "try_lock after release", b.try_lock(&key).await);
    assert!(
        after.is_some(),
        "[{}] try_lock failed on a released key",
        h.name
    );
}

/// A wait limit ends in `Timeout`, neither early nor much late, and the
/// timed-out waiter leaves nothing behind.
pub async fn wait_limit_gives_timeout(h: &Harness) {
    let key = h.key("timeout");
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    let held = must(h, "lock a free key", a.lock_with(&key, patient()).await);
    let limit = Duration::from_millis(300);
    let start = Instant::now();
    let result = b.lock_with(&key, LockOptions::new().wait(limit)).await;
    let elapsed = start.elapsed();
    match result {
        Err(LockError::Timeout { waited, .. }) => {
            assert!(
                waited >= limit,
                "[{}] reported waiting {waited:?} < {limit:?}",
                h.name
            )
        }
        other => panic!("[{}] expected Timeout, got {other:?}", h.name),
    }
    assert!(
        elapsed >= limit,
        "[{}] gave up after {elapsed:?}, before {limit:?}",
        h.name
    );
    assert!(
        elapsed < limit + Duration::from_secs(2),
        "[{}] gave up only after {elapsed:?}",
        h.name
    );
    must(h, "release", held.release().await);
    let next = must(h, "try_lock after the timeout", c.try_lock(&key).await);
    assert!(
        next.is_some(),
        "[{}] a timed-out waiter blocked the next owner",
        h.name
    );
}

/// A guard whose lease ran out, with another owner holding the key now, can
/// neither release nor renew the new owner's lock.
pub async fn stale_guard_cannot_release_or_renew(h: &Harness) {
    let key = h.key("stale");
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    let lease = Duration::from_millis(300);
    let stale = must(
        h,
        "lock with a fixed lease",
        a.lock_with(&key, patient().lease(lease)).await,
    );
    let reason = tokio::time::timeout(PATIENCE, stale.lost()).await;
    assert_eq!(
        reason,
        Ok(LostReason::LeaseExpired),
        "[{}] fixed lease not reported lost",
        h.name
    );
    let fresh = must(
        h,
        "lock after the lease ran out",
        b.lock_with(&key, patient()).await,
    );

    let lock_key = LockKey::new(&key).expect("valid key");
    let renew = RenewRequest {
        key: lock_key.clone(),
        token: *stale.token(),
        lease: Duration::from_secs(60),
    };
    let renewed = must(
        h,
        "renew with a stale token",
        a.backend().renew(std::slice::from_ref(&renew)).await,
    );
    assert_eq!(
        renewed,
        vec![RenewOutcome::NotHeld],
        "[{}] a stale token renewed",
        h.name
    );
    let released = must(
        h,
        "release with a stale token",
        a.backend().release(&lock_key, stale.token()).await,
    );
    assert_eq!(
        released,
        ReleaseOutcome::NotHeld,
        "[{}] a stale token released",
        h.name
    );
    match stale.release().await {
        Err(LockError::Lost { .. }) => {}
        other => panic!(
            "[{}] releasing a stale guard must say Lost, got {other:?}",
            h.name
        ),
    }

    assert!(
        !fresh.is_lost(),
        "[{}] the new holder was told it lost the lock",
        h.name
    );
    let third = must(h, "try_lock the new holder's key", c.try_lock(&key).await);
    assert!(
        third.is_none(),
        "[{}] the stale guard released the new holder's lock",
        h.name
    );
    must(h, "release the new holder", fresh.release().await);
}

/// Fencing tokens grow strictly from holder to holder, across clients; or,
/// for a backend without them, are never given.
pub async fn fencing_tokens_strictly_increase(h: &Harness) {
    let key = h.key("fencing");
    let has_fencing = h.capabilities().await.has_fencing();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let locker = h.locker().await;
        for _ in 0..3 {
            let (locker, key, seen) = (locker.clone(), key.clone(), seen.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..5 {
                    let guard = locker
                        .lock_with(&key, LockOptions::new().wait(4 * PATIENCE))
                        .await
                        .expect("lock");
                    // Recorded while held: the order of the list is the order of the holds.
                    seen.lock().unwrap().push(guard.fencing_token());
                    let inner = guard.scope(locker.lock(&key)).await.expect("re-enter");
                    assert_eq!(
                        inner.fencing_token(),
                        guard.fencing_token(),
                        "a re-entered guard has its own fence"
                    );
                    drop(inner);
                    guard.release().await.expect("release");
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("fencing task panicked");
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 60);
    if has_fencing {
        let fences: Vec<u64> = seen
            .iter()
            .map(|f| f.unwrap_or_else(|| panic!("[{}] claims fencing but gave none", h.name)))
            .collect();
        for pair in fences.windows(2) {
            assert!(
                pair[0] < pair[1],
                "[{}] fence went from {} to {}",
                h.name,
                pair[0],
                pair[1]
            );
        }
    } else {
        assert!(
            seen.iter().all(Option::is_none),
            "[{}] gives fencing tokens it does not claim to guarantee",
            h.name
        );
    }
}

/// Dropping a guard releases the lock: another client gets it long before
/// the lease (30 s) could have expired.
pub async fn drop_releases(h: &Harness) {
    let key = h.key("drop");
    let (a, b) = (h.locker().await, h.locker().await);
    for _ in 0..3 {
        // Each lock is asked to come within PATIENCE, a third of the lease:
        // only a release can have freed the key.
        let guard = must(h, "lock", a.lock_with(&key, patient()).await);
        drop(guard);
        let next = must(h, "lock after drop", b.lock_with(&key, patient()).await);
        drop(next);
        let back = must(
            h,
            "lock back after drop",
            a.lock_with(&key, patient()).await,
        );
        drop(back);
    }
}

/// Waiters queued behind a holder that crashed get the lock when its lease
/// ends, even after the waiter ahead of them gave up.
pub async fn queued_waiters_get_an_expired_lock(h: &Harness) {
    let key = h.key("expired-queue");
    let lease = Duration::from_millis(400);
    let holder = h.locker().await;
    let guard = must(
        h,
        "lock with a fixed lease",
        holder.lock_with(&key, patient().lease(lease)).await,
    );
    let sent = Instant::now();
    guard.leak();
    let impatient = tokio::spawn({
        let (locker, key) = (h.locker().await, key.clone());
        async move {
            locker
                .lock_with(&key, LockOptions::new().wait(Duration::from_millis(100)))
                .await
                .map(drop)
        }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut patient_waiters = Vec::new();
    for _ in 0..3 {
        let (locker, key) = (h.locker().await, key.clone());
        patient_waiters.push(tokio::spawn(async move {
            let guard = locker.lock_with(&key, patient()).await?;
            let at = Instant::now();
            guard.release().await?;
            Ok::<_, LockError>(at)
        }));
    }
    let gave_up = impatient.await.expect("waiter panicked");
    assert!(
        matches!(gave_up, Err(LockError::Timeout { .. })),
        "[{}] {gave_up:?}",
        h.name
    );
    for w in patient_waiters {
        let at = w.await.expect("waiter panicked");
        let at = at
            .unwrap_or_else(|e| panic!("[{}] a waiter behind an expired lock failed: {e}", h.name));
        let after = at - sent;
        assert!(
            after < lease + PATIENCE / 2,
            "[{}] waited {after:?} for a {lease:?} lease",
            h.name
        );
    }
}

/// 240 `lock()` futures dropped at random points (timeouts of 0–25 ms) while
/// the key is contended leave no orphan: the key is free again at once.
pub async fn cancel_safety(h: &Harness) {
    cancel_storm(h, 240).await;
}

/// `attempts` `lock()` futures from 4 clients, dropped at random points
/// (timeouts of 0–25 ms) while another client keeps taking the key, leave
/// no orphan: afterwards the key is free at once, for `lock` and `try_lock`.
pub async fn cancel_storm(h: &Harness, attempts: usize) {
    let key = h.key("cancel");
    let mut rng = Rng::from_env();
    let seed = rng.seed();
    let holder = h.locker().await;
    let stop = Arc::new(tokio::sync::Notify::new());
    let cycling = tokio::spawn({
        let (holder, key, stop) = (holder.clone(), key.clone(), stop.clone());
        async move {
            let mut cycles = 0u32;
            loop {
                let guard = tokio::select! {
                    g = holder.lock_with(&key, LockOptions::new().wait(Duration::from_secs(5))) => g,
                    _ = stop.notified() => return cycles,
                };
                if let Ok(g) = guard {
                    cycles += 1;
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    drop(g);
                }
                if cycles > 10_000 {
                    return cycles;
                }
            }
        }
    });
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(h.locker().await);
    }
    let mut tasks = Vec::new();
    for i in 0..attempts {
        let locker = clients[i % clients.len()].clone();
        let key = key.clone();
        let after = Duration::from_millis(rng.below(26));
        let hold = Duration::from_millis(rng.below(3));
        tasks.push(tokio::spawn(async move {
            match tokio::time::timeout(after, locker.lock(&key)).await {
                Ok(Ok(guard)) => {
                    tokio::time::sleep(hold).await;
                    drop(guard);
                    true
                }
                Ok(Err(e)) => panic!("lock failed instead of being cancelled: {e}"),
                Err(_) => false,
            }
        }));
        if i % 8 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let mut acquired = 0;
    for a in tasks {
        acquired += usize::from(a.await.expect("attempt task panicked"));
    }
    stop.notify_one();
    let cycles = cycling.await.expect("holder task panicked");
    assert!(
        cycles > 0,
        "[{}] the holder never got the lock (seed {seed})",
        h.name
    );

    // Drop-releases are scheduled, so allow them a moment; an orphan would
    // hold the key for the whole lease (30 s) or forever.
    let probe = h.locker().await;
    let start = Instant::now();
    let free = probe.lock_with(&key, patient()).await;
    assert!(
        free.is_ok(),
        "[{}] key still blocked after the cancel storm ({acquired} acquired, seed {seed}): {free:?}",
        h.name
    );
    assert!(start.elapsed() < PATIENCE);
    drop(free);
    let start = Instant::now();
    let mut again = None;
    while again.is_none() && start.elapsed() < PATIENCE {
        again = must(
            h,
            "try_lock after the storm",
            h.locker().await.try_lock(&key).await,
        );
        if again.is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(
        again.is_some(),
        "[{}] an orphan queue entry blocks try_lock (seed {seed})",
        h.name
    );
}

/// Checks that after a holder of `key` crashed, `other` cannot take the key
/// at once, and gets it no sooner than `at_least` after `since` and not
/// much later than the lease.
async fn take_over_from_crashed(
    h: &Harness,
    key: &str,
    other: &Locker,
    since: Instant,
    at_least: Duration,
    lease: Duration,
) {
    let early = must(
        h,
        "try_lock the crashed holder's key",
        other.try_lock(key).await,
    );
    assert!(
        early.is_none(),
        "[{}] a crashed holder's lock was free at once",
        h.name
    );
    let next = must(
        h,
        "lock after the lease",
        other.lock_with(key, patient()).await,
    );
    let after = since.elapsed();
    assert!(
        after >= at_least,
        "[{}] acquired {after:?} after the crash, sooner than {at_least:?}",
        h.name
    );
    assert!(
        after < lease + PATIENCE / 2,
        "[{}] the lease ran out but the lock took {after:?}",
        h.name
    );
    drop(next);
}

/// A holder that vanishes with a fixed lease blocks others for the lease,
/// not less, and not much more.
pub async fn crashed_holder_with_fixed_lease(h: &Harness) {
    let key = h.key("crash-fixed");
    let (a, b) = (h.locker().await, h.locker().await);
    let lease = Duration::from_millis(500);
    let sent = Instant::now();
    let guard = must(
        h,
        "lock with a fixed lease",
        a.lock_with(&key, patient().lease(lease)).await,
    );
    guard.leak();
    // The server's lease started no earlier than the request was sent.
    take_over_from_crashed(h, &key, &b, sent, lease, lease).await;
}

/// A holder that vanishes under the watchdog blocks others until its last
/// renewal's lease has run out, then lets them in.
pub async fn crashed_holder_with_watchdog(h: &Harness) {
    let key = h.key("crash-watchdog");
    let lease = Duration::from_millis(900);
    let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let b = h.locker().await;
    let guard = must(h, "lock", a.lock_with(&key, patient()).await);
    tokio::time::sleep(lease).await;
    if h.capabilities().await.has_session_leases() {
        // The lock lives on the client's session, which lives on: a leaked
        // guard keeps it (the client dying is `crashed_client_...`).
        guard.leak();
        tokio::time::sleep(lease * 2).await;
        let probe = must(h, "try_lock a leaked session lock", b.try_lock(&key).await);
        assert!(
            probe.is_none(),
            "[{}] a leaked lock ended while its session lived",
            h.name
        );
        return;
    }
    // The last renewal was sent at most a third of the lease before the
    // crash, so at least two thirds of it remain; ask for one third, leaving
    // slack for a late tick on a loaded machine.
    let crashed = Instant::now();
    guard.leak();
    take_over_from_crashed(h, &key, &b, crashed, lease / 3, lease).await;
}

/// A holder whose whole client dies (its runtime shuts down, taking its
/// connections, its watchdog and its pending release along) lets others in
/// after its lease (or session timeout), not before: its last renewal or
/// ping came at most a third of it before the crash, so the lock must stay
/// held for at least half of it. Needs the multi-thread runtime.
pub async fn crashed_client_lets_others_in_after_its_lease(h: &Harness) {
    let key = h.key("crash-client");
    let lease = Duration::from_millis(900);
    let b = h.locker().await;
    let crashed = tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            let holder = scope.spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the holder");
                let guard = runtime.block_on(async {
                    let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
                    let guard = must(h, "lock", a.lock_with(&key, patient()).await);
                    // Let the watchdog renew once.
                    tokio::time::sleep(lease / 2).await;
                    guard
                });
                drop(runtime);
                let crashed = Instant::now();
                // Its release has no runtime left to run on.
                drop(guard);
                crashed
            });
            holder.join().expect("the holder thread panicked")
        })
    });
    let outlives = h.session.unwrap_or(lease);
    take_over_from_crashed(h, &key, &b, crashed, outlives / 2, outlives).await;
}

/// The watchdog keeps a lock well past its lease while the guard lives.
pub async fn watchdog_keeps_lock_past_its_lease(h: &Harness) {
    let key = h.key("watchdog");
    let lease = Duration::from_millis(600);
    let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let b = h.locker().await;
    let guard = must(h, "lock", a.lock_with(&key, patient()).await);
    let start = Instant::now();
    let mut probes = 0;
    while start.elapsed() < lease * 3 {
        let probe = must(h, "probe", b.try_lock(&key).await);
        assert!(
            probe.is_none(),
            "[{}] lock expired after {:?} despite the watchdog",
            h.name,
            start.elapsed()
        );
        assert!(
            !guard.is_lost(),
            "[{}] guard lost despite the watchdog",
            h.name
        );
        probes += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(probes >= 5);
    must(h, "release", guard.release().await);
    let next = must(h, "lock after release", b.try_lock(&key).await);
    assert!(next.is_some(), "[{}] lock still held after release", h.name);
}

/// A fixed lease's guard reports lost no later than another client acquires,
/// and its `lost()` future completes.
pub async fn fixed_lease_reports_lost_before_others_acquire(h: &Harness) {
    let key = h.key("lost-first");
    let (a, b) = (h.locker().await, h.locker().await);
    let lease = Duration::from_millis(400);
    let guard = must(
        h,
        "lock with a fixed lease",
        a.lock_with(&key, patient().lease(lease)).await,
    );
    assert!(!guard.is_lost());
    let next = must(
        h,
        "lock after the lease",
        b.lock_with(&key, patient()).await,
    );
    // The moment another owner has the lock, the old guard must say so.
    assert!(
        guard.is_lost(),
        "[{}] another client acquired while the guard said it held",
        h.name
    );
    let reason = tokio::time::timeout(PATIENCE, guard.lost()).await;
    assert_eq!(reason, Ok(LostReason::LeaseExpired), "[{}]", h.name);
    drop(next);
}

/// A guard whose key was taken over by another owner (its own entry
/// removed behind its back, then the key acquired by another client) is
/// told by its next renewal, and nothing it does afterwards touches the
/// new owner's lock.
pub async fn renewal_that_finds_another_owner_reports_lost(h: &Harness) {
    let key = h.key("renew-lost");
    let lease = Duration::from_millis(600);
    let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let b = h.locker().await;
    let third = h.locker().await;
    let guard = must(h, "lock", a.lock_with(&key, patient()).await);
    // Someone with the token (a confused operator, a stale script) deletes
    // it, and another owner takes the key before the next renewal.
    let lock_key = LockKey::new(&key).expect("valid key");
    let released = must(
        h,
        "release behind the guard's back",
        a.backend().release(&lock_key, guard.token()).await,
    );
    assert_eq!(released, ReleaseOutcome::Released);
    let taken = must(
        h,
        "another owner takes the key",
        b.lock_with(&key, patient()).await,
    );
    let reason = tokio::time::timeout(PATIENCE, guard.lost()).await;
    assert!(
        matches!(reason, Ok(LostReason::NotHeld | LostReason::SessionExpired)),
        "[{}] the guard was not told: {reason:?}",
        h.name
    );
    assert!(guard.is_lost());
    // The old guard's release (and the renewals before it) leave the new
    // owner's lock alone.
    assert!(
        matches!(guard.release().await, Err(LockError::Lost { .. })),
        "[{}] the old guard's release did not say it was lost",
        h.name
    );
    a.wait_for_releases().await;
    assert!(!taken.is_lost(), "[{}] the new owner lost the key", h.name);
    assert!(
        must(h, "try_lock", third.try_lock(&key).await).is_none(),
        "[{}] the old guard's release freed the new owner's lock",
        h.name
    );
    must(h, "release", taken.release().await);
}

/// `DistMutex` excludes across clients, and refuses a re-lock in the same
/// task instead of deadlocking.
pub async fn dist_mutex_excludes_across_clients(h: &Harness) {
    let key = h.key("mutex");
    let counter = Arc::new(Mutex::new(0_u64));
    let detector = Arc::new(OverlapDetector::default());
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let locker = h.locker().await;
        let m = Arc::new(DistMutex::with_options(
            &locker,
            key.clone(),
            0_u64,
            LockOptions::new().wait(4 * PATIENCE),
        ));
        for _ in 0..4 {
            let (m, counter, detector) = (m.clone(), counter.clone(), detector.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..5 {
                    let mut g = m.lock().await.expect("DistMutex::lock");
                    let _section = detector.enter();
                    *g += 1;
                    let seen = *counter.lock().unwrap();
                    tokio::task::yield_now().await;
                    *counter.lock().unwrap() = seen + 1;
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("mutex task panicked");
    }
    assert_eq!(
        detector.overlaps(),
        0,
        "[{}] DistMutex guards overlapped",
        h.name
    );
    assert_eq!(
        *counter.lock().unwrap(),
        80,
        "[{}] lost updates under DistMutex",
        h.name
    );
}

/// A zero wait limit is one whole attempt: it acquires each of 20 free keys
/// (the request is not cut off before the server answers), and on a held
/// key it answers `Timeout`.
pub async fn zero_wait_makes_one_whole_attempt(h: &Harness) {
    let locker = h.locker().await;
    let zero = LockOptions::new().wait(Duration::ZERO);
    let mut guards = Vec::new();
    for i in 0..20 {
        let key = h.key(&format!("zero-wait/{i}"));
        match locker.lock_with(&key, zero).await {
            Ok(guard) => guards.push(guard),
            Err(e) => panic!("[{}] zero wait on free key {i}: {e}", h.name),
        }
    }
    let other = h.locker().await;
    let held = other.lock_with(&h.key("zero-wait/0"), zero).await;
    assert!(
        matches!(held, Err(LockError::Timeout { .. })),
        "[{}] zero wait on a held key: {held:?}",
        h.name
    );
    for guard in guards {
        must(h, "release", guard.release().await);
    }
}

/// Bad keys and options give typed errors, never a panic; extreme but valid
/// options work.
pub async fn invalid_input_gives_typed_errors(h: &Harness) {
    let locker = h.locker().await;
    for key in [String::new(), "k".repeat(1 << 20)] {
        let result = locker.lock(&key).await;
        assert!(
            matches!(result, Err(LockError::InvalidKey { .. })),
            "[{}] key of {} bytes: {result:?}",
            h.name,
            key.len()
        );
        let result = locker.try_lock(&key).await;
        assert!(matches!(result, Err(LockError::InvalidKey { .. })));
    }
    let key = h.key("options");
    for lease in [
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_micros(999),
        Duration::MAX,
    ] {
        let result = locker
            .lock_with(&key, LockOptions::new().lease(lease))
            .await;
        assert!(
            matches!(result, Err(LockError::InvalidOptions { .. })),
            "[{}] lease {lease:?}: {result:?}",
            h.name
        );
    }
    for lease in [Duration::ZERO, Duration::from_millis(1), Duration::MAX] {
        let built = LockerBuilder::from_arc(h.client().await)
            .watchdog_lease(lease)
            .build();
        assert!(
            matches!(built, Err(LockError::InvalidOptions { .. })),
            "[{}] watchdog lease {lease:?}",
            h.name
        );
    }
    // Extremes that are valid must simply work.
    let forever = must(
        h,
        "lock with a huge wait limit",
        locker
            .lock_with(&key, LockOptions::new().wait(Duration::MAX))
            .await,
    );
    drop(forever);
    let other = h.locker().await;
    let held = must(h, "lock", other.lock_with(&key, patient()).await);
    let zero = locker
        .lock_with(&key, LockOptions::new().wait(Duration::ZERO))
        .await;
    assert!(
        matches!(zero, Err(LockError::Timeout { .. })),
        "[{}] zero wait on a held key: {zero:?}",
        h.name
    );
    drop(held);
}

/// Keys that need escaping on some servers are accepted and stay distinct:
/// holding all of them at once works, and each excludes another client.
pub async fn awkward_keys_are_distinct_locks(h: &Harness) {
    let base = h.key("awkward");
    let suffixes = [
        "a/b",
        "a%2Fb",
        "a_b",
        "..",
        ".",
        "/",
        "//",
        "a/../b",
        "nul\0byte",
        "new\nline",
        "space key",
        "ключ",
        "🔒",
        "*",
        "{tag}",
    ];
    let mut keys: Vec<String> = suffixes.iter().map(|s| format!("{base}/{s}")).collect();
    keys.push(format!("{base}/{}", "x".repeat(900)));
    let (a, b) = (h.locker().await, h.locker().await);
    let mut guards = Vec::new();
    for key in &keys {
        let g = must(h, "try_lock an awkward key", a.try_lock(key).await);
        assert!(
            g.is_some(),
            "[{}] key {key:?} collided with another key",
            h.name
        );
        guards.push(g);
    }
    for key in &keys {
        let other = must(
            h,
            "try_lock an awkward key held elsewhere",
            b.try_lock(key).await,
        );
        assert!(
            other.is_none(),
            "[{}] key {key:?} was not exclusive",
            h.name
        );
    }
    for g in guards.into_iter().flatten() {
        must(h, "release an awkward key", g.release().await);
    }
    for key in &keys {
        let again = must(h, "try_lock after release", b.try_lock(key).await);
        assert!(again.is_some(), "[{}] key {key:?} not released", h.name);
    }
}
