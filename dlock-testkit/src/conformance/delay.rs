//! A lock delay: a key whose holder lost it without releasing it (its
//! lease ran out, its process stopped) is kept from everyone for the delay
//! after the holder's lease, and a released key frees at once.

use std::time::Duration;

use dlock_core::{LockError, LockOptions, MAX_LOCK_DELAY};
use tokio::time::Instant;

use super::{free, must, patient, taken, Harness};

/// How much earlier than its lease plus delay a grant may come: the
/// server's and the client's clocks tick apart by a millisecond or so.
const CLOCKS: Duration = Duration::from_millis(30);

/// After a fixed lease (extended once) ran out, and after a holder stopped
/// renewing, the key is granted no sooner than the lease plus the delay,
/// with a higher fence where the backend fences, the lost holder told
/// first; a release after the loss keeps the delay; a clean release
/// frees the key at once; a delay over the longest is a typed error, and
/// a backend whose locks end with their session refuses one, typed.
pub async fn lock_delay_keeps_a_lost_key_and_not_a_released_one(h: &Harness) {
    let key = h.key("lock-delay");
    let delay = Duration::from_millis(800);
    let delayed = |options: LockOptions| options.lock_delay(delay);
    let b = h.locker().await;
    if !h.capabilities().await.has_server_leases() {
        match b.lock_with(&key, delayed(patient())).await {
            Err(LockError::Unsupported { .. }) => {}
            other => panic!(
                "[{}] lock_delay on a backend without server leases: expected Unsupported, got {other:?}",
                h.name
            ),
        }
        drop(
            free(
                h,
                "try_lock after the refusal",
                &b,
                &key,
                "a refused lock_delay left the key held",
            )
            .await,
        );
        return;
    }
    match b
        .lock_with(
            &key,
            patient().lock_delay(MAX_LOCK_DELAY + Duration::from_millis(1)),
        )
        .await
    {
        Err(LockError::InvalidOptions { .. }) => {}
        other => panic!(
            "[{}] a lock_delay over the longest: expected InvalidOptions, got {other:?}",
            h.name
        ),
    }

    // A fixed lease, extended once, that runs out: its holder releases
    // only after the loss, which is no clean release.
    let a = h.locker().await;
    let lease = Duration::from_millis(600);
    let guard = must(
        h,
        "lock with a fixed lease and a delay",
        a.lock_with(&key, delayed(patient().lease(lease))).await,
    );
    let fence = guard.fencing_token();
    let extended = Instant::now();
    must(h, "extend the fixed lease", guard.extend(lease).await);
    guard.lost().await;
    match guard.release().await {
        Err(LockError::Lost { .. }) => {}
        other => panic!(
            "[{}] a release after the loss: expected Lost, got {other:?}",
            h.name
        ),
    }
    taken(
        h,
        "try_lock once the holder's lease ran out and it released",
        &b,
        &key,
        "a release after the loss freed the key before the delay",
    )
    .await;
    let next = must(
        h,
        "lock after the delay",
        b.lock_with(&key, patient()).await,
    );
    let after = extended.elapsed();
    assert!(
        after + CLOCKS >= lease + delay,
        "[{}] granted {after:?} after the lost holder's extension: before its lease ({lease:?}) and delay ({delay:?})",
        h.name
    );
    if h.capabilities().await.has_fencing() {
        assert!(
            next.fencing_token() > fence,
            "[{}] the next grant's fence did not rise",
            h.name
        );
    }
    must(h, "release the next grant", next.release().await);

    // A holder that stops renewing (a crash): its last renewal was sent at
    // most a third of its lease before.
    let key = h.key("lock-delay-crash");
    let lease = Duration::from_millis(900);
    let c = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let guard = must(
        h,
        "lock with the watchdog and a delay",
        c.lock_with(&key, delayed(patient())).await,
    );
    tokio::time::sleep(lease / 2).await;
    let crashed = Instant::now();
    guard.leak();
    let next = must(
        h,
        "lock after a crashed holder's delay",
        b.lock_with(&key, patient()).await,
    );
    let after = crashed.elapsed();
    assert!(
        after + CLOCKS >= lease * 2 / 3 + delay,
        "[{}] granted {after:?} after the holder stopped renewing: within two thirds of its lease ({lease:?}) and the delay ({delay:?})",
        h.name
    );
    must(h, "release after the crash", next.release().await);

    // A release frees the key at once.
    let key = h.key("lock-delay-release");
    let guard = must(
        h,
        "lock with a delay",
        a.lock_with(&key, delayed(patient())).await,
    );
    must(h, "release", guard.release().await);
    drop(
        free(
            h,
            "try_lock after a release",
            &b,
            &key,
            "a released key was kept for its lock_delay",
        )
        .await,
    );
}
