// The body sees its guard by reference: it cannot move the guard away (to
// another task, or to release it early) while the body runs under it.
use dlock_core::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "order:{id}", locker = locker, guard = lock)]
async fn pay(locker: &Locker, id: u64) -> Result<(), LockError> {
    lock.release().await
}

fn main() {
    let _ = pay;
}
