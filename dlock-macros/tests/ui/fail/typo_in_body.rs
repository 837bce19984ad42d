// A syntax error deep inside a valid async fn is reported where it is,
// with the parser's own message, not as a misplaced attribute.
use dlock_core::{distributed_lock, LockError};

#[distributed_lock(key = "order:{id}")]
async fn pay(id: u64) -> Result<(), LockError> {
    if id > 0 {
        let total = id * 2 +;
        let _ = total;
    }
    Ok(())
}

fn main() {
    let _ = pay(1);
}
