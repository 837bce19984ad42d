//! Locks for code without an async runtime: build tools, tests, CLIs,
//! `std::thread` workers.
//!
//! Every type here wraps its async counterpart and runs it on a private
//! Tokio runtime of one worker thread, which each [`connect`] starts (its
//! clones share it): the calling thread blocks until the server answers,
//! while the worker keeps leases renewed and sends releases. The guards
//! release the lock when dropped, and a drop waits for the server's
//! answer (at most [`DROP_WAIT`]; past it the release goes on in the
//! background, and the lease covers the rest).
//!
//! What it costs: one thread per [`connect`], and a hand-off to that thread
//! and back for each call, on top of the lock's round trip to its server.
//! Locks are not re-entrant here: the task-local scope of the async API
//! has no counterpart, so a thread that locks a key it already holds waits
//! for itself, as with [`std::sync::Mutex`].
//!
//! Calling it from within a Tokio runtime is refused with
//! [`LockError::InsideRuntime`] rather than stalling that runtime: async
//! code uses the async API (so do `spawn_blocking` threads, which count as
//! inside theirs).
//!
//! # Examples
//!
//! ```
//! let locker = dlock::blocking::connect("memory")?;
//! let guard = locker.lock("report:daily")?;
//! assert!(guard.fencing_token().is_some());
//! assert!(locker.try_lock("report:daily")?.is_none());
//! drop(guard); // released, and the server has answered
//! assert!(locker.try_lock("report:daily")?.is_some());
//! # Ok::<(), dlock::LockError>(())
//! ```

use std::{fmt, future::Future, sync::Arc, time::Duration};

use dlock_core::{
    backend::{HeldLock, Holder},
    HoldState, LockError, LockOptions, LostReason, Result, Token,
};
use tokio::runtime::{Handle, Runtime};

mod primitives;

pub use primitives::{
    DistMutex, DistMutexGuard, DistRwLock, DistRwLockReadGuard, DistRwLockWriteGuard,
    DistSemaphore, Election, Leadership, Permit,
};

/// The longest a guard's drop (and the last clone of a [`Locker`]) waits
/// for the server to answer its release.
pub const DROP_WAIT: Duration = Duration::from_secs(5);

/// A [`Locker`] on the backend `url` names, with a runtime of its own (see
/// [`crate::connect`] for the URLs).
///
/// # Errors
///
/// [`LockError::InsideRuntime`] when called from within a Tokio runtime;
/// otherwise as [`crate::connect`], and [`LockError::Backend`] if the
/// runtime's thread cannot be started.
///
/// # Examples
///
/// ```
/// let locker = dlock::blocking::connect("memory")?;
/// # drop(locker);
/// // Inside a runtime, the async API is the one to use.
/// let runtime = tokio::runtime::Runtime::new().unwrap();
/// let refused = runtime.block_on(async { dlock::blocking::connect("memory").map(drop) });
/// assert!(matches!(refused, Err(dlock::LockError::InsideRuntime)));
/// # Ok::<(), dlock::LockError>(())
/// ```
pub fn connect(url: &str) -> Result<Locker> {
    Locker::build(|| crate::connect(url))
}

/// What every blocking value shares: the runtime, and the async locker.
struct Shared {
    runtime: Option<Runtime>,
    locker: crate::Locker,
}

impl Shared {
    fn runtime(&self) -> &Runtime {
        self.runtime.as_ref().expect("the runtime lives until drop")
    }

    /// Runs `future` to its end on the runtime, this thread blocked.
    fn block_on<F: Future>(&self, future: F) -> Result<F::Output> {
        outside_runtime()?;
        Ok(self.runtime().block_on(future))
    }

    /// Runs `make` with the runtime entered (for calls that spawn).
    fn entered<T>(&self, make: impl FnOnce() -> T) -> T {
        let _entered = self.runtime().enter();
        make()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        // Releases still on their way (a guard dropped inside another
        // runtime sends its release from a task on this one) get their
        // chance before the runtime stops.
        let locker = self.locker.clone();
        let finish = move |runtime: Runtime| {
            within(&runtime, DROP_WAIT, locker.wait_for_releases());
            runtime.shutdown_background();
        };
        if outside_runtime().is_ok() {
            finish(runtime);
            return;
        }
        // Here no thread may block, nor a runtime be dropped: a thread of
        // its own finishes it (or, if none can start, the runtime stops at
        // once, and the leases end what it was releasing).
        let slot = Arc::new(std::sync::Mutex::new(Some(runtime)));
        let theirs = slot.clone();
        let spawned = std::thread::Builder::new()
            .name("dlock-blocking-drop".to_owned())
            .spawn(move || {
                let runtime = theirs.lock().ok().and_then(|mut slot| slot.take());
                if let Some(runtime) = runtime {
                    finish(runtime);
                }
            });
        if spawned.is_err() {
            let runtime = slot.lock().ok().and_then(|mut slot| slot.take());
            if let Some(runtime) = runtime {
                runtime.shutdown_background();
            }
        }
    }
}

