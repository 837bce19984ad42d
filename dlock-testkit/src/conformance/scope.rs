//! Reentrancy follows the lock's scope: inside the future that runs under a
//! hold (a guard's `scope`, `with_lock`, a `#[distributed_lock]` body), a
//! lock of the same key through the same locker re-enters without asking
//! the server; everything outside that future contends like any other
//! owner, whichever task or thread it runs on.

use std::{pin::pin, sync::Arc, time::Duration};

use dlock_core::{
    backend::BoxFuture, distributed_lock, DistMutex, DistMutexGuard, LockError, LockGuard,
    LockOptions, Locker, OwnedDistMutexGuard, Token,
};
use futures_util::{stream::FuturesUnordered, StreamExt};

use super::{must, patient, taken, Harness, PATIENCE};
use crate::{CountingBackend, OverlapDetector};

/// How long a lock that must not be granted is waited for.
const REFUSED_WITHIN: Duration = Duration::from_millis(200);

fn briefly() -> LockOptions {
    LockOptions::new().wait(REFUSED_WITHIN)
}

/// Locks `key` inside the current scope, then goes one level deeper inside
/// the new guard's own scope, `depth` times; returns every guard it took.
fn descend<'a>(
    locker: &'a Locker,
    key: &'a str,
    depth: usize,
) -> BoxFuture<'a, dlock_core::Result<Vec<LockGuard>>> {
    Box::pin(async move {
        let guard = locker.lock_with(key, patient()).await?;
        let again = locker.try_lock(key).await?;
        let mut guards = vec![guard];
        guards.extend(again);
        if depth > 1 {
            let deeper = guards[0].scope(descend(locker, key, depth - 1)).await?;
            guards.extend(deeper);
        }
        Ok(guards)
    })
}

/// Inside a guard's scope, locks of its key at depths 1 to 4 (and a
/// `try_lock` at each) re-enter with no backend acquire; guards that leave
/// the scope keep the lock until the last of them goes.
pub async fn reentry_inside_a_scope_asks_the_server_once(h: &Harness) {
    let key = h.key("scope-depth");
    let counting = Arc::new(CountingBackend::new(h.client().await));
    let locker = Locker::from_arc(counting.clone());
    let other = h.locker().await;

    let outer = must(h, "lock", locker.lock_with(&key, patient()).await);
    assert_eq!(counting.acquires(), 1);
    let inner = must(
        h,
        "re-enter at depth 4",
        outer.scope(descend(&locker, &key, 4)).await,
    );
    assert_eq!(
        inner.len(),
        8,
        "[{}] a try_lock inside the scope did not re-enter",
        h.name
    );
    assert_eq!(
        counting.acquires(),
        1,
        "[{}] re-entering inside the scope asked the server",
        h.name
    );
    assert!(
        inner.iter().all(|g| g.token() == outer.token()),
        "[{}] a re-entered guard has another token",
        h.name
    );

    // The outer guard goes first: the re-entered ones still hold the lock.
    drop(outer);
    let mut inner = inner;
    let last = inner.pop().expect("eight guards");
    drop(inner);
    tokio::time::sleep(Duration::from_millis(50)).await;
    taken(
        h,
        "probe while re-entered",
        &other,
        &key,
        "lock released while a re-entered guard lived",
    )
    .await;
    assert_eq!(
        counting.releases(),
        0,
        "[{}] released before the last guard went",
        h.name
    );
    must(h, "release the last guard", last.release().await);
    assert_eq!(
        counting.releases(),
        1,
        "[{}] the last guard did not release",
        h.name
    );
    let next = must(h, "lock after", other.lock_with(&key, patient()).await);
    must(h, "release", next.release().await);
}

#[distributed_lock(key = "{key}", locker = locker, wait = "10s", guard = lock)]
async fn nested(locker: &Locker, key: &str, depth: u32) -> Result<Vec<Token>, LockError> {
    let mut tokens = vec![*lock.token()];
    if depth > 1 {
        tokens.extend(Box::pin(nested(locker, key, depth - 1)).await?);
    }
    Ok(tokens)
}

