use dlock_core::{distributed_lock, LockError};

struct OrderId(u64);

#[distributed_lock(key = "order:{id}")]
async fn pay(id: OrderId) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(OrderId(1));
}