/// Runs `future` on `runtime` for at most `limit`, this thread blocked:
/// `None` if it had not ended by then (it is dropped).
fn within<F: Future>(runtime: &Runtime, limit: Duration, future: F) -> Option<F::Output> {
    // The timer is made inside the runtime, which drives it.
    runtime.block_on(async { tokio::time::timeout(limit, future).await.ok() })
}

fn outside_runtime() -> Result<()> {
    match Handle::try_current() {
        Ok(_) => Err(LockError::InsideRuntime),
        Err(_) => Ok(()),
    }
}

/// Takes and holds locks from synchronous code: [`crate::Locker`]'s
/// blocking twin. Cheap to clone; clones share the connection and the
/// runtime.
///
/// # Examples
///
/// ```
/// use dlock::LockOptions;
/// use std::time::Duration;
///
/// let locker = dlock::blocking::connect("memory")?;
/// let held = locker.lock("k")?;
/// let other = locker.clone();
/// let waited = std::thread::spawn(move || {
///     other.lock_with("k", LockOptions::new().wait(Duration::from_millis(50)))
/// });
/// assert!(matches!(waited.join().unwrap(), Err(dlock::LockError::Timeout { .. })));
/// held.release()?;
/// # Ok::<(), dlock::LockError>(())
/// ```
#[derive(Clone)]
pub struct Locker {
    shared: Arc<Shared>,
}

impl Locker {
    /// A locker whose async [`crate::Locker`] `make` builds, on the new
    /// private runtime (so that its connections belong to it): for a
    /// backend made from a config or a client of your own.
    ///
    /// # Errors
    ///
    /// [`LockError::InsideRuntime`] from within a Tokio runtime,
    /// [`LockError::Backend`] if the runtime cannot start, and `make`'s
    /// error.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock::{Locker, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// let locker = dlock::blocking::Locker::build(|| async {
    ///     Locker::builder(MemoryBackend::new()).wait(Duration::from_secs(1)).build()
    /// })?;
    /// assert_eq!(locker.as_async().defaults().get_wait(), Some(Some(Duration::from_secs(1))));
    /// # Ok::<(), dlock::LockError>(())
    /// ```
    pub fn build<F, Fut>(make: F) -> Result<Locker>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<crate::Locker>>,
    {
        outside_runtime()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dlock-blocking")
            .enable_all()
            .build()
            .map_err(|e| LockError::backend("blocking", e))?;
        let locker = runtime.block_on(make())?;
        Ok(Locker {
            shared: Arc::new(Shared {
                runtime: Some(runtime),
                locker,
            }),
        })
    }

    /// The async locker underneath, for the calls this type does not
    /// wrap (run them on a runtime of your own only if its connections
    /// do not need this one's: prefer the methods here).
    pub fn as_async(&self) -> &crate::Locker {
        &self.shared.locker
    }

    /// Takes the lock on `key` with the locker's defaults, waiting as
    /// they say ([`crate::Locker::lock`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::lock`], and [`LockError::InsideRuntime`].
    pub fn lock(&self, key: impl AsRef<str>) -> Result<LockGuard> {
        self.guard(self.shared.block_on(self.shared.locker.lock(key))?)
    }

    /// Takes the lock on `key` with `options` ([`crate::Locker::lock_with`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::lock_with`], and [`LockError::InsideRuntime`].
    pub fn lock_with(&self, key: impl AsRef<str>, options: LockOptions) -> Result<LockGuard> {
        let locker = &self.shared.locker;
        self.guard(self.shared.block_on(locker.lock_with(key, options))?)
    }

    /// One attempt: the guard, or `None` if the key is held
    /// ([`crate::Locker::try_lock`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::try_lock`], and [`LockError::InsideRuntime`].
    pub fn try_lock(&self, key: impl AsRef<str>) -> Result<Option<LockGuard>> {
        let taken = self.shared.block_on(self.shared.locker.try_lock(key))??;
        taken.map(|guard| self.guard(Ok(guard))).transpose()
    }

    /// Takes `key` shared, as a reader ([`crate::Locker::read`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::read`], and [`LockError::InsideRuntime`].
    pub fn read(&self, key: impl AsRef<str>) -> Result<LockGuard> {
        self.guard(self.shared.block_on(self.shared.locker.read(key))?)
    }

    /// Takes `key` alone, as a writer ([`crate::Locker::write`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::write`], and [`LockError::InsideRuntime`].
    pub fn write(&self, key: impl AsRef<str>) -> Result<LockGuard> {
        self.guard(self.shared.block_on(self.shared.locker.write(key))?)
    }

