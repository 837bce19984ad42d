//! `Locker`: the handle users lock through. It holds a backend and default
//! options, tracks reentrant holds per task, and runs the watchdog.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard, RwLock, Weak},
    time::Duration,
};

use tokio::{runtime::Handle, time::Instant};
use tracing::Instrument;

use crate::{
    backend::{AcquireRequest, Backend, LeaseKind, LossReporter, Wait},
    error::{LockError, Result},
    guard::{Hold, LockGuard, ReleaseOnDrop},
    key::LockKey,
    lease::LeaseState,
    options::{validate_lease, wait_deadline, Lease, LockOptions, MIN_LEASE, MIN_WATCHDOG_LEASE},
    owner::Owner,
    token::Token,
    watchdog::Watchdog,
};

/// The default watchdog lease: how long a crashed holder keeps a lock.
pub const DEFAULT_WATCHDOG_LEASE: Duration = Duration::from_secs(30);

/// How long the servers may take to say they are there, when a wait limit
/// passed without a grant (see [`Backend::check_servers`]).
const CHECK_SERVERS_WITHIN: Duration = Duration::from_secs(1);

/// A handle for taking locks through one backend.
///
/// A `Locker` is cheap to clone; clones share the backend connection, the
/// watchdog and the reentrancy table. Build one per backend at startup and
/// pass clones around (or make it the default with
/// [`set_default_locker`](crate::set_default_locker)).
///
/// - [`lock`](Locker::lock) waits for the lock, up to the locker's wait limit
///   (none by default).
/// - [`try_lock`](Locker::try_lock) makes one attempt and returns `Ok(None)`
///   if the lock is held.
/// - [`lock_with`](Locker::lock_with) takes per-call [`LockOptions`].
///
/// # Reentrancy
///
/// Locks are reentrant per Tokio task: a task that holds a key and locks it
/// again through the same `Locker` (or a clone) gets a new guard at once,
/// without asking the server, and the lock is released when the last of its
/// guards goes. A spawned task is a different owner and waits like anyone
/// else. Outside a spawned task (the body of `#[tokio::main]`), the owner is
/// the thread that runs `block_on`.
///
/// Ownership is decided by who *acquired* and is tracked per `Locker`
/// (clones included), so know its edges:
///
/// - Futures joined within one task (`join!`, `select!`) are one owner: if
///   one of them holds a key, the others re-enter it. Use separate tasks for
///   contenders that must exclude each other.
/// - A guard moved into another task still belongs to the task that
///   acquired it: that task re-enters the key at once, even while the moved
///   guard's new task works under it. Take the lock inside the task that
///   does the work rather than handing it a guard.
/// - Two lockers built separately over one backend are two owners, like two
///   processes: a task holding a key through one waits for itself through
///   the other. Build one `Locker` and clone it (or use the default locker).
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
/// let inner = locker.lock("report:daily").await?; // same task: re-entered at once
/// assert_eq!(outer.fencing_token(), inner.fencing_token());
/// drop(inner);
/// drop(outer); // released here
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Locker {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    backend: Arc<dyn Backend>,
    defaults: LockOptions,
    watchdog: Watchdog,
    held: Mutex<HashMap<(Owner, LockKey), Weak<Hold>>>,
    pending: PendingReleases,
}

/// Releases scheduled by dropped guards (or abandoned steps) and not
/// answered yet.
#[derive(Debug, Default)]
pub(crate) struct PendingReleases {
    count: std::sync::atomic::AtomicUsize,
    settled: tokio::sync::Notify,
}

/// One pending release; done when dropped.
pub(crate) struct PendingRelease(Arc<Shared>);

impl PendingReleases {
    async fn settled(&self) {
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            // Registered before the count is read: a last release that ends
            // in between still wakes us.
            settled.as_mut().enable();
            if self.count.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return;
            }
            settled.await;
        }
    }
}

impl Drop for PendingRelease {
    fn drop(&mut self) {
        let pending = &self.0.pending;
        if pending
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            pending.settled.notify_waiters();
        }
    }
}

