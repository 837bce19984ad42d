use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "")]
async fn pay() -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = pay();
}
