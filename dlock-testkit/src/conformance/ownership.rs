//! Ownership: only the holder's own token releases or renews, fencing
//! tokens grow from holder to holder, and a dropped guard releases.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{
    backend::{Backend, Mode, ReleaseOutcome, RenewOutcome, RenewRequest},
    LockError, LockKey, LockOptions, LostReason,
};

use super::{must, patient, taken, Harness, PATIENCE};

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
        mode: Mode::Exclusive,
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
        a.backend()
            .release(&lock_key, Mode::Exclusive, stale.token())
            .await,
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
    taken(
        h,
        "try_lock the new holder's key",
        &c,
        &key,
        "the stale guard released the new holder's lock",
    )
    .await;
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
