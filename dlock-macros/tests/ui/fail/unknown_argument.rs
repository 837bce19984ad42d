use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "order:{id}", tiemout = "5s")]
async fn pay(id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1);
}
