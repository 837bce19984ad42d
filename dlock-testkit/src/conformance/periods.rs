//! Jobs that run once per period: a lock taken with
//! [`hold_at_least`](dlock_core::LockOptions::hold_at_least) stays held
//! until that time whenever it is released, and backends that cannot keep
//! a lock past its client refuse it.

use std::time::Duration;

use dlock_core::{LockError, LockOptions};
use tokio::time::Instant;

use super::{free, must, patient, taken, Harness};

/// Whether the backend keeps a released lock until `hold_at_least`; if
/// not, checks that asking for it is refused, typed, before any lock.
async fn offered(h: &Harness, key: &str) -> bool {
    if h.capabilities().await.has_server_leases() {
        return true;
    }
    let asked = LockOptions::new().hold_at_least(Duration::from_secs(1));
    match h.locker().await.lock_with(key, asked).await {
        Err(LockError::Unsupported { .. }) => {}
        other => panic!(
            "[{}] hold_at_least on a backend without server leases: expected Unsupported, got {other:?}",
            h.name
        ),
    }
    let locker = h.locker().await;
    drop(
        free(
            h,
            "try_lock after the refusal",
            &locker,
            key,
            "a refused hold_at_least left the key held",
        )
        .await,
    );
    false
}

/// A lock released before its `hold_at_least` stays held, with its fence
/// and holder, until that time after the grant, then frees; released
/// after it, it frees at once. A `hold_at_least` longer than a fixed lease
/// is refused.
pub async fn hold_at_least_keeps_a_released_lock_until_its_time(h: &Harness) {
    let key = h.key("hold-at-least");
    if !offered(h, &key).await {
        return;
    }
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    let at_least = Duration::from_millis(800);
    let asked = Instant::now();
    let guard = must(
        h,
        "lock with hold_at_least",
        a.lock_with(&key, patient().hold_at_least(at_least)).await,
    );
    let fence = guard.fencing_token();
    // A waiter that waits already when the release comes: it must hear of
    // the new end, not wait out the watchdog lease's.
    let waiter = async {
        let next = must(h, "lock after the hold", b.lock_with(&key, patient()).await);
        (asked.elapsed(), next)
    };
    let checks = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        must(h, "release before the time", guard.release().await);
        taken(
            h,
            "try_lock after an early release",
            &c,
            &key,
            "a release before hold_at_least freed the key",
        )
        .await;
        match c.holder(&key).await {
            Ok(Some(holder)) => assert_eq!(
                holder.fence(),
                fence,
                "[{}] the fence changed during the hold",
                h.name
            ),
            // Redlock and unfenced Redis cannot say who holds.
            Err(LockError::Unsupported { .. }) => {}
            other => panic!("[{}] holder during the hold: {other:?}", h.name),
        }
    };
    let ((after, next), ()) = tokio::join!(waiter, checks);
    assert!(
        after >= at_least,
        "[{}] the key freed {after:?} after the grant, before {at_least:?}",
        h.name
    );
    // A waiter looks again within a second at most (Redis's line).
    assert!(
        after < at_least + Duration::from_secs(2),
        "[{}] a waiter got the key {after:?} after the grant",
        h.name
    );
    assert!(
        next.fencing_token() > fence || fence.is_none(),
        "[{}] the next fence did not rise",
        h.name
    );
    must(h, "release", next.release().await);

    let short = Duration::from_millis(100);
    let guard = must(
        h,
        "lock again",
        a.lock_with(&key, patient().hold_at_least(short)).await,
    );
    tokio::time::sleep(short * 2).await;
    must(h, "release after the time", guard.release().await);
    drop(
        free(
            h,
            "try_lock after a late release",
            &b,
            &key,
            "a release after hold_at_least kept the key",
        )
        .await,
    );

    let longer = patient()
        .lease(Duration::from_secs(1))
        .hold_at_least(Duration::from_secs(2));
    assert!(
        matches!(
            a.lock_with(&key, longer).await,
            Err(LockError::InvalidOptions { .. })
        ),
        "[{}] hold_at_least longer than the fixed lease was not refused",
        h.name
    );
}

/// Three clients fire a job at each of three ticks a second apart, each
/// up to 300 ms early or late, with `hold_at_least(800ms)`: every tick's
/// job runs exactly once.
pub async fn hold_at_least_runs_each_tick_once(h: &Harness) {
    let key = h.key("ticks");
    if !offered(h, &key).await {
        return;
    }
    const TICKS: u32 = 3;
    let skews = [-300_i64, 0, 300];
    let start = Instant::now() + Duration::from_millis(400);
    let runs = std::sync::Mutex::new(Vec::new());
    let client = |skew_of: usize| {
        let (key, runs) = (&key, &runs);
        async move {
            let locker = h.locker().await;
            for tick in 0..TICKS {
                // Each client is early or late by another amount each tick.
                let skew = skews[(skew_of + tick as usize) % skews.len()];
                let at = start + Duration::from_secs(tick.into());
                let at = if skew < 0 {
                    at - Duration::from_millis(skew.unsigned_abs())
                } else {
                    at + Duration::from_millis(skew.unsigned_abs())
                };
                tokio::time::sleep_until(at).await;
                let once = LockOptions::new().hold_at_least(Duration::from_millis(800));
                let taken = must(
                    h,
                    "try_lock at a tick",
                    locker.try_lock_with(key, once).await,
                );
                if let Some(guard) = taken {
                    runs.lock().unwrap().push(tick);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    must(h, "release the tick's job", guard.release().await);
                }
            }
        }
    };
    futures_util::future::join3(client(0), client(1), client(2)).await;
    let mut runs = runs.into_inner().unwrap();
    runs.sort_unstable();
    assert_eq!(
        runs,
        (0..TICKS).collect::<Vec<_>>(),
        "[{}] the ticks' jobs ran {runs:?}",
        h.name
    );
}

/// A key that `lock_all` took and gave back unused (a later key was held)
/// is free at once, whatever `hold_at_least` asked: only a grant the
/// caller got is kept past its release.
pub async fn hold_at_least_never_keeps_a_key_given_back_unused(h: &Harness) {
    let (first, second) = (h.key("given-back-a"), h.key("given-back-b"));
    if !offered(h, &first).await {
        return;
    }
    let (a, b) = (h.locker().await, h.locker().await);
    let held = must(
        h,
        "lock the second key",
        b.lock_with(&second, patient()).await,
    );
    let once = LockOptions::new()
        .wait(Duration::from_millis(200))
        .hold_at_least(Duration::from_secs(60));
    let refused = a.lock_all([&first, &second], once).await;
    assert!(refused.is_err(), "[{}] lock_all got a held key", h.name);
    drop(
        free(
            h,
            "try_lock the key given back",
            &b,
            &first,
            "a key given back unused was kept for hold_at_least",
        )
        .await,
    );
    drop(held);
}