    /// Who holds `key` now ([`crate::Locker::holder`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::holder`], and [`LockError::InsideRuntime`].
    pub fn holder(&self, key: impl AsRef<str>) -> Result<Option<Holder>> {
        self.shared.block_on(self.shared.locker.holder(key))?
    }

    /// Whether `key` is held now ([`crate::Locker::is_locked`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::is_locked`], and [`LockError::InsideRuntime`].
    pub fn is_locked(&self, key: impl AsRef<str>) -> Result<bool> {
        self.shared.block_on(self.shared.locker.is_locked(key))?
    }

    /// Frees `key` whoever holds it ([`crate::Locker::force_release`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::force_release`], and [`LockError::InsideRuntime`].
    pub fn force_release(&self, key: impl AsRef<str>) -> Result<bool> {
        self.shared
            .block_on(self.shared.locker.force_release(key))?
    }

    /// The locks held now under `prefix`, a page at a time
    /// ([`crate::Locker::list`]): each item is one page, read when the
    /// iterator is advanced. After an error it ends.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), dlock::LockError> {
    /// let locker = dlock::blocking::connect("memory")?;
    /// let _guard = locker.lock("jobs/7")?;
    /// let held: Vec<_> = locker.list("jobs/").collect::<Result<Vec<_>, _>>()?;
    /// assert_eq!(held.concat()[0].key().name(), Some("jobs/7"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn list(&self, prefix: impl Into<String>) -> Listing {
        Listing {
            shared: self.shared.clone(),
            pages: Some(self.shared.locker.list(prefix)),
        }
    }

    /// A mutex around `value`, exclusive across processes under `key`
    /// ([`crate::DistMutex`]).
    pub fn mutex<T>(&self, key: impl Into<String>, value: T) -> DistMutex<T> {
        DistMutex::new(self.shared.clone(), key, value)
    }

    /// A read-write lock around `value` under `key` ([`crate::DistRwLock`]).
    pub fn rwlock<T>(&self, key: impl Into<String>, value: T) -> DistRwLock<T> {
        DistRwLock::new(self.shared.clone(), key, value)
    }

    /// A semaphore of `permits` under `key` ([`crate::DistSemaphore`]).
    pub fn semaphore(&self, key: impl Into<String>, permits: u32) -> DistSemaphore {
        DistSemaphore::new(self.shared.clone(), key, permits)
    }

    /// Joins the election `name` as a candidate ([`crate::Locker::elect`]):
    /// it campaigns on the runtime's thread from now on.
    ///
    /// # Errors
    ///
    /// As [`crate::Locker::elect`].
    pub fn elect(&self, name: impl AsRef<str>) -> Result<Election> {
        let election = self.shared.entered(|| self.shared.locker.elect(name))?;
        Ok(Election::new(self.shared.clone(), election))
    }

    fn guard(&self, guard: Result<crate::LockGuard>) -> Result<LockGuard> {
        Ok(LockGuard(Held::new(self.shared.clone(), guard?)))
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("blocking::Locker")
            .field(&self.shared.locker)
            .finish()
    }
}

/// An async guard of any kind, and how to release it.
trait Releases: Sized {
    fn release(self) -> impl Future<Output = Result<()>>;
}

impl Releases for crate::LockGuard {
    fn release(self) -> impl Future<Output = Result<()>> {
        crate::LockGuard::release(self)
    }
}

/// An async guard held by blocking code: released through the runtime
/// when dropped, the thread waiting for the answer (at most
/// [`DROP_WAIT`]). Dropped inside a runtime, it is released in the
/// background, as the async guard is.
struct Held<G: Releases> {
    guard: Option<G>,
    shared: Arc<Shared>,
}

impl<G: Releases> Held<G> {
    fn new(shared: Arc<Shared>, guard: G) -> Self {
        Held {
            guard: Some(guard),
            shared,
        }
    }

    fn get(&self) -> &G {
        self.guard.as_ref().expect("a guard until released")
    }

    fn get_mut(&mut self) -> &mut G {
        self.guard.as_mut().expect("a guard until released")
    }

    fn release(mut self) -> Result<()> {
        let guard = self.guard.take().expect("a guard until released");
        self.shared.block_on(guard.release())?
    }
}

impl<G: Releases> Drop for Held<G> {
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        if outside_runtime().is_ok() {
            // Past the wait, the release future is dropped, and the async
            // guard sends it again from a task of its own.
            within(self.shared.runtime(), DROP_WAIT, guard.release());
        }
    }
}

/// The pages of a [`Locker::list`]: an iterator of pages, each read
/// when it is asked for.
pub struct Listing {
    shared: Arc<Shared>,
    /// `None` once every page was read, or after an error.
    pages: Option<crate::Listing>,
}

