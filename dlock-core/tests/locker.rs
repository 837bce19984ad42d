//! Locker and guard behaviour that is the same for every backend, pinned on
//! `MemoryBackend`: runtime handling, the default locker, lost holds, wait
//! order and options.

use std::{
    future::Future,
    pin::pin,
    sync::{Arc, Mutex},
    task::{Context, Poll, Waker},
    time::Duration,
};

use dlock_core::{
    default_locker, set_default_locker, BackendExt, LockError, LockOptions, Locker, LostReason,
    MemoryBackend,
};
use tokio::time::Instant;

#[test]
fn locking_outside_a_tokio_runtime_is_an_error_not_a_panic() {
    let locker = MemoryBackend::new().into_locker();
    let mut cx = Context::from_waker(Waker::noop());
    let attempt = pin!(locker.try_lock("k"));
    match attempt.poll(&mut cx) {
        Poll::Ready(Err(LockError::NoRuntime)) => {}
        other => panic!("expected NoRuntime at once, got {other:?}"),
    }
}

#[test]
fn dropping_a_guard_after_its_runtime_is_gone_leaves_the_lease_to_expire() {
    let server = MemoryBackend::new();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let guard = runtime
        .block_on(
            server
                .clone()
                .into_locker()
                .lock_with("k", LockOptions::new().lease(Duration::from_millis(200))),
        )
        .unwrap();
    drop(runtime);
    drop(guard); // must not panic; nothing can release it now
    assert!(!server.is_idle(), "the lock is still held on the server");
    std::thread::sleep(Duration::from_millis(250));
    assert!(server.is_idle(), "the lease did not expire");
}

#[tokio::test]
async fn default_locker_is_an_error_until_set() {
    assert!(matches!(default_locker(), Err(LockError::NoDefaultLocker)));
    let server = MemoryBackend::new();
    set_default_locker(server.clone().into_locker());
    let guard = default_locker().unwrap().lock("k").await.unwrap();
    assert!(!server.is_idle());
    guard.release().await.unwrap();
    assert!(server.is_idle());
}

#[tokio::test]
async fn re_entering_a_lost_hold_is_an_error() {
    let locker = MemoryBackend::new().into_locker();
    let guard = locker
        .lock_with("k", LockOptions::new().lease(Duration::from_millis(50)))
        .await
        .unwrap();
    assert_eq!(guard.lost().await, LostReason::LeaseExpired);
    match locker.lock("k").await {
        Err(LockError::Lost { key, reason }) => {
            assert_eq!(key, "k");
            assert_eq!(reason, LostReason::LeaseExpired);
        }
        other => panic!("re-entered a lost hold: {other:?}"),
    }
}

#[tokio::test]
async fn waiting_forever_is_woken_by_the_release() {
    let server = MemoryBackend::new();
    let (a, b) = (server.clone().into_locker(), server.into_locker());
    let held = a.lock("k").await.unwrap();
    let waiter = tokio::spawn(async move {
        let start = Instant::now();
        let g = b.lock_with("k", LockOptions::new().wait_forever()).await;
        (start.elapsed(), g.map(|g| g.fencing_token()))
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished());
    held.release().await.unwrap();
    let (waited, fence) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(waited >= Duration::from_millis(100));
    assert!(fence.unwrap().is_some());
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order() {
    let server = MemoryBackend::new();
    let holder = server.clone().into_locker();
    let held = holder.lock("k").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..5 {
        let (locker, order) = (server.clone().into_locker(), order.clone());
        waiters.push(tokio::spawn(async move {
            let g = locker.lock("k").await.unwrap();
            order.lock().unwrap().push(i);
            g.release().await.unwrap();
        }));
        // Let each waiter queue before the next one arrives.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held.release().await.unwrap();
    for w in waiters {
        tokio::time::timeout(Duration::from_secs(5), w)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

#[tokio::test]
async fn a_lease_shorter_than_the_grant_is_never_handed_out() {
    // 1 ms less the drift margin is already over when the answer arrives.
    let locker = MemoryBackend::new().into_locker();
    let server_is_free_after = locker.backend().clone();
    match locker
        .lock_with("k", LockOptions::new().lease(Duration::from_millis(1)))
        .await
    {
        Err(LockError::Lost {
            reason: LostReason::LeaseExpired,
            ..
        }) => {}
        other => panic!("a guard with an expired lease was handed out: {other:?}"),
    }
    drop(server_is_free_after);
}

#[tokio::test]
async fn builder_defaults_apply_and_calls_override_them() {
    let server = MemoryBackend::new();
    let locker = Locker::builder(server.clone())
        .wait(Duration::from_millis(100))
        .lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let other = server.into_locker();
    let held = other.lock("k").await.unwrap();
    let start = Instant::now();
    assert!(matches!(
        locker.lock("k").await,
        Err(LockError::Timeout { .. })
    ));
    assert!(start.elapsed() < Duration::from_secs(2));
    drop(held);
    let g = locker
        .lock_with("k", LockOptions::new().wait(Duration::from_secs(5)))
        .await
        .unwrap();
    // The default fixed lease applies: the guard ends on its own.
    tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .unwrap();
}