/// Nested `#[distributed_lock]` fns on one key (depth 4), and nested
/// `with_lock` calls (depth 3): one backend acquire each, and every level
/// sees the same hold through its guard.
pub async fn reentry_at_depth_through_the_attribute_and_with_lock(h: &Harness) {
    let key = h.key("scope-attribute");
    let counting = Arc::new(CountingBackend::new(h.client().await));
    let locker = Locker::from_arc(counting.clone());

    let tokens = must(h, "nested attribute", nested(&locker, &key, 4).await);
    assert_eq!(tokens.len(), 4);
    assert!(
        tokens.iter().all(|t| *t == tokens[0]),
        "[{}] nested attribute bodies saw different holds",
        h.name
    );
    assert_eq!(
        counting.acquires(),
        1,
        "[{}] nested attribute calls asked the server more than once",
        h.name
    );
    locker.wait_for_releases().await;
    assert_eq!(counting.releases(), 1, "[{}] not released once", h.name);

    let (locker, key) = (&locker, key.as_str());
    let tokens = locker
        .with_lock_with(key, patient(), |one| async move {
            let deeper = locker
                .with_lock_with(key, patient(), |two| async move {
                    let three = locker
                        .with_lock_with(key, patient(), |three| async move { *three.token() })
                        .await?;
                    Ok::<_, LockError>([*two.token(), three])
                })
                .await??;
            Ok::<_, LockError>([*one.token(), deeper[0], deeper[1]])
        })
        .await
        .and_then(|inner| inner);
    let tokens = must(h, "nested with_lock", tokens);
    assert!(
        tokens.iter().all(|t| *t == tokens[0]),
        "[{}] nested with_lock bodies saw different holds",
        h.name
    );
    assert_eq!(
        counting.acquires(),
        2,
        "[{}] nested with_lock asked the server more than once",
        h.name
    );
}

/// Outside any scope, locking a key the same code path holds contends: a
/// `try_lock` answers `None` and a wait runs out, also after a scope of the
/// hold has ended.
pub async fn lock_outside_a_scope_is_not_reentrant(h: &Harness) {
    let key = h.key("no-scope");
    let locker = h.locker().await;
    let held = must(h, "lock", locker.lock_with(&key, patient()).await);
    assert!(!locker.is_held_in_scope(&key));
    taken(
        h,
        "try_lock outside a scope",
        &locker,
        &key,
        "a lock outside any scope re-entered",
    )
    .await;
    let waited = locker.lock_with(&key, briefly()).await;
    assert!(
        matches!(waited, Err(LockError::Timeout { .. })),
        "[{}] a wait outside any scope: {waited:?}",
        h.name
    );
    let inside = held.scope(async { locker.is_held_in_scope(&key) }).await;
    assert!(inside, "[{}] the scope did not hold its key", h.name);
    taken(
        h,
        "try_lock after the scope",
        &locker,
        &key,
        "code after the scope re-entered",
    )
    .await;
    must(h, "release", held.release().await);
    let next = must(
        h,
        "lock after release",
        locker.lock_with(&key, patient()).await,
    );
    must(h, "release", next.release().await);
}

