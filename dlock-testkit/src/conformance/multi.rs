//! Several keys at once (`Locker::lock_all`): all or nothing within one
//! wait limit, one canonical order whatever the caller names, nothing
//! left behind by a timeout or a cancel, and lost when any key is.

use std::{sync::Arc, time::Duration};

use dlock_core::{InvalidReason, LockError, LockOptions, LostReason};
use tokio::time::Instant;

use super::{must, patient, release_behind_its_back, Harness, PATIENCE};
use crate::{OverlapDetector, Rng};

/// Two clients lock the same two keys in opposite orders, 20 times each:
/// neither waits out its limit (no deadlock), and their holds of the pair
/// never overlap.
pub async fn lock_all_in_opposite_orders_neither_deadlocks_nor_overlaps(h: &Harness) {
    let (a, b) = (h.key("pair-a"), h.key("pair-b"));
    let detector = Arc::new(OverlapDetector::default());
    let mut tasks = Vec::new();
    for (i, keys) in [[a.clone(), b.clone()], [b, a]].into_iter().enumerate() {
        let locker = h.locker().await;
        let (detector, name) = (detector.clone(), h.name().to_owned());
        tasks.push(tokio::spawn(async move {
            for round in 0..20 {
                let all = match locker.lock_all(&keys, patient()).await {
                    Ok(all) => all,
                    Err(e) => panic!("[{name}] client {i}, round {round}: {e}"),
                };
                let inside = detector.enter();
                tokio::time::sleep(Duration::from_millis(1)).await;
                drop(inside);
                if let Err(e) = all.release().await {
                    panic!("[{name}] client {i}, round {round}: release: {e}");
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("a client's task");
    }
    assert_eq!(detector.entries(), 40, "[{}] entries", h.name);
    assert_eq!(
        detector.overlaps(),
        0,
        "[{}] two holders of the pair at once",
        h.name
    );
}

/// With the second key held elsewhere, `lock_all` times out within its
/// limit, naming that key, and gives the first back before it returns:
/// another client takes it at once.
pub async fn lock_all_that_times_out_gives_back_what_it_took(h: &Harness) {
    let (first, second) = (h.key("half-1"), h.key("half-2"));
    let (holder, caller, other) = (h.locker().await, h.locker().await, h.locker().await);
    let held = must(
        h,
        "the second key",
        holder.lock_with(&second, patient()).await,
    );
    let limit = Duration::from_millis(300);
    let started = Instant::now();
    let refused = caller
        .lock_all([&second, &first], LockOptions::new().wait(limit))
        .await;
    match &refused {
        Err(LockError::Timeout { key, .. }) => {
            assert_eq!(key, &second, "[{}] the timeout names another key", h.name)
        }
        other => panic!("[{}] lock_all with a key held: {other:?}", h.name),
    }
    assert!(
        started.elapsed() < limit + PATIENCE / 2,
        "[{}] lock_all overran its limit: {:?}",
        h.name,
        started.elapsed()
    );
    let free = must(h, "the first key", other.try_lock(&first).await);
    assert!(
        free.is_some(),
        "[{}] the key lock_all took was not given back when it returned",
        h.name
    );
    drop(free);
    drop(held);
}

/// 96 `lock_all` futures on three keys from 3 clients, dropped at random
/// points (0–20 ms) while the keys are contended, leave nothing behind:
/// afterwards a new client takes all three within its patience, and each
/// key is free to `try_lock` soon after (drop-releases are scheduled).
pub async fn lock_all_cancel_storm_leaves_nothing(h: &Harness) {
    let keys = [h.key("storm-x"), h.key("storm-y"), h.key("storm-z")];
    let mut rng = Rng::from_env();
    let seed = rng.seed();
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(h.locker().await);
    }
    let mut tasks = Vec::new();
    for i in 0..96 {
        let locker = clients[i % clients.len()].clone();
        let mut order = keys.clone();
        order.rotate_left(i % 3);
        let after = Duration::from_millis(rng.below(21));
        tasks.push(tokio::spawn(async move {
            if let Ok(Ok(all)) =
                tokio::time::timeout(after, locker.lock_all(&order, LockOptions::new())).await
            {
                drop(all);
            }
        }));
        if i % 8 == 7 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    for task in tasks {
        task.await.expect("a storm task");
    }
    let fresh = h.locker().await;
    let all = must(
        h,
        "all three after the storm",
        fresh.lock_all(&keys, patient()).await,
    );
    must(h, "their release", all.release().await);
    for key in &keys {
        let started = Instant::now();
        let mut free = None;
        while free.is_none() && started.elapsed() < PATIENCE {
            free = must(h, "a try after the storm", fresh.try_lock(key).await);
            if free.is_none() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert!(
            free.is_some(),
            "[{}] {key} stayed held after the storm (seed {seed})",
            h.name
        );
    }
}

/// When one key of a `lock_all` is lost (released behind the guard's back
/// and taken by another owner), the whole guard reports lost, naming it,
/// within two renewals; the other key's guard is not lost.
pub async fn one_lost_key_makes_the_whole_guard_lost(h: &Harness) {
    let (kept, taken) = (h.key("whole-kept"), h.key("whole-taken"));
    let lease = Duration::from_millis(600);
    let a = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let b = h.locker().await;
    let all = must(h, "both keys", a.lock_all([&kept, &taken], patient()).await);
    let guard = all
        .guards()
        .iter()
        .find(|g| g.key() == taken)
        .expect("the guard of the key to take");
    release_behind_its_back(h, &a, guard).await;
    let other = must(h, "another owner", b.lock_with(&taken, patient()).await);
    let told_within = h.session.unwrap_or(lease) * 2;
    let lost = tokio::time::timeout(told_within, all.lost()).await;
    match lost {
        Ok((key, LostReason::NotHeld | LostReason::SessionExpired)) => {
            assert_eq!(key, taken, "[{}] the loss names another key", h.name)
        }
        other => panic!("[{}] the whole guard was not told: {other:?}", h.name),
    }
    assert!(all.is_lost(), "[{}] lost, but is_lost says no", h.name);
    let kept_guard = all
        .guards()
        .iter()
        .find(|g| g.key() == kept)
        .expect("the kept key's guard");
    assert!(
        !kept_guard.is_lost(),
        "[{}] the key nobody took was lost too",
        h.name
    );
    drop(other);
}

/// An empty list and a key named twice are typed errors, before any key
/// is taken.
pub async fn lock_all_rejects_empty_and_repeated_lists(h: &Harness) {
    let locker = h.locker().await;
    let empty: [&str; 0] = [];
    let once = h.key("repeated");
    for (what, result, duplicate) in [
        (
            "an empty list",
            locker.lock_all(empty, patient()).await,
            false,
        ),
        (
            "a key named twice",
            locker.lock_all([&once, &once], patient()).await,
            true,
        ),
    ] {
        assert!(
            match &result {
                Err(LockError::InvalidOptions {
                    reason: InvalidReason::DuplicateKey { key },
                }) => duplicate && *key == once,
                Err(LockError::InvalidOptions {
                    reason: InvalidReason::NoKeys,
                }) => !duplicate,
                _ => false,
            },
            "[{}] {what}: {result:?}",
            h.name
        );
    }
    let free = must(
        h,
        "the repeated key",
        h.locker().await.try_lock(&once).await,
    );
    assert!(free.is_some(), "[{}] a refused list took its key", h.name);
}

/// `lock_all` never returns a guard that names a lost key: with a fixed
/// lease shorter than its wait for the second key, the first lapses while
/// it waits, and the caller gets either every key held or an error. A
/// limit too large for the clock (`Duration::MAX`) waits, as forever does.
pub async fn lock_all_never_returns_a_lost_part(h: &Harness) {
    let (first, second) = (h.key("lapsing-1"), h.key("lapsing-2"));
    let (holder, caller) = (h.locker().await, h.locker().await);
    let held = must(
        h,
        "the second key",
        holder.lock_with(&second, patient()).await,
    );
    let lease = Duration::from_millis(300);
    let freed = tokio::spawn(async move {
        tokio::time::sleep(lease * 3).await;
        held.release().await
    });
    let options = LockOptions::new().lease(lease).wait(PATIENCE);
    match caller.lock_all([&first, &second], options).await {
        Ok(all) => {
            assert!(
                !all.is_lost(),
                "[{}] lock_all returned a guard with a lost key: {all:?}",
                h.name
            );
            drop(all);
        }
        Err(LockError::Lost { .. }) => {}
        Err(other) => panic!("[{}] lock_all past a lapsed key: {other:?}", h.name),
    }
    must(
        h,
        "the holder's release",
        freed.await.expect("the release task"),
    );
    let all = must(
        h,
        "lock_all with a limit of Duration::MAX",
        caller
            .lock_all([&first, &second], LockOptions::new().wait(Duration::MAX))
            .await,
    );
    must(h, "release", all.release().await);
}
