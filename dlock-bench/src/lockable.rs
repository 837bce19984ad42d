//! What a benchmark locks through: dlock, or a peer's recipe.

use futures_util::future::BoxFuture;

/// Something that locks a key: dlock, or a peer's recipe. `lock` returns the
/// unlock, to await when done.
pub(crate) trait Lockable: Send + Sync {
    /// What the rows call it (`dlock` for ours).
    fn label(&self) -> &str;

    /// Locks `key` for `task` (peers whose ownership is per lease keep one
    /// per task), and returns the unlock.
    fn lock<'a>(&'a self, task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>>;

    /// On Redis, the commands it sends itself, whose server time is its
    /// "Redis busy" (commands its scripts run count inside them).
    fn redis_commands(&self) -> &'static [&'static str] {
        &["evalsha"]
    }

    /// Completes when nothing it started is still on its way to the server
    /// (dlock's background releases): run before the next scenario, so
    /// that no side is counted or slowed by another's leftovers.
    fn settle(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// The unlock of a held lock.
pub(crate) struct Unlock<'a>(pub(crate) BoxFuture<'a, ()>);

impl Unlock<'_> {
    /// Unlocks.
    pub(crate) async fn unlock(self) {
        self.0.await;
    }
}
