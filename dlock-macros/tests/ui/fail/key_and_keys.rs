use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "a:{x}", keys = ["a:{x}", "b:{x}"])]
async fn both(x: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(keys = "a:{x}")]
async fn not_a_list(x: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(keys = [])]
async fn empty(x: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(keys = ["a:{x}", "b:{y}"])]
async fn unknown_placeholder(x: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = (both(1), not_a_list(1), empty(1), unknown_placeholder(1));
}
