//! Free functions: default locker, every argument, literal braces, recursion.

// The expansion must not add warnings to the user's code.
#![deny(warnings)]

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use dlock_core::{distributed_lock, set_default_locker, BackendExt, LockError, Locker, MemoryBackend};

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Invalid,
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}

type AppResult<T> = Result<T, AppError>;

#[distributed_lock(key = "order:{order_id}")]
async fn pay(order_id: u64, amount: u32) -> Result<u32, AppError> {
    if amount == 0 {
        return Err(AppError::Invalid);
    }
    let doubled: u32 = "2".parse::<u32>().map_err(|_| AppError::Invalid)? * amount;
    Ok(doubled + order_id as u32)
}

#[distributed_lock(key = "{{static}}", wait = "none", lease = "30s")]
async fn once() -> AppResult<()> {
    Ok(())
}

#[distributed_lock(key = "job:{name}", locker = locker, wait = "250ms", abort_on_lost)]
async fn job(locker: &Locker, name: String) -> Result<String, LockError> {
    tokio::time::sleep(Duration::from_millis(1)).await;
    Ok(name)
}

#[distributed_lock(key = "forever:{n}", locker = locker, wait = "forever")]
async fn countdown(locker: &Locker, n: u32) -> Result<u32, LockError> {
    if n == 0 {
        return Ok(0);
    }
    Ok(1 + Box::pin(countdown(locker, n - 1)).await?)
}

#[distributed_lock(key = "generic:{item}", locker = &locker)]
async fn generic<T: std::fmt::Display + Send>(locker: Locker, item: T) -> Result<String, LockError> {
    Ok(item.to_string())
}

#[distributed_lock(key = "ledger", locker = locker, lease = "200ms", lock_delay = "2s", fair = false, guard = lock)]
async fn ledger(locker: &Locker, other: &Locker, kept: &AtomicBool) -> Result<(), LockError> {
    // Past the lease, with no release: the key stays taken for the delay.
    lock.lost().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    kept.store(other.try_lock("ledger").await?.is_none(), Ordering::SeqCst);
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let backend = MemoryBackend::new();
    let locker = backend.clone().into_locker();
    set_default_locker(locker.clone());
    assert_eq!(pay(1, 3).await.unwrap(), 7);
    assert!(matches!(pay(1, 0).await, Err(AppError::Invalid)));
    once().await.unwrap();
    assert_eq!(job(&locker, "x".into()).await.unwrap(), "x");
    assert_eq!(countdown(&locker, 3).await.unwrap(), 3);
    assert_eq!(generic(locker.clone(), 9).await.unwrap(), "9");
    let other = Locker::new(backend);
    // The body ran, and saw the key taken; the call says the lock was lost.
    let kept = AtomicBool::new(false);
    assert!(matches!(ledger(&locker, &other, &kept).await, Err(LockError::Lost { .. })));
    assert!(kept.load(Ordering::SeqCst), "the key was free past the lease, within the delay");
    if let Err(AppError::Lock(e)) = pay(2, 1).await {
        panic!("{e}");
    }
}
