use dlock_core::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "ledger", locker = locker, lock_delay = "2m", fair = "no")]
async fn post(locker: &Locker) -> Result<(), LockError> {
    Ok(())
}

fn main() {}
