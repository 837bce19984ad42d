//! `DistMutex<T>` behaviour beyond the conformance suite: local queueing,
//! wait limits that include the local queue, cancellation.

use std::{sync::Arc, time::Duration};

use dlock_core::{DistMutex, LockError, LockOptions, Locker, MemoryBackend, OwnedDistMutexGuard};
use dlock_testkit::CountingBackend;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_contenders_queue_before_the_backend() {
    let counting = Arc::new(CountingBackend::new(Arc::new(MemoryBackend::new())));
    let locker = Locker::from_arc(counting.clone());
    let m = Arc::new(DistMutex::new(&locker, "stock", 0_u32));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let m = m.clone();
            tokio::spawn(async move {
                for _ in 0..10 {
                    let mut g = m.lock().await.unwrap();
                    *g += 1;
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*m.lock().await.unwrap(), 160);
    assert_eq!(
        counting.max_concurrent_acquires(),
        1,
        "more than one local task talked to the backend at once"
    );
}

#[tokio::test]
async fn the_wait_limit_covers_the_local_queue() {
    let locker = Locker::new(MemoryBackend::new());
    let wait = Duration::from_millis(150);
    let m = Arc::new(DistMutex::with_options(
        &locker,
        "k",
        (),
        LockOptions::new().wait(wait),
    ));
    let held = m.clone().lock_owned().await.unwrap();
    let other = tokio::spawn({
        let m = m.clone();
        async move {
            let start = Instant::now();
            let r = m.lock().await.map(drop);
            (start.elapsed(), r)
        }
    });
    let (elapsed, result) = other.await.unwrap();
    assert!(
        matches!(result, Err(LockError::Timeout { .. })),
        "{result:?}"
    );
    assert!(
        elapsed >= wait && elapsed < wait + Duration::from_secs(2),
        "{elapsed:?}"
    );
    // Inside the guard's scope, a second guard is refused, not awaited.
    let relock = OwnedDistMutexGuard::scope(&held, m.clone().try_lock_owned()).await;
    assert!(matches!(relock, Err(LockError::WouldDeadlock { .. })));
    // Outside it, a second guard is busy, as with `tokio::sync::Mutex`.
    assert!(m.clone().try_lock_owned().await.unwrap().is_none());
    OwnedDistMutexGuard::release(held).await.unwrap();
    assert!(m.try_lock().await.unwrap().is_some());
}

#[tokio::test]
async fn a_cancelled_local_waiter_gives_its_turn_back() {
    let locker = Locker::new(MemoryBackend::new());
    let m = Arc::new(DistMutex::new(&locker, "k", 0));
    let held = m.clone().lock_owned().await.unwrap();
    for _ in 0..20 {
        let m = m.clone();
        let attempt = tokio::spawn(async move {
            tokio::time::timeout(Duration::from_millis(5), m.lock())
                .await
                .map(|r| r.map(drop))
        });
        let outcome = attempt.await.expect("the attempt panicked");
        assert!(
            outcome.is_err(),
            "a lock of a held mutex ended: {outcome:?}"
        );
    }
    OwnedDistMutexGuard::release(held).await.unwrap();
    let g = tokio::time::timeout(Duration::from_secs(2), m.lock()).await;
    assert!(
        matches!(g, Ok(Ok(_))),
        "a cancelled waiter kept the local turn"
    );
}

#[tokio::test]
async fn a_key_held_in_scope_through_the_locker_refuses_a_dist_mutex() {
    let locker = Locker::new(MemoryBackend::new());
    let m = DistMutex::new(&locker, "shared-key", 1);
    let plain = locker.lock("shared-key").await.unwrap();
    assert!(matches!(
        plain.scope(m.lock()).await,
        Err(LockError::WouldDeadlock { .. })
    ));
    drop(plain);
    let mut g = m.lock().await.unwrap();
    *g += 1;
    assert_eq!(*g, 2);
}

#[tokio::test]
async fn an_invalid_key_is_reported_at_lock_time() {
    let locker = Locker::new(MemoryBackend::new());
    let m = DistMutex::new(&locker, "", 0);
    assert!(matches!(m.lock().await, Err(LockError::InvalidKey { .. })));
    // The failed attempt gave the local turn back.
    assert!(matches!(
        m.try_lock().await,
        Err(LockError::InvalidKey { .. })
    ));
}

#[tokio::test]
async fn debug_never_blocks_and_hides_a_locked_value() {
    let locker = Locker::new(MemoryBackend::new());
    let m = DistMutex::new(&locker, "k", 41);
    assert!(format!("{m:?}").contains("41"));
    let g = m.lock().await.unwrap();
    assert!(format!("{m:?}").contains("<locked>"));
    drop(g);
}

/// Inside the scope of its own hold, a `DistRwLock` refuses every read and
/// write at once (`WouldDeadlock`), as `DistMutex` does, instead of
/// waiting for itself: each would wait on the scope's own local guard.
#[tokio::test]
async fn a_read_write_lock_refuses_to_wait_for_its_own_scope() {
    let locker = Locker::new(MemoryBackend::new());
    let rw = dlock_core::DistRwLock::new(&locker, "config", 0_u32);
    let refused = |what: &str, result: Result<(), LockError>| {
        assert!(
            matches!(result, Err(LockError::WouldDeadlock { .. })),
            "{what} in its own scope: {result:?}"
        );
    };
    let within = Duration::from_secs(2);
    let w = rw.write().await.unwrap();
    let lock = dlock_core::DistRwLockWriteGuard::lock_guard(&w);
    let (read, write) = lock
        .scope(async {
            let read = tokio::time::timeout(within, rw.read()).await;
            let write = tokio::time::timeout(within, rw.try_write()).await;
            (read, write)
        })
        .await;
    refused("a read", read.expect("no answer").map(drop));
    refused("a try_write", write.expect("no answer").map(drop));
    drop(w);
    let r = rw.read().await.unwrap();
    let lock = dlock_core::DistRwLockReadGuard::lock_guard(&r);
    let write = lock
        .scope(async { tokio::time::timeout(within, rw.write()).await })
        .await;
    refused("a write under a read", write.expect("no answer").map(drop));
    drop(r);
    // The key's plain lock is another object: its scope may read and write.
    let plain = locker.lock("config").await.unwrap();
    let shared = plain
        .scope(async {
            let read = rw.read().await.map(drop);
            let write = rw.write().await.map(drop);
            (read, write)
        })
        .await;
    assert!(
        matches!(shared, (Ok(()), Ok(()))),
        "a read or write under the key's plain lock: {shared:?}"
    );
}