impl Listing {
    /// At most `size` locks a page ([`crate::Listing::page_size`]).
    pub fn page_size(mut self, size: usize) -> Self {
        self.pages = self.pages.map(|pages| pages.page_size(size));
        self
    }
}

impl Iterator for Listing {
    type Item = Result<Vec<HeldLock>>;

    fn next(&mut self) -> Option<Self::Item> {
        let pages = self.pages.as_mut()?;
        let page = self
            .shared
            .block_on(pages.next_page())
            .and_then(|page| page);
        match page {
            Ok(Some(page)) => Some(Ok(page)),
            Ok(None) => {
                self.pages = None;
                None
            }
            Err(error) => {
                self.pages = None;
                Some(Err(error))
            }
        }
    }
}

impl fmt::Debug for Listing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listing")
            .field("pages", &self.pages)
            .finish()
    }
}

/// Proof that a lock is held, for blocking code ([`crate::LockGuard`]'s
/// twin). Dropping it releases the lock and waits for the server's answer
/// (at most [`DROP_WAIT`]).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// let locker = dlock::blocking::connect("memory")?;
/// let guard = locker.lock("k")?;
/// assert_eq!(guard.key(), "k");
/// assert!(!guard.is_lost());
/// assert_eq!(guard.wait_lost(Duration::from_millis(10))?, None);
/// guard.release()?;
/// # Ok::<(), dlock::LockError>(())
/// ```
pub struct LockGuard(Held<crate::LockGuard>);

impl LockGuard {
    /// The async guard underneath.
    pub fn as_async(&self) -> &crate::LockGuard {
        self.0.get()
    }

    /// The key held.
    pub fn key(&self) -> &str {
        self.0.get().key()
    }

    /// The fencing token of this grant ([`crate::LockGuard::fencing_token`]).
    pub fn fencing_token(&self) -> Option<u64> {
        self.0.get().fencing_token()
    }

    /// The owner token the lock is held under.
    pub fn token(&self) -> &Token {
        self.0.get().token()
    }

    /// Whether the lock is known lost ([`crate::LockGuard::is_lost`]).
    pub fn is_lost(&self) -> bool {
        self.0.get().is_lost()
    }

    /// Held, lost, or unsure ([`crate::LockGuard::state`]).
    pub fn state(&self) -> HoldState {
        self.0.get().state()
    }

    /// Waits up to `limit` for the lock to be lost: why, or `None` if it
    /// still holds then.
    ///
    /// # Errors
    ///
    /// [`LockError::InsideRuntime`].
    pub fn wait_lost(&self, limit: Duration) -> Result<Option<LostReason>> {
        outside_runtime()?;
        Ok(within(self.0.shared.runtime(), limit, self.0.get().lost()))
    }

    /// Moves a fixed lease's end to `lease` from now
    /// ([`crate::LockGuard::extend`]).
    ///
    /// # Errors
    ///
    /// As [`crate::LockGuard::extend`], and [`LockError::InsideRuntime`].
    pub fn extend(&self, lease: Duration) -> Result<()> {
        self.0.shared.block_on(self.0.get().extend(lease))?
    }

    /// Releases the lock and waits for the answer
    /// ([`crate::LockGuard::release`]).
    ///
    /// # Errors
    ///
    /// As [`crate::LockGuard::release`], and [`LockError::InsideRuntime`].
    pub fn release(self) -> Result<()> {
        self.0.release()
    }

    /// Forgets the guard without releasing: the lock stays held until its
    /// lease runs out ([`crate::LockGuard::leak`]).
    pub fn leak(mut self) {
        if let Some(guard) = self.0.guard.take() {
            guard.leak();
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("blocking::LockGuard")
            .field(self.0.get())
            .finish()
    }
}

/// A guard that derefs to the value it protects (the mutex's and the
/// read-write lock's guards).
macro_rules! value_guard {
    ($guard:ident, $inner:ident, $release:path) => {
        impl<T> Releases for dlock_core::$inner<'_, T> {
            fn release(self) -> impl std::future::Future<Output = Result<()>> {
                $release(self)
            }
        }

        impl<T> $guard<'_, T> {
            /// The async guard underneath (its fencing token, its loss).
            pub fn as_async(this: &Self) -> &dlock_core::$inner<'_, T> {
                this.0.get()
            }

            /// Releases the lock and waits for the answer.
            ///
            /// # Errors
            ///
            /// As the async guard's `release`, and
            /// [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
            pub fn release(this: Self) -> Result<()> {
                this.0.release()
            }
        }

        impl<T> std::ops::Deref for $guard<'_, T> {
            type Target = T;
            fn deref(&self) -> &T {
                self.0.get()
            }
        }

        impl<T: std::fmt::Debug> std::fmt::Debug for $guard<'_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Debug::fmt(self.0.get(), f)
            }
        }
    };
}
use value_guard;
