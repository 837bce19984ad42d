use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = order_id)]
async fn pay(order_id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1);
}
