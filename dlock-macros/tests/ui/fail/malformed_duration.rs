use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "order:{id}", wait = "five seconds")]
async fn pay(id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1);
}
