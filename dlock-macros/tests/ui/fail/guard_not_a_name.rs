use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "order:{id}", guard = self.lock)]
async fn pay(id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "order:{id}", guard)]
async fn refund(id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1);
    let _ = refund(1);
}
