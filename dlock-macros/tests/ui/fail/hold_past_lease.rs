use dlock_core::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "report", locker = locker, lease = "1m", hold_at_least = "5m")]
async fn report(locker: &Locker) -> Result<(), LockError> {
    Ok(())
}

fn main() {}
