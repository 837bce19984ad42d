//! Exclusion: one holder at a time, waits that end when they should, and
//! waiters that get a lock whose holder went away.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{DistMutex, LockError, LockOptions};
use tokio::time::Instant;

use super::{free, must, patient, taken, Harness, PATIENCE};
use crate::OverlapDetector;

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
    taken(
        h,
        "try_lock a held key",
        &b,
        &key,
        "try_lock got a held key",
    )
    .await;
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "[{}] try_lock waited {:?} instead of answering at once",
        h.name,
        start.elapsed()
    );
    must(h, "release", held.release().await);
    let _after = free(
        h,
        "try_lock after release",
        &b,
        &key,
        "try_lock failed on a released key",
    )
    .await;
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
    let _next = free(
        h,
        "try_lock after the timeout",
        &c,
        &key,
        "a timed-out waiter blocked the next owner",
    )
    .await;
}

/// Waiters queued behind a holder that crashed get the lock when its lease
/// ends, even after the waiter ahead of them gave up.
pub async fn queued_waiters_get_an_expired_lock(h: &Harness) {
    let key = h.key("expired-queue");
    let lease = Duration::from_millis(400);
    let holder = h.locker().await;
    // Every client is made first: a new session's setup is no part of the
    // waits, and the impatient waiter's must end well inside the lease.
    let impatient = h.locker().await;
    let mut patient_lockers = Vec::new();
    for _ in 0..3 {
        patient_lockers.push(h.locker().await);
    }
    let guard = must(
        h,
        "lock with a fixed lease",
        holder.lock_with(&key, patient().lease(lease)).await,
    );
    let sent = Instant::now();
    guard.leak();
    let impatient = tokio::spawn({
        let key = key.clone();
        async move {
            impatient
                .lock_with(&key, LockOptions::new().wait(lease / 4))
                .await
                .map(drop)
        }
    });
    tokio::time::sleep(lease / 20).await;
    let mut patient_waiters = Vec::new();
    for locker in patient_lockers {
        let key = key.clone();
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
