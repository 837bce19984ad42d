//! `Locker`: the handle users lock through. It holds the shared state of a
//! backend connection (see `shared.rs`), re-enters holds of the current
//! scope (see `scope.rs`), and turns a backend's answer into a guard.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use tokio::time::Instant;

use crate::{
    backend::{Backend, DynBackend, Mode},
    error::{LockError, Result},
    key::LockKey,
    locker::guard::LockGuard,
    locker::options::LockOptions,
    locker::scope::Scope,
    locker::shared::Shared,
};

mod acquire;
pub(crate) mod builder;
pub(crate) mod connection;
pub(crate) mod default_locker;
pub(crate) mod guard;
pub(crate) mod lease;
pub(crate) mod list;
mod operators;
pub(crate) mod options;
pub(crate) mod release;
pub(crate) mod requests;
pub(crate) mod scope;
pub(crate) mod shared;
pub(crate) mod watchdog;

/// The default watchdog lease: how long a crashed holder keeps a lock.
pub const DEFAULT_WATCHDOG_LEASE: Duration = Duration::from_secs(30);

/// A handle for taking locks through one backend.
///
/// A `Locker` is cheap to clone; clones share the backend connection and
/// the watchdog. Build one per backend at startup and pass clones around
/// (or make it the default with
/// [`set_default_locker`](crate::set_default_locker)).
///
/// - [`lock`](Locker::lock) waits for the lock, up to the locker's wait limit
///   (none by default).
/// - [`try_lock`](Locker::try_lock) makes one attempt and returns `Ok(None)`
///   if the lock is held.
/// - [`lock_with`](Locker::lock_with) takes per-call [`LockOptions`].
/// - [`with_lock`](Locker::with_lock) runs a future under the lock, inside
///   its scope.
///
/// # Reentrancy
///
/// Reentrancy follows the lock's *scope*, not the task or thread: a held
/// lock's scope is the future that runs under it, that is the body of a
/// `#[distributed_lock]` fn, a future passed to [`with_lock`](Locker::with_lock),
/// or one wrapped with [`LockGuard::scope`]. Inside a scope, at any depth,
/// locking the same key through the same `Locker` (or a clone) re-enters at
/// once, without asking the server; the re-entered guard shares the hold's
/// token and fencing token, and the lock goes when the last guard of the
/// hold goes.
///
/// Everything outside the scope contends like any other owner:
///
/// - `Locker::lock` outside any scope is **not** reentrant, like
///   `tokio::sync::Mutex`: locking a key you hold, in the same code path,
///   waits for yourself until the wait limit. Wrap the work in a scope
///   instead.
/// - Futures joined beside the scope (`join!`, `select!`,
///   `FuturesUnordered`, `join_all`) exclude it and each other, though they
///   run in the same task.
/// - A spawned task is outside the scope it was spawned from (task-locals
///   are not inherited), and so is a `spawn_blocking` closure and anything
///   it runs with `Handle::block_on`.
/// - Code after the scoped future has finished is outside it.
/// - Two lockers built separately over one backend are two owners, like two
///   processes. Build one `Locker` and clone it.
///
/// A guard is the lock: whoever holds one (a task it was moved to, for
/// example) works under the lock. The scope borrows its guard, so a guard
/// cannot leave the task while its scope runs.
///
/// ## What changed
///
/// Before 0.1, reentrancy was per Tokio task (or thread, outside a task):
/// joined futures of one task re-entered each other's locks, and a task
/// re-entered a lock whose guard it had moved to another task. Both now
/// contend. Code that locked a key twice in one task without an attribute
/// or scope around the first now waits for itself: put the inner work in
/// [`LockGuard::scope`] or use [`with_lock`](Locker::with_lock).
///
/// # Runtime
///
/// Locks are taken within a Tokio runtime with its timer enabled
/// (`#[tokio::main]` and `enable_all` do so). Outside a runtime, locking
/// returns [`LockError::NoRuntime`]; on a runtime without a timer, waiting
/// with a limit and the watchdog panic, as `tokio::time` does.
///
/// # Examples
///
/// ```
/// use dlock_core::{Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
///
/// let outer = locker.lock("report:daily").await?;
/// outer
///     .scope(async {
///         // Inside the scope of `outer`: re-entered at once.
///         let inner = locker.lock("report:daily").await?;
///         assert_eq!(outer.fencing_token(), inner.fencing_token());
///         Ok::<_, dlock_core::LockError>(())
///     })
///     .await?;
/// drop(outer); // released here
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Locker {
    shared: Arc<Shared>,
}