/// One contender: `rounds` times lock, a short section, release (half
/// explicitly, half by drop).
async fn contender(
    locker: &Locker,
    key: &str,
    detector: &OverlapDetector,
    rounds: usize,
) -> dlock_core::Result<()> {
    for round in 0..rounds {
        let guard = locker
            .lock_with(key, LockOptions::new().wait(4 * PATIENCE))
            .await?;
        {
            let _section = detector.enter();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if round % 2 == 0 {
            guard.release().await?;
        } else {
            drop(guard);
        }
    }
    Ok(())
}

/// Futures of one task, through one locker, exclude each other: two joined
/// with `join!`, two raced in a `select!` loop, and 32 in a
/// `FuturesUnordered`.
pub async fn joined_futures_in_one_task_exclude_each_other(h: &Harness) {
    let key = h.key("joined");
    let locker = h.locker().await;
    let detector = Arc::new(OverlapDetector::default());
    let task = tokio::spawn({
        let (locker, detector) = (locker.clone(), detector.clone());
        async move {
            let (locker, key, detector) = (&locker, key.as_str(), &*detector);
            let (a, b) = tokio::join!(
                contender(locker, key, detector, 4),
                contender(locker, key, detector, 4)
            );
            a.and(b).map_err(|e| format!("join!: {e}"))?;

            let mut a = pin!(contender(locker, key, detector, 4));
            let mut b = pin!(contender(locker, key, detector, 4));
            let (mut a_done, mut b_done) = (false, false);
            loop {
                tokio::select! {
                    done = &mut a, if !a_done => {
                        done.map_err(|e| format!("select!: {e}"))?;
                        a_done = true;
                    }
                    done = &mut b, if !b_done => {
                        done.map_err(|e| format!("select!: {e}"))?;
                        b_done = true;
                    }
                    else => break,
                }
            }

            let mut all: FuturesUnordered<_> = (0..32)
                .map(|_| contender(locker, key, detector, 2))
                .collect();
            while let Some(done) = all.next().await {
                done.map_err(|e| format!("FuturesUnordered: {e}"))?;
            }
            Ok::<_, String>(())
        }
    });
    match task.await.expect("the contending task panicked") {
        Ok(()) => {}
        Err(e) => panic!("[{}] a joined contender failed: {e}", h.name),
    }
    assert_eq!(
        detector.entries(),
        8 + 8 + 64,
        "[{}] every round ran",
        h.name
    );
    assert_eq!(
        detector.overlaps(),
        0,
        "[{}] futures joined in one task were inside the lock together",
        h.name
    );
}

/// What runs outside a scope contends for its key, though it runs in the
/// same task or thread, or holds a guard taken in that task: a future
/// joined beside the scope, a task spawned from it, `spawn_blocking` with
/// `block_on`, the acquiring task of a guard moved away. The scope goes
/// with the guard: the task the guard was moved to re-enters inside the
/// guard's scope, and an owned `DistMutex` guard moved there refuses a
/// re-lock in its scope instead of waiting for itself.
pub async fn work_outside_the_scope_contends(h: &Harness) {
    let key = h.key("outside");
    let locker = h.locker().await;
    let held = must(h, "lock", locker.lock_with(&key, patient()).await);

    let (inside, beside) = tokio::join!(
        held.scope(async { locker.try_lock(&key).await.map(|g| g.is_some()) }),
        async { locker.try_lock(&key).await.map(|g| g.is_some()) },
    );
    assert!(
        matches!(inside, Ok(true)),
        "[{}] the scope did not re-enter: {inside:?}",
        h.name
    );
    assert!(
        matches!(beside, Ok(false)),
        "[{}] a future joined beside the scope re-entered: {beside:?}",
        h.name
    );

    let (spawned, blocking) = held
        .scope(async {
            let spawned = tokio::spawn({
                let (locker, key) = (locker.clone(), key.clone());
                async move { locker.try_lock(&key).await.map(|g| g.is_some()) }
            });
            let blocking = tokio::task::spawn_blocking({
                let (locker, key) = (locker.clone(), key.clone());
                let runtime = tokio::runtime::Handle::current();
                move || runtime.block_on(async { locker.try_lock(&key).await.map(|g| g.is_some()) })
            });
            (spawned.await, blocking.await)
        })
        .await;
    assert!(
        matches!(spawned, Ok(Ok(false))),
        "[{}] a task spawned inside the scope re-entered: {spawned:?}",
        h.name
    );
    assert!(
        matches!(blocking, Ok(Ok(false))),
        "[{}] spawn_blocking + block_on inside the scope re-entered: {blocking:?}",
        h.name
    );

    // The guard moves to another task, which works under it until told.
    let (go, stop) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn({
        let (locker, key) = (locker.clone(), key.clone());
        async move {
            let reentered = held
                .scope(async { locker.try_lock(&key).await.map(|g| g.is_some()) })
                .await;
            let _ = stop.await;
            held.release().await.map(|()| reentered)
        }
    });
    taken(
        h,
        "try_lock by the acquirer",
        &locker,
        &key,
        "the acquiring task re-entered a guard it had moved away",
    )
    .await;
    let _ = go.send(());
    let reentered = worker.await.expect("worker panicked");
    assert!(
        matches!(reentered, Ok(Ok(true))),
        "[{}] the task holding the guard could not re-enter in its scope: {reentered:?}",
        h.name
    );

    let m = Arc::new(DistMutex::with_options(
        &locker,
        key.clone(),
        0_u32,
        patient(),
    ));
    let owned = must(h, "lock_owned", m.clone().lock_owned().await);
    let moved = tokio::spawn({
        let m = m.clone();
        async move {
            let relock = OwnedDistMutexGuard::scope(&owned, m.lock());
            let relocked = tokio::time::timeout(PATIENCE, relock)
                .await
                .map(|r| r.map(drop));
            drop(owned);
            relocked
        }
    });
    let relocked = moved.await.expect("owned-guard task panicked");
    assert!(
        matches!(relocked, Ok(Err(LockError::WouldDeadlock { .. }))),
        "[{}] re-locking a DistMutex in the scope of its moved owned guard: {relocked:?}",
        h.name
    );
    let after = must(h, "DistMutex::lock after", m.lock().await);
    drop(after);
}

/// Locking a `DistMutex` inside the scope of its own guard, or of a plain
/// hold of its key, is refused with `WouldDeadlock` at once; outside a
/// scope, a second lock waits like any other owner's.
pub async fn dist_mutex_in_its_own_scope_would_deadlock(h: &Harness) {
    let key = h.key("mutex-scope");
    let locker = h.locker().await;
    let m = DistMutex::with_options(&locker, key.clone(), 0_u32, patient());
    let g = must(h, "DistMutex::lock", m.lock().await);
    let (locked, tried, plain) = DistMutexGuard::scope(&g, async {
        let locked = tokio::time::timeout(PATIENCE, m.lock()).await;
        let tried = tokio::time::timeout(PATIENCE, m.try_lock()).await;
        let plain = locker.try_lock(&key).await.map(|g| g.is_some());
        (
            locked.map(|r| r.map(drop)),
            tried.map(|r| r.map(|g| g.is_some())),
            plain,
        )
    })
    .await;
    assert!(
        matches!(locked, Ok(Err(LockError::WouldDeadlock { .. }))),
        "[{}] DistMutex::lock in its guard's scope: {locked:?}",
        h.name
    );
    assert!(
        matches!(tried, Ok(Err(LockError::WouldDeadlock { .. }))),
        "[{}] DistMutex::try_lock in its guard's scope: {tried:?}",
        h.name
    );
    assert!(
        matches!(plain, Ok(true)),
        "[{}] a plain lock of the key in the mutex guard's scope: {plain:?}",
        h.name
    );

    let busy = must(h, "try_lock outside the scope", m.try_lock().await);
    assert!(busy.is_none(), "[{}] a second DistMutex guard", h.name);
    let brief = DistMutex::with_options(&locker, key.clone(), 0_u32, briefly());
    let waited = brief.lock().await.map(drop);
    assert!(
        matches!(waited, Err(LockError::Timeout { .. })),
        "[{}] DistMutex::lock outside a scope while held: {waited:?}",
        h.name
    );
    drop(g);

    let inside = locker
        .with_lock_with(&key, patient(), |_guard| async {
            tokio::time::timeout(PATIENCE, m.lock())
                .await
                .map(|r| r.map(drop))
        })
        .await;
    assert!(
        matches!(inside, Ok(Ok(Err(LockError::WouldDeadlock { .. })))),
        "[{}] DistMutex::lock inside with_lock of its key: {inside:?}",
        h.name
    );
    let again = must(h, "DistMutex::lock after", m.lock().await);
    drop(again);
}