impl Shared {
    /// Counts a release as pending until the returned value is dropped.
    pub(crate) fn start_release(self: &Arc<Self>) -> PendingRelease {
        self.pending
            .count
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        PendingRelease(self.clone())
    }

    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub(crate) fn watchdog(&self) -> &Watchdog {
        &self.watchdog
    }

    fn held(&self) -> MutexGuard<'_, HashMap<(Owner, LockKey), Weak<Hold>>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn reenter(&self, owner: Owner, key: &LockKey) -> Option<Arc<Hold>> {
        self.held()
            .get(&(owner, key.clone()))
            .and_then(Weak::upgrade)
    }

    pub(crate) fn remember(&self, owner: Owner, key: LockKey, hold: &Arc<Hold>) {
        self.held().insert((owner, key), Arc::downgrade(hold));
    }

    /// Forgets `hold` (which is being dropped) as the current one of its
    /// owner and key, unless a newer hold has taken its place.
    pub(crate) fn forget(&self, owner: Owner, key: &LockKey, hold: *const Hold) {
        let mut held = self.held();
        let entry = (owner, key.clone());
        if held.get(&entry).is_some_and(|w| Weak::as_ptr(w) == hold) {
            held.remove(&entry);
        }
    }
}

impl Locker {
    /// A locker over `backend` with the default options: wait without limit,
    /// and a watchdog lease of [`DEFAULT_WATCHDOG_LEASE`].
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// assert_eq!(locker.backend().name(), "memory");
    /// ```
    pub fn new(backend: impl Backend) -> Locker {
        Locker::from_arc(Arc::new(backend))
    }

    /// A locker over a shared backend, with the default options.
    pub fn from_arc(backend: Arc<dyn Backend>) -> Locker {
        LockerBuilder::from_arc(backend)
            .build()
            .expect("the default options are valid")
    }

    /// A builder, to set the locker's default wait limit and leases.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::builder(MemoryBackend::new())
    ///     .wait(Duration::from_secs(10))
    ///     .watchdog_lease(Duration::from_secs(15))
    ///     .build()?;
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn builder(backend: impl Backend) -> LockerBuilder {
        LockerBuilder::from_arc(Arc::new(backend))
    }

    /// The backend this locker talks to.
    pub fn backend(&self) -> &Arc<dyn Backend> {
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

    /// Whether the current task holds `key` through this locker.
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
    /// assert!(locker.is_held_by_current_task("k"));
    /// drop(guard);
    /// assert!(!locker.is_held_by_current_task("k"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_held_by_current_task(&self, key: &str) -> bool {
        LockKey::new(key)
            .ok()
            .and_then(|key| self.shared.reenter(Owner::current(), &key))
            .is_some()
    }

    /// Acquires `key`, waiting up to the locker's default wait limit.
    ///
    /// Re-entering a key the current task holds returns at once (see
    /// [Reentrancy](Locker#reentrancy)).
    ///
    /// # Errors
    ///
    /// - [`LockError::Timeout`] when the wait limit passes (another owner
    ///   holds the key);
    /// - [`LockError::InvalidKey`], [`LockError::InvalidOptions`];
    /// - [`LockError::Lost`] when re-entering a hold that was lost;
    /// - [`LockError::Backend`] when the server fails, also when the wait
    ///   limit passes while the servers do not answer: then the backend is
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
        let start = Instant::now();
        match self.acquire(key.as_ref(), options, false).await? {
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
        self.acquire(key.as_ref(), options, true).await
    }

    /// Waits until every release that dropped guards (and abandoned
    /// acquires) of this locker scheduled has been answered by the server,
    /// or has failed.
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

