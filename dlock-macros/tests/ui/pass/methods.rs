//! Methods: `&self`, `&mut self`, `self: Arc<Self>`, trait impls, a locker
//! behind an `Arc`, and a `crate = "..."` path through a re-export.

// The expansion must not add warnings to the user's code.
#![deny(warnings)]

use std::sync::Arc;

use dlock_core::{distributed_lock, BackendExt, LockError, Locker, MemoryBackend};

mod reexport {
    pub use dlock_core as dlock;
}

struct Service {
    locker: Locker,
    shared: Arc<Locker>,
    id: u32,
}

impl Service {
    #[distributed_lock(key = "svc:{self.id}", locker = self.locker)]
    async fn read(&self) -> Result<u32, LockError> {
        Ok(self.id)
    }

    #[distributed_lock(key = "svc:{self.id}", locker = self.shared)]
    async fn write(&mut self, by: u32) -> Result<u32, LockError> {
        self.id += by;
        Ok(self.id)
    }

    #[distributed_lock(key = "svc:{self.id}", locker = self.locker.clone())]
    async fn into_id(self: Arc<Self>) -> Result<u32, LockError> {
        Ok(self.id)
    }

    #[distributed_lock(key = "svc:{self.id}", locker = self.locker, crate = "reexport::dlock")]
    async fn through_reexport(&self) -> Result<(), LockError> {
        Ok(())
    }
}

trait Job {
    async fn run(&self, n: u32) -> Result<u32, LockError>;
}

impl Job for Service {
    #[distributed_lock(key = "job:{n}", locker = self.locker)]
    async fn run(&self, n: u32) -> Result<u32, LockError> {
        Ok(n)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let locker = MemoryBackend::new().into_locker();
    let mut svc = Service {
        locker: locker.clone(),
        shared: Arc::new(locker),
        id: 1,
    };
    assert_eq!(svc.read().await.unwrap(), 1);
    assert_eq!(svc.write(2).await.unwrap(), 3);
    svc.through_reexport().await.unwrap();
    assert_eq!(svc.run(5).await.unwrap(), 5);
    assert_eq!(Arc::new(svc).into_id().await.unwrap(), 3);
}
