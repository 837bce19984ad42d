use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "order:{id}", lease = "721h")]
async fn pay(id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1);
}