    /// Asks the backend whether its servers answer, bounded to
    /// [`CHECK_SERVERS_WITHIN`]; no answer in time is their error.
    async fn check_servers(&self) -> Result<()> {
        let backend = &self.shared.backend;
        match tokio::time::timeout(CHECK_SERVERS_WITHIN, backend.check_servers()).await {
            Ok(answer) => answer,
            Err(_) => Err(LockError::backend(
                backend.name(),
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the servers did not answer when the wait limit passed",
                ),
            )),
        }
    }

    async fn acquire(
        &self,
        key: &str,
        options: LockOptions,
        once: bool,
    ) -> Result<Option<LockGuard>> {
        let key = LockKey::new(key)?;
        let options = options.or(self.shared.defaults);
        let (lease, lease_kind) = match options.get_lease().unwrap_or(Lease::Watchdog) {
            Lease::Watchdog => (self.shared.watchdog.lease(), LeaseKind::Watchdog),
            Lease::Fixed(lease) => {
                validate_lease(lease, MIN_LEASE)?;
                (lease, LeaseKind::Fixed)
            }
        };
        let owner = Owner::current();
        if let Some(hold) = self.shared.reenter(owner, &key) {
            return LockGuard::reentered(hold).map(Some);
        }
        let runtime = Handle::try_current().map_err(|_| LockError::NoRuntime)?;
        let start = Instant::now();
        let wait = if once {
            Wait::No
        } else {
            match wait_deadline(start, options.get_wait().flatten()) {
                Some(deadline) => Wait::Until(deadline),
                None => Wait::Forever,
            }
        };
        let backend_name = self.shared.backend.name();
        let span = tracing::info_span!(
            "dlock.acquire",
            key = %key,
            backend = backend_name,
            waited_us = tracing::field::Empty,
            acquired = tracing::field::Empty,
            fence = tracing::field::Empty,
        );
        let acquire = async {
            let token = Token::generate();
            let lease_state = Arc::new(LeaseState::new(key.clone(), backend_name));
            let request = AcquireRequest {
                key: &key,
                token: &token,
                lease,
                lease_kind,
                wait,
                loss: LossReporter(lease_state.clone()),
            };
            // Until the backend has answered for itself, the attempt may have
            // won on the server: if it is cut short (by the wait limit, by
            // the caller dropping this future, or by an error mid-flight),
            // release the token so no orphan holds the key for a lease.
            let mut unanswered = ReleaseOnDrop {
                runtime: &runtime,
                shared: &self.shared,
                key: &key,
                token,
                armed: true,
            };
            let attempt = self.shared.backend.acquire(request);
            // The backend bounds its own wait; this bound makes the limit
            // exact whatever the backend does.
            let (outcome, cut_short) = match wait {
                Wait::Until(deadline) => match tokio::time::timeout_at(deadline, attempt).await {
                    Ok(outcome) => (outcome, false),
                    Err(_) => (Ok(None), true),
                },
                Wait::No | Wait::Forever => (attempt.await, false),
            };
            unanswered.armed = cut_short || outcome.is_err();
            // Give back what an attempt cut short may hold now, before any
            // further await: the next waiter should not wait on it.
            drop(unanswered);
            let outcome = match (outcome, wait) {
                // Not granted within the limit: a timeout, unless the servers
                // stopped answering, whose error is then the truth.
                (Ok(None), Wait::Until(_)) => self.check_servers().await.map(|()| None),
                (outcome, _) => outcome,
            };
            let waited = start.elapsed();
            let span = tracing::Span::current();
            span.record("waited_us", waited.as_micros() as u64);
            let outcome =
                outcome.inspect_err(|error| tracing::warn!(%error, "dlock acquire failed"))?;
            span.record("acquired", outcome.is_some());
            let Some(acquired) = outcome else {
                return Ok(None);
            };
            if let Some(fence) = acquired.fence() {
                span.record("fence", fence);
            }
            let (from, length) = acquired.lease_from().unwrap_or((acquired.sent_at(), lease));
            lease_state.start(from, length);
            // No `.await` from the backend's answer to the hold that releases
            // on drop: a cancellation cannot strand the lock in between.
            let renewed = lease_kind == LeaseKind::Watchdog && !acquired.is_kept_alive_by_backend();
            let hold = Hold::new(
                &self.shared,
                owner,
                key.clone(),
                token,
                acquired.fence(),
                lease_state,
                renewed,
                runtime.clone(),
            );
            LockGuard::fresh(hold).map(Some)
        };
        acquire.instrument(span).await
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

/// Builds a [`Locker`] with default options of its own.
///
/// # Examples
///
/// ```
/// use dlock_core::{Locker, MemoryBackend};
/// use std::time::Duration;
///
/// let locker = Locker::builder(MemoryBackend::new())
///     .wait(Duration::from_secs(5))
///     .build()?;
/// assert_eq!(locker.defaults().get_wait(), Some(Some(Duration::from_secs(5))));
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct LockerBuilder {
    backend: Arc<dyn Backend>,
    defaults: LockOptions,
    watchdog_lease: Duration,
}

impl LockerBuilder {
    /// A builder over a shared backend.
    pub fn from_arc(backend: Arc<dyn Backend>) -> Self {
        LockerBuilder {
            backend,
            defaults: LockOptions::new().wait_forever().watchdog(),
            watchdog_lease: DEFAULT_WATCHDOG_LEASE,
        }
    }

    /// Waits at most `limit` by default.
    pub fn wait(mut self, limit: Duration) -> Self {
        self.defaults = self.defaults.wait(limit);
        self
    }

    /// Waits without limit by default (the default).
    pub fn wait_forever(mut self) -> Self {
        self.defaults = self.defaults.wait_forever();
        self
    }

    /// Uses a fixed lease by default instead of the watchdog.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.defaults = self.defaults.lease(lease);
        self
    }

    /// The lease the watchdog renews (default [`DEFAULT_WATCHDOG_LEASE`]),
    /// renewed every third of it: how long a crashed holder keeps the lock.
    pub fn watchdog_lease(mut self, lease: Duration) -> Self {
        self.watchdog_lease = lease;
        self
    }

    /// Builds the locker.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] if a lease is out of range.
    pub fn build(self) -> Result<Locker> {
        validate_lease(self.watchdog_lease, MIN_WATCHDOG_LEASE)?;
        if let Some(Lease::Fixed(lease)) = self.defaults.get_lease() {
            validate_lease(lease, MIN_LEASE)?;
        }
        Ok(Locker {
            shared: Arc::new(Shared {
                backend: self.backend,
                defaults: self.defaults,
                watchdog: Watchdog::new(self.watchdog_lease),
                held: Mutex::default(),
                pending: PendingReleases::default(),
            }),
        })
    }
}

