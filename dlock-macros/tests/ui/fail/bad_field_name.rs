use dlock_core::{distributed_lock, LockError};

struct Req {
    a: u32,
}

#[distributed_lock(key = "req:{req.a²}")]
async fn handle(req: Req) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "pair:{pair.4294967296}")]
async fn pair(pair: (u32, u32)) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = handle(Req { a: 1 });
    let _ = pair((1, 2));
}
