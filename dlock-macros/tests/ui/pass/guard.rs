//! `guard = name`: the body reads its lock's guard (fencing token, lost
//! signal), alone and with `abort_on_lost`; nested calls see the same hold.

#![deny(warnings)]

use dlock_core::{distributed_lock, BackendExt, LockError, LockGuard, Locker, MemoryBackend};

struct Store {
    fence: Option<u64>,
}

#[distributed_lock(key = "stock:{item}", locker = locker, guard = lock)]
async fn write(locker: &Locker, item: u32, store: &mut Store) -> Result<Option<u64>, LockError> {
    let guard: &LockGuard = lock;
    assert!(!guard.is_lost());
    store.fence = guard.fencing_token();
    Ok(nested(locker, item).await?.max(store.fence))
}

#[distributed_lock(key = "stock:{item}", locker = locker, guard = inner, abort_on_lost)]
async fn nested(locker: &Locker, item: u32) -> Result<Option<u64>, LockError> {
    tokio::select! {
        reason = inner.lost() => Err(LockError::Lost { key: inner.key().to_owned(), reason }),
        fence = async { inner.fencing_token() } => Ok(fence),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let locker = MemoryBackend::new().into_locker();
    let mut store = Store { fence: None };
    let fence = write(&locker, 7, &mut store).await.unwrap();
    assert!(fence.is_some());
    assert_eq!(fence, store.fence);
}
