//! Leases: a crashed holder's lock lasts its lease (or session) and no
//! more, the watchdog keeps a live one, and a lost lock is reported no later
//! than another client can acquire it.

use std::{
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use dlock_core::{
    backend::{Backend, Mode, RenewOutcome, RenewRequest},
    distributed_lock, LockError, LockKey, LockOptions, Locker, LostReason, Token,
};
use tokio::time::Instant;

use super::{
    free, must, patient, primitives::offered, release_behind_its_back, taken, Harness, PATIENCE,
};

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
    taken(
        h,
        "try_lock the crashed holder's key",
        other,
        key,
        "a crashed holder's lock was free at once",
    )
    .await;
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
        taken(
            h,
            "try_lock a leaked session lock",
            &b,
            &key,
            "a leaked lock ended while its session lived",
        )
        .await;
        return;
    }
    // The last renewal was sent at most a third of the lease before the
    // crash, so at least two thirds of it remain; ask for one third, leaving
    // slack for a late tick on a loaded machine.
    let crashed = Instant::now();
    guard.leak();
    take_over_from_crashed(h, &key, &b, crashed, lease / 3, lease).await;
}

/// A client that holds `key` with a short watchdog lease, on a runtime of
/// its own that then shuts down (taking its watchdog, its keepalives and
/// its pending release along). With `close`, its guard is dropped after
/// that, closing its connections, as a killed process's are; otherwise it
/// is leaked with them open, as a paused process's stay. Returns when the
/// client stopped, and the lease it had.
///
/// The holder runs on a thread of its own, which this check awaits without
/// blocking its task: a suite runs other checks in the same task (see
/// [`run_suite`](super::run_suite)), and their timing must not stop while
/// this one waits.
async fn stop_a_holder(h: &Harness, key: &str, close: bool) -> (Instant, Duration) {
    let lease = Duration::from_millis(900);
    let (holder_h, key) = (h.detached(), key.to_owned());
    let (tell, stopped) = tokio::sync::oneshot::channel();
    let holder = std::thread::spawn(move || {
        let h = holder_h;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the holder");
        let guard = runtime.block_on(async {
            let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
            let guard = must(&h, "lock", a.lock_with(&key, patient()).await);
            // Let the watchdog renew once.
            tokio::time::sleep(lease / 2).await;
            guard
        });
        drop(runtime);
        let stopped = Instant::now();
        if close {
            // Its release has no runtime left to run on.
            drop(guard);
        } else {
            std::mem::forget(guard);
        }
        let _ = tell.send(stopped);
    });
    match stopped.await {
        Ok(stopped) => (stopped, lease),
        // The thread panicked (before it could tell): its panic is the
        // check's.
        Err(_) => match holder.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => panic!("[{}] the holder thread ended without a word", h.name),
        },
    }
}

/// A holder whose whole client dies (its runtime shuts down, and its
/// connections close) lets others in after its lease (or session
/// timeout), not before: its last renewal or ping came at most a third of
/// it before the crash, so the lock must stay held for at least half of
/// it. On a server that ends a client's locks with its connection
/// ([`Harness::disconnect_releases`]), it lets others in at once instead.
/// Needs the multi-thread runtime.
pub async fn crashed_client_lets_others_in_after_its_lease(h: &Harness) {
    let key = h.key("crash-client");
    let b = h.locker().await;
    let (crashed, lease) = stop_a_holder(h, &key, true).await;
    let outlives = h.session.unwrap_or(lease);
    if h.disconnect_releases {
        let next = must(
            h,
            "lock after the crash",
            b.lock_with(&key, patient()).await,
        );
        let after = crashed.elapsed();
        assert!(
            after < outlives / 2,
            "[{}] a crashed client's closed connection kept its lock for {after:?}",
            h.name
        );
        drop(next);
        return;
    }
    take_over_from_crashed(h, &key, &b, crashed, outlives / 2, outlives).await;
}

