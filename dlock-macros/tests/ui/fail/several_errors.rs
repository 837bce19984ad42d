use dlock_core::distributed_lock;

// Every problem is reported at once, and the fn is still emitted: `main`
// calling it gives no "cannot find function" error.
#[distributed_lock(key = "order:{nope}")]
fn pay(id: u64) -> u32 {
    7
}

fn main() {
    let _ = pay(1);
}
