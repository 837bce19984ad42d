//! Who owns a lock for reentrancy: the current Tokio task.

use std::thread::{self, ThreadId};

use tokio::task;

/// The owner of a reentrant hold.
///
/// Inside a spawned task, that task. Outside one (the future given to
/// `Runtime::block_on`, including the body of `#[tokio::main]`), the thread
/// that polls it, which for `block_on` is always the same thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Owner {
    Task(task::Id),
    Thread(ThreadId),
}

impl Owner {
    pub(crate) fn current() -> Owner {
        match task::try_id() {
            Some(id) => Owner::Task(id),
            None => Owner::Thread(thread::current().id()),
        }
    }
}
