use dlock_core::{distributed_lock, LockError};

// Every argument mistake is reported at once.
#[distributed_lock(key = "order:{id}", tiemout = "5s", key = "again", lease = "soon")]
async fn pay(id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay(1);
}