impl Locker {
    pub(crate) fn from_shared(shared: Shared) -> Locker {
        Locker {
            shared: Arc::new(shared),
        }
    }
    /// Whether the current scope holds a read or write share of `key`'s
    /// read-write lock through this locker.
    pub(crate) fn holds_share_in_scope(&self, key: &str) -> bool {
        LockKey::new(key)
            .ok()
            .is_some_and(|key| Scope::holds_share(&self.shared, &key))
    }

    /// `key` as this locker's traces show it (see
    /// [`LockerBuilder::trace_keys`](crate::LockerBuilder::trace_keys)).
    pub(crate) fn traced<'a>(&self, key: &'a LockKey) -> crate::key::TracedKey<'a> {
        self.shared.traced(key)
    }

    /// The backend this locker talks to.
    pub fn backend(&self) -> &Arc<dyn DynBackend> {
        &self.shared.backend
    }

    /// The options a call without its own options uses.
    pub fn defaults(&self) -> LockOptions {
        self.shared.defaults
    }

    /// The lease the watchdog keeps renewing, and so how long a crashed
    /// holder keeps a lock taken without an explicit lease.
    pub fn watchdog_lease(&self) -> Duration {
        self.shared.watchdog.lease()
    }

    /// Whether the current scope holds `key` through this locker, so that
    /// locking it here would re-enter (see [Reentrancy](Locker#reentrancy)).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let guard = locker.lock("k").await?;
    /// assert!(!locker.is_held_in_scope("k")); // held, but not in a scope
    /// guard.scope(async { assert!(locker.is_held_in_scope("k")) }).await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_held_in_scope(&self, key: &str) -> bool {
        LockKey::new(key)
            .ok()
            .and_then(|key| Scope::find(&self.shared, &key))
            .is_some()
    }

    /// Acquires `key`, waiting up to the locker's default wait limit.
    ///
    /// Inside the scope of a hold of `key` through this locker, re-enters
    /// it at once (see [Reentrancy](Locker#reentrancy)); anywhere else,
    /// waits for the lock like any other owner.
    ///
    /// # Errors
    ///
    /// - [`LockError::Timeout`] when the wait limit passes (another owner
    ///   holds the key);
    /// - [`LockError::InvalidKey`], [`LockError::InvalidOptions`];
    /// - [`LockError::Lost`] when re-entering a hold that was lost;
    /// - [`LockError::Backend`] when the server fails, also when the wait
    ///   limit passes while the servers do not answer: then the backend's
    ///   wait is dropped half a second past the limit, the backend is
    ///   asked once ([`Backend::check_servers`], at most 1 s more), and
    ///   their error is the answer;
    /// - [`LockError::NoRuntime`] outside a Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future at any point leaves nothing on the
    /// server that blocks other owners, and no lock held.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let guard = locker.lock("report:daily").await?;
    /// // ... exclusive work ...
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock(&self, key: impl AsRef<str>) -> Result<LockGuard> {
        self.lock_with(key, LockOptions::new()).await
    }

    /// Acquires `key` with `options`; unset options take the locker's
    /// defaults.
    ///
    /// # Errors
    ///
    /// As [`lock`](Locker::lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`lock`](Locker::lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{LockError, Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let guard = locker
    ///     .lock_with("invoice:7", LockOptions::new().wait(Duration::from_secs(2)).lease(Duration::from_secs(30)))
    ///     .await?;
    /// assert!(guard.fencing_token().is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_with(&self, key: impl AsRef<str>, options: LockOptions) -> Result<LockGuard> {
        self.lock_mode(key, Mode::Exclusive, options).await
    }

    /// Acquires `mode` of `key` with `options`, waiting within their limit:
    /// the whole key ([`Mode::Exclusive`], as [`lock_with`](Locker::lock_with)),
    /// a share of its read-write lock ([`Mode::Read`], [`Mode::Write`]), or
    /// permits of its semaphore ([`Mode::permits`]). The read-write lock
    /// and the semaphore of a key are objects of their own, apart from its
    /// plain lock.
    ///
    /// Only plain locks re-enter the scope that holds them: a read or a
    /// write lock taken again inside its own scope waits for itself (up to
    /// the wait limit), as `tokio::sync::RwLock` does.
    ///
    /// # Errors
    ///
    /// As [`lock`](Locker::lock); [`LockError::Unsupported`] if the backend
    /// lacks the mode (see [`Capabilities`](crate::backend::Capabilities));
    /// [`LockError::InvalidOptions`] if a semaphore's holders name another
    /// permit limit than `mode` does.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`lock`](Locker::lock): a dropped wait leaves no
    /// place in the queue and no permit behind.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{backend::Mode, BackendExt, LockOptions, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let server = MemoryBackend::new();
    /// let (a, b) = (server.clone().into_locker(), server.into_locker());
    /// let two = a.lock_mode("api:quota", Mode::permits(2, 3)?, LockOptions::new()).await?;
    /// let one = b.lock_mode("api:quota", Mode::permits(1, 3)?, LockOptions::new()).await?;
    /// let none = b.try_lock_mode("api:quota", Mode::permits(1, 3)?, LockOptions::new()).await?;
    /// assert!(none.is_none()); // 3 of 3 taken
    /// # drop((two, one));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_mode(
        &self,
        key: impl AsRef<str>,
        mode: Mode,
        options: LockOptions,
    ) -> Result<LockGuard> {
        let start = Instant::now();
        match self.acquire(key.as_ref(), mode, options, false).await? {
            Some(guard) => Ok(guard),
            None => Err(LockError::Timeout {
                key: key.as_ref().to_owned(),
                waited: start.elapsed(),
            }),
        }
    }

    /// Makes one attempt to acquire `key`: `Ok(None)` if another owner holds
    /// it.
    ///
    /// # Errors
    ///
    /// As [`lock`](Locker::lock), without `Timeout`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`lock`](Locker::lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let server = MemoryBackend::new();
    /// let (a, b) = (server.clone().into_locker(), server.into_locker());
    /// let held = a.try_lock("job").await?.expect("free");
    /// assert!(b.try_lock("job").await?.is_none());
    /// # drop(held);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_lock(&self, key: impl AsRef<str>) -> Result<Option<LockGuard>> {
        self.try_lock_with(key, LockOptions::new()).await
    }

    /// One attempt with `options` (their wait limit is ignored).
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Locker::try_lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`lock`](Locker::lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let opts = LockOptions::new().lease(Duration::from_secs(60));
    /// assert!(locker.try_lock_with("job", opts).await?.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_lock_with(
        &self,
        key: impl AsRef<str>,
        options: LockOptions,
    ) -> Result<Option<LockGuard>> {
        self.try_lock_mode(key, Mode::Exclusive, options).await
    }

    /// One attempt at `mode` of `key` (see [`lock_mode`](Locker::lock_mode)):
    /// `Ok(None)` if it cannot be had now, or if others wait for it first
    /// (a reader never passes a waiting writer).
    ///
    /// # Errors
    ///
    /// As [`lock_mode`](Locker::lock_mode), without `Timeout`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`lock`](Locker::lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{backend::Mode, BackendExt, LockOptions, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let server = MemoryBackend::new();
    /// let (a, b) = (server.clone().into_locker(), server.into_locker());
    /// let reading = a.try_lock_mode("config", Mode::Read, LockOptions::new()).await?;
    /// assert!(reading.is_some());
    /// assert!(b.try_lock_mode("config", Mode::Read, LockOptions::new()).await?.is_some());
    /// assert!(b.try_lock_mode("config", Mode::Write, LockOptions::new()).await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_lock_mode(
        &self,
        key: impl AsRef<str>,
        mode: Mode,
        options: LockOptions,
    ) -> Result<Option<LockGuard>> {
        self.acquire(key.as_ref(), mode, options, true).await
    }

    /// Takes a read share of `key`'s read-write lock, waiting within the
    /// locker's default limit: as [`lock_mode`](Locker::lock_mode) with
    /// [`Mode::Read`]. The guard's fencing token (where the backend gives
    /// them) is greater than every earlier writer's of the key.
    ///
    /// # Errors
    ///
    /// As [`lock_mode`](Locker::lock_mode).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let (one, two) = (locker.read("config").await?, locker.read("config").await?);
    /// # drop((one, two));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn read(&self, key: impl AsRef<str>) -> Result<LockGuard> {
        self.lock_mode(key, Mode::Read, LockOptions::new()).await
    }

    /// Takes `key`'s read-write lock to write, alone: as
    /// [`lock_mode`](Locker::lock_mode) with [`Mode::Write`]. New readers
    /// wait behind a waiting writer.
    ///
    /// # Errors
    ///
    /// As [`lock_mode`](Locker::lock_mode).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{backend::Mode, Locker, LockOptions, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let writing = locker.write("config").await?;
    /// assert!(locker.try_lock_mode("config", Mode::Read, LockOptions::new()).await?.is_none());
    /// writing.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn write(&self, key: impl AsRef<str>) -> Result<LockGuard> {
        self.lock_mode(key, Mode::Write, LockOptions::new()).await
    }

    /// Runs `body` under the lock of `key`, inside its scope: acquires as
    /// [`lock`](Locker::lock) does, runs the future `body` makes, then
    /// releases.
    ///
    /// `body` is given a guard of the hold (re-entered, so releasing or
    /// dropping it early leaves the lock held): read its
    /// [fencing token](LockGuard::fencing_token) or race its
    /// [`lost`](LockGuard::lost) signal with it. Any lock of `key` through
    /// this locker inside `body`, at any depth, re-enters at once.
    ///
    /// # Errors
    ///
    /// - As [`lock`](Locker::lock), before `body` runs;
    /// - [`LockError::Lost`] if the lock was lost before `body` finished: its
    ///   output is dropped, because the work may have overlapped another
    ///   owner's. To stop the work at the moment of the loss, race
    ///   `guard.lost()` inside `body`.
    ///
    /// A release the server could not be told of is not an error here (the
    /// work was done under the lock, and the lease ends on the server); it
    /// is traced as a warning. Use [`LockGuard::scope`] and
    /// [`LockGuard::release`] to see it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe as far as the lock goes: dropping the future drops `body`
    /// and releases the lock (as a dropped guard does).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let fence = locker
    ///     .with_lock("invoice:7", |guard| async move {
    ///         // ... exclusive work, writing with the fence ...
    ///         guard.fencing_token()
    ///     })
    ///     .await?;
    /// assert!(fence.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn with_lock<F, Fut>(&self, key: impl AsRef<str>, body: F) -> Result<Fut::Output>
    where
        F: FnOnce(LockGuard) -> Fut,
        Fut: Future,
    {
        self.with_lock_with(key, LockOptions::new(), body).await
    }

    /// [`with_lock`](Locker::with_lock) with per-call `options`.
    ///
    /// # Errors
    ///
    /// As [`with_lock`](Locker::with_lock).
    ///
    /// # Cancel safety
    ///
    /// As [`with_lock`](Locker::with_lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let options = LockOptions::new().wait(Duration::from_secs(2));
    /// let done = locker.with_lock_with("job", options, |_guard| async { 42 }).await?;
    /// assert_eq!(done, 42);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn with_lock_with<F, Fut>(
        &self,
        key: impl AsRef<str>,
        options: LockOptions,
        body: F,
    ) -> Result<Fut::Output>
    where
        F: FnOnce(LockGuard) -> Fut,
        Fut: Future,
    {
        let guard = self.lock_with(key, options).await?;
        let output = guard.scope(body(guard.sibling())).await;
        match guard.release().await {
            Err(error @ LockError::Lost { .. }) => Err(error),
            // Traced by the release, which is retried in the background.
            Ok(()) | Err(_) => Ok(output),
        }
    }

    /// Waits until every release that dropped guards (and abandoned
    /// acquires) of this locker scheduled has been answered by the server,
    /// and every failed release is done being retried.
    ///
    /// A release that fails is sent again, with backoff, until the server
    /// answers or the lock's lease has passed, when the backend gives the
    /// lock up to expire (see [`Backend::abandon`]). With the servers down,
    /// this therefore waits up to a lease; bound it with
    /// [`tokio::time::timeout`] if exiting sooner matters more.
    ///
    /// Dropping a guard schedules its release on the runtime (see
    /// [`LockGuard`]); a release still scheduled when the runtime shuts
    /// down is never sent, and others wait for the lock until its lease
    /// ends. Call this before a process exits, after its last guard is
    /// gone. Releases scheduled while it waits are waited for too.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = MemoryBackend::new().into_locker();
    /// drop(locker.lock("job:nightly").await?); // release scheduled
    /// locker.wait_for_releases().await; // and answered
    /// # Ok(())
    /// # }
    /// ```
    pub async fn wait_for_releases(&self) {
        self.shared.pending.settled().await;
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.shared.backend.name())
            .field("defaults", &self.shared.defaults)
            .field("watchdog_lease", &self.shared.watchdog.lease())
            .finish()
    }
}
