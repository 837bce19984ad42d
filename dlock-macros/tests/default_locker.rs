//! `#[distributed_lock]` without `locker = ...` uses the default locker; in
//! a test binary of its own, since the default is process-wide.

use dlock_core::{distributed_lock, set_default_locker, BackendExt, LockError, MemoryBackend};

#[distributed_lock(key = "default:{n}")]
async fn job(n: u32) -> Result<u32, LockError> {
    Ok(n + 1)
}

#[tokio::test]
async fn an_unset_default_is_an_error_then_the_default_is_used() {
    assert!(matches!(job(1).await, Err(LockError::NoDefaultLocker)));
    let server = MemoryBackend::new();
    set_default_locker(server.clone().into_locker());
    assert_eq!(job(1).await.unwrap(), 2);
    // Released when the fn returned (the release is scheduled, so wait a moment).
    let other = server.into_locker();
    let wait = dlock_core::LockOptions::new().wait(std::time::Duration::from_secs(5));
    assert!(other.lock_with("default:1", wait).await.is_ok());
}
