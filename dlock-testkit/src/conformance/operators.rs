//! What a locker answers without taking a lock (`holder`, `is_locked`),
//! and the operators' forced release.

use std::time::Duration;

use dlock_core::LockError;

use super::{election::unproclaimed, must, Harness, PATIENCE};

/// `Locker::holder` and `Locker::is_locked` answer from another client
/// without taking the lock: free, then held with the holder's fence (or
/// none yet, where the backend learns it from a proclaim), then free
/// again after the release; asking leaves the key to its holder and then
/// to the next taker. Where the backend cannot know, both are
/// `Unsupported`.
pub async fn holder_and_is_locked_read_without_locking(h: &Harness) {
    let name = h.key("is-locked");
    let (owner, asker) = (h.locker().await, h.locker().await);
    if !h.capabilities().await.has_fencing() {
        for refused in [
            asker.holder(&name).await.map(drop),
            asker.is_locked(&name).await.map(drop),
        ] {
            assert!(
                matches!(refused, Err(LockError::Unsupported { .. })),
                "[{}] a holder read without fencing tokens: {refused:?}",
                h.name
            );
        }
        return;
    }
    let free = must(h, "asking about a free key", asker.is_locked(&name).await);
    assert!(!free, "[{}] a free key is locked", h.name);
    let guard = must(h, "the owner locks", owner.lock(&name).await);
    let held = must(h, "asking about a held key", asker.is_locked(&name).await);
    assert!(held, "[{}] a held key is free", h.name);
    let read = must(h, "reading the holder", asker.holder(&name).await)
        .map(|holder| (holder.fence(), holder.into_value()));
    unproclaimed(
        h,
        read,
        guard.fencing_token(),
        "the holder another client reads",
    );
    // Asking took nothing: the key is still the owner's alone.
    let refused = must(h, "a try beside the holder", asker.try_lock(&name).await);
    assert!(refused.is_none(), "[{}] granted beside the holder", h.name);
    assert!(
        !guard.is_lost(),
        "[{}] asking cost the owner its lock",
        h.name
    );
    must(h, "the owner releases", guard.release().await);
    let released = must(h, "asking after the release", asker.is_locked(&name).await);
    assert!(!released, "[{}] a released key is locked", h.name);
    let next = must(h, "the next taker", asker.try_lock(&name).await);
    assert!(next.is_some(), "[{}] asking left the key taken", h.name);
}

/// `Locker::force_release` takes a held lock from its holder, from another
/// client: it answers `true`, the waiter in line gets the key, and the
/// holder's guard reports lost (on a 3 s watchdog lease, so that
/// renewals and session checks come within a second). The holder's own
/// locker can force its own lock the same way. A free key answers
/// `false`. A backend without the capability answers `Unsupported`.
pub async fn force_release_frees_the_key_and_tells_the_holder(h: &Harness) {
    let name = h.key("forced");
    let holder = h
        .locker_with(|b| b.watchdog_lease(Duration::from_secs(3)))
        .await;
    let operator = h.locker().await;
    if !h.capabilities().await.has_forced_release() {
        let refused = operator.force_release(&name).await;
        assert!(
            matches!(refused, Err(LockError::Unsupported { .. })),
            "[{}] a forced release without the capability: {refused:?}",
            h.name
        );
        return;
    }
    let free = must(h, "forcing a free key", operator.force_release(&name).await);
    assert!(!free, "[{}] a free key had a holder to remove", h.name);
    let guard = must(h, "the holder locks", holder.lock(&name).await);
    // A waiter in line (on backends with one) is handed the lock, as
    // after a release.
    let waiter = h.locker().await;
    let waiting = {
        let name = name.clone();
        tokio::spawn(async move {
            waiter
                .lock_with(&name, dlock_core::LockOptions::new().wait(PATIENCE))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let forced = must(
        h,
        "forcing the held key",
        operator.force_release(&name).await,
    );
    assert!(forced, "[{}] no holder was removed", h.name);
    let next = must(
        h,
        "the waiter takes the key",
        waiting.await.expect("the waiter's task"),
    );
    let told = tokio::time::timeout(PATIENCE, guard.lost()).await;
    assert!(
        told.is_ok(),
        "[{}] the holder was never told its lock was taken",
        h.name
    );
    assert!(
        next.fencing_token() > guard.fencing_token() || next.fencing_token().is_none(),
        "[{}] the next holder's fence does not rise",
        h.name
    );
    must(h, "the next holder releases", next.release().await);

    // The holder's own locker forces its own lock: the same. (The lost
    // guard goes first: a backend may keep its process's turn at the key
    // until then.)
    drop(guard);
    let own = must(h, "the holder locks again", holder.lock(&name).await);
    let forced = must(
        h,
        "forcing a lock of its own",
        holder.force_release(&name).await,
    );
    assert!(
        forced,
        "[{}] a locker found no holder of its own lock",
        h.name
    );
    let told = tokio::time::timeout(PATIENCE, own.lost()).await;
    assert!(
        told.is_ok(),
        "[{}] a guard whose own locker forced its lock was never told",
        h.name
    );
    let after = must(
        h,
        "a taker after the own forced release",
        operator
            .lock_with(&name, dlock_core::LockOptions::new().wait(PATIENCE))
            .await,
    );
    must(h, "that taker releases", after.release().await);
}