/// A holder whose client stops with its connections still open (a paused
/// or wedged process: no watchdog, no keepalive, no release, and no
/// connection closed for the server to notice) lets others in after its
/// lease (or session timeout), not before. Needs the multi-thread runtime.
pub async fn stopped_client_lets_others_in_after_its_lease(h: &Harness) {
    let key = h.key("stopped-client");
    let b = h.locker().await;
    let (stopped, lease) = stop_a_holder(h, &key, false).await;
    let outlives = h.session.unwrap_or(lease);
    take_over_from_crashed(h, &key, &b, stopped, outlives / 2, outlives).await;
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
    let _next = free(
        h,
        "lock after release",
        &b,
        &key,
        "lock still held after release",
    )
    .await;
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

/// A fixed lease counts from the grant, not from the request: a lock won
/// after a wait longer than its lease comes back held, and holds (to
/// others too) for its whole lease from the grant.
pub async fn a_fixed_lease_counts_from_the_grant(h: &Harness) {
    let key = h.key("lease-after-wait");
    let (holder, waiter, other) = (h.locker().await, h.locker().await, h.locker().await);
    let lease = Duration::from_millis(800);
    let held = must(h, "the first hold", holder.lock_with(&key, patient()).await);
    let released = tokio::spawn(async move {
        // Longer than the waiter's lease.
        tokio::time::sleep(lease + Duration::from_millis(400)).await;
        held.release().await
    });
    let guard = must(
        h,
        "a lock won after a wait longer than its lease",
        waiter.lock_with(&key, patient().lease(lease)).await,
    );
    let granted = Instant::now();
    must(
        h,
        "the first release",
        released.await.expect("the release task"),
    );
    assert!(
        !guard.is_lost(),
        "[{}] a lock won after a wait came back lost",
        h.name
    );
    // Well inside the lease from the grant, it still holds, for everyone.
    tokio::time::sleep(lease / 2).await;
    let refused = must(h, "try_lock", other.try_lock(&key).await);
    assert!(
        refused.is_none() && !guard.is_lost(),
        "[{}] the lease ended {:?} after the grant, before its {lease:?} (lost: {})",
        h.name,
        granted.elapsed(),
        guard.is_lost()
    );
    drop(guard);
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
    // Released behind its back, and another owner takes the key before
    // the next renewal.
    release_behind_its_back(h, &a, &guard).await;
    let taken = must(
        h,
        "another owner takes the key",
        b.lock_with(&key, patient()).await,
    );
    // Renewals (or a session's checks) come every third of the lease (or
    // session timeout): told within two of them, with room to spare.
    let told_within = h.session.unwrap_or(lease) * 2;
    let reason = tokio::time::timeout(told_within, guard.lost()).await;
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

/// One renewal of many locks answers each lock in its place: renewed
/// where its guard holds the lock, not held where it was released behind
/// the guard's back, whether the key is free now or another client took
/// it. 600 locks, past the size of a batch a backend may renew in one call
/// (256 on Redis), the released ones at the batches' edges, and a read
/// lock among them where the backend has them (released too), whose
/// renewal goes apart from the plain locks'.
pub async fn a_renewal_of_many_locks_answers_each_in_its_place(h: &Harness) {
    const LOCKS: usize = 600;
    // 300 is the read lock where there is one.
    const RELEASED: [usize; 10] = [0, 1, 255, 256, 257, 300, 511, 512, 513, 599];
    let (a, b) = (h.locker().await, h.locker().await);
    let mut guards = Vec::with_capacity(LOCKS + 1);
    for i in 0..LOCKS {
        let key = h.key(&format!("renew-many-{i}"));
        let guard = must(h, "try_lock", a.try_lock(&key).await);
        guards.push(guard.unwrap_or_else(|| panic!("[{}] {key} was held", h.name)));
    }
    let read_key = h.key("renew-many-read");
    if offered(h, &a, &read_key, Mode::Read).await {
        let read = must(
            h,
            "a read lock",
            a.lock_mode(&read_key, Mode::Read, patient()).await,
        );
        guards.insert(300, read);
    }
    let mut expected = vec![RenewOutcome::Renewed; guards.len()];
    let mut others = Vec::new();
    for (n, &at) in RELEASED.iter().enumerate() {
        release_behind_its_back(h, &a, &guards[at]).await;
        expected[at] = RenewOutcome::NotHeld;
        if n % 2 == 1 {
            let key = guards[at].key().to_owned();
            others.push(must(h, "another owner", b.lock_with(&key, patient()).await));
        }
    }
    let requests: Vec<RenewRequest> = guards
        .iter()
        .map(|guard| RenewRequest {
            key: LockKey::new(guard.key()).expect("valid key"),
            mode: guard.mode(),
            token: *guard.token(),
            lease: Duration::from_secs(30),
        })
        .collect();
    let renewed = must(h, "renew", a.backend().renew(&requests).await);
    let wrong: Vec<(usize, RenewOutcome)> = renewed
        .iter()
        .enumerate()
        .filter(|&(at, outcome)| expected.get(at) != Some(outcome))
        .map(|(at, outcome)| (at, *outcome))
        .collect();
    assert!(
        renewed.len() == expected.len() && wrong.is_empty(),
        "[{}] {} outcomes for {} locks; out of place: {wrong:?}",
        h.name,
        renewed.len(),
        expected.len()
    );
    assert!(
        others.iter().all(|other| !other.is_lost()),
        "[{}] another owner lost a key",
        h.name
    );
    drop((guards, others));
    a.wait_for_releases().await;
    b.wait_for_releases().await;
}

/// A body that does guarded steps, one each 10 ms, under the lock, until it
/// is dropped; sends its token out first.
#[distributed_lock(key = "{key}", locker = locker, wait = "10s", guard = lock, abort_on_lost)]
async fn guarded_steps(
    locker: &Locker,
    key: &str,
    token: tokio::sync::oneshot::Sender<Token>,
    steps: &AtomicU32,
) -> Result<(), LockError> {
    let _ = token.send(*lock.token());
    loop {
        steps.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `#[distributed_lock(abort_on_lost)]` on a real server: once the server no
/// longer holds the lock for the body (its entry removed behind its back,
/// another owner taking the key), the next renewal drops the body, and the
/// call answers `Lost` within a lease; the body takes no step after that.
pub async fn abort_on_lost_drops_the_body_the_server_took_the_lock_from(h: &Harness) {
    let key = h.key("abort-on-lost");
    let lease = Duration::from_millis(600);
    let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let b = h.locker().await;
    let steps = AtomicU32::new(0);
    let (token_tx, token_rx) = tokio::sync::oneshot::channel();
    let body = guarded_steps(&a, &key, token_tx, &steps);
    let takeover = async {
        let token = token_rx.await.expect("the body started");
        let lock_key = LockKey::new(&key).expect("valid key");
        // A session backend may tell the guard at once, and the aborted
        // body's own release may then delete the entry first.
        must(
            h,
            "release behind the body's back",
            a.backend()
                .release(&lock_key, Mode::Exclusive, &token)
                .await,
        );
        let taken = must(
            h,
            "another owner takes the key",
            b.lock_with(&key, patient()).await,
        );
        (taken, Instant::now())
    };
    let started = Instant::now();
    let (answer, (taken, taken_at)) = tokio::join!(
        async {
            let answer = tokio::time::timeout(PATIENCE, body).await;
            (answer, Instant::now(), steps.load(Ordering::SeqCst))
        },
        takeover
    );
    let (answer, aborted_at, steps_at_abort) = answer;
    assert!(
        matches!(answer, Ok(Err(LockError::Lost { .. }))),
        "[{}] the body was not aborted with Lost: {answer:?}",
        h.name
    );
    assert!(steps_at_abort > 0, "[{}] the body never ran", h.name);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        steps.load(Ordering::SeqCst),
        steps_at_abort,
        "[{}] the body took steps after it was aborted",
        h.name
    );
    let after_takeover = aborted_at.saturating_duration_since(taken_at);
    println!(
        "[{}] aborted {after_takeover:?} after another owner took the key ({:?} in all)",
        h.name,
        started.elapsed()
    );
    // The next renewal comes within a third of the lease; a late tick on a
    // loaded machine gets the rest of the lease.
    assert!(
        after_takeover < lease,
        "[{}] the body ran on {after_takeover:?} after losing the lock",
        h.name
    );
    must(h, "release", taken.release().await);
}

/// `LockGuard::extend` moves a fixed lease's end, later and earlier, as
/// the server sees it: a 1 s lease extended to 6 s still excludes others
/// after 1.5 s; cut back to 1 s, it lets the next taker in well before
/// the 6 s end, and the guard says it lost the lock by then. The server checks the owner: a guard
/// whose lease ran out and whose key has a new holder gets `Lost` and
/// takes nothing back. A watchdog lock has no end to move.
pub async fn extend_moves_a_fixed_lease_and_checks_the_owner(h: &Harness) {
    let key = h.key("extend");
    let (a, b) = (h.locker().await, h.locker().await);
    let fixed = |lease| LockOptions::new().lease(lease);
    let guard = must(
        h,
        "lock with a fixed lease",
        a.lock_with(&key, fixed(Duration::from_secs(1))).await,
    );
    must(
        h,
        "extend to 6 s",
        guard.extend(Duration::from_secs(6)).await,
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !guard.is_lost(),
        "[{}] an extended lease ended at its first end",
        h.name
    );
    let refused = must(h, "a try after the first end", b.try_lock(&key).await);
    assert!(
        refused.is_none(),
        "[{}] granted beside a lease extended on the server",
        h.name
    );
    must(
        h,
        "cut back to 1 s",
        guard.extend(Duration::from_secs(1)).await,
    );
    // Well before the 6 s end (4.5 s away): the server took the cut.
    let soon = LockOptions::new().wait(Duration::from_secs(3));
    let next = must(
        h,
        "the next taker, before the old end",
        b.lock_with(&key, soon).await,
    );
    assert!(
        guard.is_lost(),
        "[{}] another client acquired while the cut-back guard said it held",
        h.name
    );
    // A backend may keep its process's turn at the key until a lost
    // guard goes.
    drop(guard);
    must(h, "the next taker releases", next.release().await);
    // Taken from it by another client (an operator's forced release
    // where the backend has one), then by a new holder: the server, or
    // the backend's session told by it, refuses the extension.
    let stale = must(
        h,
        "a 10 s lease",
        a.lock_with(&key, fixed(Duration::from_secs(10))).await,
    );
    if h.capabilities().await.has_forced_release() {
        let forced = must(h, "a forced release", b.force_release(&key).await);
        assert!(forced, "[{}] the forced release found no holder", h.name);
    } else {
        release_behind_its_back(h, &a, &stale).await;
    }
    let next = must(h, "the next holder", b.lock_with(&key, patient()).await);
    let late = stale.extend(Duration::from_secs(10)).await;
    assert!(
        matches!(late, Err(LockError::Lost { .. })),
        "[{}] a guard released behind its back extended: {late:?}",
        h.name
    );
    assert!(
        stale.is_lost(),
        "[{}] a refused extension left the guard held",
        h.name
    );
    let still = must(h, "a try beside the new holder", a.try_lock(&key).await);
    assert!(
        still.is_none() && !next.is_lost(),
        "[{}] a refused extension took the lock back",
        h.name
    );
    must(h, "the new holder releases", next.release().await);
    drop(stale);
    let watchdog = must(h, "a watchdog lock", a.lock(&key).await);
    let refused = watchdog.extend(Duration::from_secs(10)).await;
    assert!(
        matches!(
            refused,
            Err(LockError::InvalidOptions {
                reason: dlock_core::InvalidReason::NotFixedLease
            })
        ),
        "[{}] a watchdog lock extended: {refused:?}",
        h.name
    );
}
