use dlock_core::{distributed_lock, LockError};

#[distributed_lock(wait = "5s")]
async fn pay(id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1);
}