/// Turns any backend into a [`Locker`] with default options.
///
/// # Examples
///
/// ```
/// use dlock_core::{BackendExt, MemoryBackend};
///
/// let locker = MemoryBackend::new().into_locker();
/// # drop(locker);
/// ```
pub trait BackendExt: Backend + Sized {
    /// A locker over this backend with the default options.
    fn into_locker(self) -> Locker {
        Locker::new(self)
    }
}

impl<B: Backend> BackendExt for B {}

static DEFAULT_LOCKER: RwLock<Option<Locker>> = RwLock::new(None);

/// Makes `locker` the one [`default_locker`] returns, and so the one
/// `#[distributed_lock]` uses when it is given no `locker = ...`.
///
/// Call it once at startup; a later call replaces the default for calls that
/// start after it.
///
/// # Examples
///
/// ```
/// use dlock_core::{default_locker, set_default_locker, BackendExt, MemoryBackend};
///
/// set_default_locker(MemoryBackend::new().into_locker());
/// assert_eq!(default_locker().unwrap().backend().name(), "memory");
/// ```
pub fn set_default_locker(locker: Locker) {
    *DEFAULT_LOCKER.write().unwrap_or_else(|e| e.into_inner()) = Some(locker);
}

/// The locker set by [`set_default_locker`].
///
/// There is deliberately no implicit default: an in-process lock where a
/// distributed one was meant would exclude nothing across processes, silently.
///
/// # Errors
///
/// [`LockError::NoDefaultLocker`] if none was set.
///
/// # Examples
///
/// ```
/// use dlock_core::{default_locker, LockError};
///
/// // Nothing was set in this program:
/// assert!(matches!(default_locker(), Err(LockError::NoDefaultLocker)));
/// ```
pub fn default_locker() -> Result<Locker> {
    DEFAULT_LOCKER
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .ok_or(LockError::NoDefaultLocker)
}
