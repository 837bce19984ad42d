//! Input: bad keys and options are typed errors, and keys that need
//! escaping on some servers stay distinct locks.

use std::time::Duration;

use dlock_core::{InvalidReason, LockError, LockOptions, LockerBuilder};

use super::{free, must, patient, taken, Harness};

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
            matches!(
                result,
                Err(LockError::InvalidOptions {
                    reason: InvalidReason::Lease { lease: l, .. }
                }) if l == lease
            ),
            "[{}] lease {lease:?}: {result:?}",
            h.name
        );
    }
    for lease in [Duration::ZERO, Duration::from_millis(1), Duration::MAX] {
        let built = LockerBuilder::from_arc(h.client().await)
            .watchdog_lease(lease)
            .build();
        assert!(
            matches!(
                built,
                Err(LockError::InvalidOptions {
                    reason: InvalidReason::Lease { .. }
                })
            ),
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
        let g = free(
            h,
            "try_lock an awkward key",
            &a,
            key,
            &format!("key {key:?} collided with another key"),
        )
        .await;
        guards.push(g);
    }
    for key in &keys {
        taken(
            h,
            "try_lock an awkward key held elsewhere",
            &b,
            key,
            &format!("key {key:?} was not exclusive"),
        )
        .await;
    }
    for g in guards {
        must(h, "release an awkward key", g.release().await);
    }
    for key in &keys {
        let _again = free(
            h,
            "try_lock after release",
            &b,
            key,
            &format!("key {key:?} not released"),
        )
        .await;
    }
}
