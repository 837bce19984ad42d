use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "svc:{self.id}")]
async fn run() -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = run();
}
