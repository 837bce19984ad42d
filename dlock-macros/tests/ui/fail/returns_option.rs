use dlock_core::distributed_lock;

#[distributed_lock(key = "order:{id}")]
async fn pay(id: u64) -> Option<u32> {
    Some(7)
}

fn main() {
    let _ = pay(1);
}
