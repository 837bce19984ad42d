use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "order:{order}")]
async fn pay(order_id: u64, amount: u32) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1, 2);
}
