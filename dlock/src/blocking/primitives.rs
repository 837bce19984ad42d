//! The blocking twins of the mutex, the read-write lock, the semaphore and
//! the election.

use std::{fmt, ops::DerefMut, sync::Arc, time::Duration};

use dlock_core::{election, LostReason, Result};

use super::{outside_runtime, value_guard, within, Held, Releases, Shared, DROP_WAIT};

/// A value behind a lock that excludes across processes
/// ([`crate::DistMutex`]'s blocking twin), from [`Locker::mutex`](super::Locker::mutex).
///
/// # Examples
///
/// ```
/// let locker = dlock::blocking::connect("memory")?;
/// let stock = locker.mutex("stock:42", 10_u32);
/// {
///     let mut left = stock.lock()?;
///     *left -= 1;
/// } // released here
/// assert_eq!(*stock.lock()?, 9);
/// # Ok::<(), dlock::LockError>(())
/// ```
pub struct DistMutex<T> {
    inner: crate::DistMutex<T>,
    shared: Arc<Shared>,
}

/// The guard of a [`DistMutex`]: derefs to the value, releases on drop.
pub struct DistMutexGuard<'a, T>(Held<crate::DistMutexGuard<'a, T>>);

value_guard!(
    DistMutexGuard,
    DistMutexGuard,
    crate::DistMutexGuard::release
);

impl<T> DistMutex<T> {
    pub(super) fn new(shared: Arc<Shared>, key: impl Into<String>, value: T) -> Self {
        let inner = crate::DistMutex::new(&shared.locker, key, value);
        DistMutex { inner, shared }
    }

    /// The key it locks.
    pub fn key(&self) -> &str {
        self.inner.key()
    }

    /// Locks, waiting as the locker's defaults say.
    ///
    /// # Errors
    ///
    /// As [`crate::DistMutex::lock`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn lock(&self) -> Result<DistMutexGuard<'_, T>> {
        let guard = self.shared.block_on(self.inner.lock())??;
        Ok(DistMutexGuard(Held::new(self.shared.clone(), guard)))
    }

    /// One attempt: the guard, or `None` if held elsewhere.
    ///
    /// # Errors
    ///
    /// As [`crate::DistMutex::try_lock`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn try_lock(&self) -> Result<Option<DistMutexGuard<'_, T>>> {
        let guard = self.shared.block_on(self.inner.try_lock())??;
        Ok(guard.map(|guard| DistMutexGuard(Held::new(self.shared.clone(), guard))))
    }

    /// The value, without locking: `&mut self` proves no guard lives.
    pub fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut()
    }

    /// The value, without locking.
    pub fn into_inner(self) -> T {
        self.inner.into_inner()
    }
}

impl<T: fmt::Debug> fmt::Debug for DistMutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

/// A value behind a read-write lock across processes
/// ([`crate::DistRwLock`]'s blocking twin), from [`Locker::rwlock`](super::Locker::rwlock).
///
/// # Examples
///
/// ```
/// let locker = dlock::blocking::connect("memory")?;
/// let config = locker.rwlock("config", String::from("v1"));
/// {
///     let (a, b) = (config.read()?, config.read()?);
///     assert_eq!((a.as_str(), b.as_str()), ("v1", "v1"));
/// }
/// config.write()?.push_str("+patch");
/// assert_eq!(*config.read()?, "v1+patch");
/// # Ok::<(), dlock::LockError>(())
/// ```
pub struct DistRwLock<T> {
    inner: crate::DistRwLock<T>,
    shared: Arc<Shared>,
}

/// A reader's guard of a [`DistRwLock`]: derefs to the value.
pub struct DistRwLockReadGuard<'a, T>(Held<crate::DistRwLockReadGuard<'a, T>>);

/// The writer's guard of a [`DistRwLock`]: derefs mutably to the value.
pub struct DistRwLockWriteGuard<'a, T>(Held<crate::DistRwLockWriteGuard<'a, T>>);

value_guard!(
    DistRwLockReadGuard,
    DistRwLockReadGuard,
    crate::DistRwLockReadGuard::release
);
value_guard!(
    DistRwLockWriteGuard,
    DistRwLockWriteGuard,
    crate::DistRwLockWriteGuard::release
);

impl<T> DistRwLock<T> {
    pub(super) fn new(shared: Arc<Shared>, key: impl Into<String>, value: T) -> Self {
        let inner = crate::DistRwLock::new(&shared.locker, key, value);
        DistRwLock { inner, shared }
    }

    /// The key it locks.
    pub fn key(&self) -> &str {
        self.inner.key()
    }

    /// Takes it shared, as a reader.
    ///
    /// # Errors
    ///
    /// As [`crate::DistRwLock::read`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn read(&self) -> Result<DistRwLockReadGuard<'_, T>> {
        let guard = self.shared.block_on(self.inner.read())??;
        Ok(DistRwLockReadGuard(Held::new(self.shared.clone(), guard)))
    }

    /// One attempt as a reader.
    ///
    /// # Errors
    ///
    /// As [`crate::DistRwLock::try_read`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn try_read(&self) -> Result<Option<DistRwLockReadGuard<'_, T>>> {
        let guard = self.shared.block_on(self.inner.try_read())??;
        Ok(guard.map(|guard| DistRwLockReadGuard(Held::new(self.shared.clone(), guard))))
    }

    /// Takes it alone, as the writer.
    ///
    /// # Errors
    ///
    /// As [`crate::DistRwLock::write`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn write(&self) -> Result<DistRwLockWriteGuard<'_, T>> {
        let guard = self.shared.block_on(self.inner.write())??;
        Ok(DistRwLockWriteGuard(Held::new(self.shared.clone(), guard)))
    }

    /// One attempt as the writer.
    ///
    /// # Errors
    ///
    /// As [`crate::DistRwLock::try_write`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn try_write(&self) -> Result<Option<DistRwLockWriteGuard<'_, T>>> {
        let guard = self.shared.block_on(self.inner.try_write())??;
        Ok(guard.map(|guard| DistRwLockWriteGuard(Held::new(self.shared.clone(), guard))))
    }
}

impl<T: fmt::Debug> fmt::Debug for DistRwLock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

/// Permits shared across processes ([`crate::DistSemaphore`]'s blocking
/// twin), from [`Locker::semaphore`](super::Locker::semaphore).
///
/// # Examples
///
/// ```
/// let locker = dlock::blocking::connect("memory")?;
/// let exports = locker.semaphore("exports", 2);
/// let (_a, _b) = (exports.acquire()?, exports.acquire()?);
/// assert!(exports.try_acquire()?.is_none());
/// # Ok::<(), dlock::LockError>(())
/// ```
pub struct DistSemaphore {
    inner: crate::DistSemaphore,
    shared: Arc<Shared>,
}

/// Permits of a [`DistSemaphore`], given back on drop.
pub struct Permit(Held<crate::Permit>);

impl Releases for crate::Permit {
    fn release(self) -> impl std::future::Future<Output = Result<()>> {
        crate::Permit::release(self)
    }
}

impl DistSemaphore {
    pub(super) fn new(shared: Arc<Shared>, key: impl Into<String>, permits: u32) -> Self {
        let inner = crate::DistSemaphore::new(&shared.locker, key, permits);
        DistSemaphore { inner, shared }
    }

    /// The key it counts under.
    pub fn key(&self) -> &str {
        self.inner.key()
    }

    /// How many permits it has in all.
    pub fn permits(&self) -> u32 {
        self.inner.permits()
    }

    /// Takes one permit, waiting as the locker's defaults say.
    ///
    /// # Errors
    ///
    /// As [`crate::DistSemaphore::acquire`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn acquire(&self) -> Result<Permit> {
        self.acquire_many(1)
    }

    /// Takes `count` permits at once.
    ///
    /// # Errors
    ///
    /// As [`crate::DistSemaphore::acquire_many`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn acquire_many(&self, count: u32) -> Result<Permit> {
        let permit = self.shared.block_on(self.inner.acquire_many(count))??;
        Ok(Permit(Held::new(self.shared.clone(), permit)))
    }

    /// One attempt at one permit.
    ///
    /// # Errors
    ///
    /// As [`crate::DistSemaphore::try_acquire`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn try_acquire(&self) -> Result<Option<Permit>> {
        self.try_acquire_many(1)
    }

    /// One attempt at `count` permits.
    ///
    /// # Errors
    ///
    /// As [`crate::DistSemaphore::try_acquire_many`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn try_acquire_many(&self, count: u32) -> Result<Option<Permit>> {
        let permit = self.shared.block_on(self.inner.try_acquire_many(count))??;
        Ok(permit.map(|permit| Permit(Held::new(self.shared.clone(), permit))))
    }

    /// How many permits are free now.
    ///
    /// # Errors
    ///
    /// As [`crate::DistSemaphore::available`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn available(&self) -> Result<u32> {
        self.shared.block_on(self.inner.available())?
    }
}

impl fmt::Debug for DistSemaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

impl Permit {
    /// How many permits this holds.
    pub fn count(&self) -> u32 {
        self.0.get().count()
    }

    /// Gives the permits back and waits for the answer.
    ///
    /// # Errors
    ///
    /// As [`crate::Permit::release`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn release(self) -> Result<()> {
        self.0.release()
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.0.get(), f)
    }
}

/// A candidate in a leader election ([`crate::Election`]'s blocking twin),
/// from [`Locker::elect`](super::Locker::elect): it campaigns on the
/// runtime's thread; dropping it resigns and waits for the release (at
/// most [`DROP_WAIT`]).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// let locker = dlock::blocking::connect("memory")?;
/// let election = locker.elect("scheduler")?;
/// let leadership = election.lead()?; // blocks until this candidate leads
/// assert!(leadership.is_current());
/// assert_eq!(leadership.wait_lost(Duration::from_millis(10))?, None);
/// election.resign()?;
/// assert!(!leadership.is_current());
/// # Ok::<(), dlock::LockError>(())
/// ```
pub struct Election {
    inner: Option<crate::Election>,
    shared: Arc<Shared>,
}

/// One leadership of an [`Election`]: its term, and whether it still holds.
pub struct Leadership {
    inner: election::Leadership,
    shared: Arc<Shared>,
}

impl Election {
    pub(super) fn new(shared: Arc<Shared>, inner: crate::Election) -> Self {
        Election {
            inner: Some(inner),
            shared,
        }
    }

    fn get(&self) -> &crate::Election {
        self.inner.as_ref().expect("an election until resigned")
    }

    /// Blocks until this candidate leads; its leadership.
    ///
    /// # Errors
    ///
    /// As [`crate::Election::lead`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn lead(&self) -> Result<Leadership> {
        let inner = self.shared.block_on(self.get().lead())??;
        let shared = self.shared.clone();
        Ok(Leadership { inner, shared })
    }

    /// Whether this candidate leads now.
    pub fn is_leader(&self) -> bool {
        self.get().is_leader()
    }

    /// The term this candidate leads in, if it leads.
    pub fn term(&self) -> Option<u64> {
        self.get().term()
    }

    /// Publishes `value` as the leader's ([`crate::Election::proclaim`]).
    ///
    /// # Errors
    ///
    /// As [`crate::Election::proclaim`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn proclaim(&self, value: impl Into<Vec<u8>>) -> Result<bool> {
        self.shared.block_on(self.get().proclaim(value))?
    }

    /// Who leads now, and what it proclaimed.
    ///
    /// # Errors
    ///
    /// As [`crate::Election::leader`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn leader(&self) -> Result<Option<election::Leader>> {
        self.shared.block_on(self.get().leader())?
    }

    /// Leaves the election, releasing the leadership if it holds it, and
    /// waits for the release.
    ///
    /// # Errors
    ///
    /// As [`crate::Election::resign`], and [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn resign(mut self) -> Result<()> {
        let inner = self.inner.take().expect("an election until resigned");
        self.shared.block_on(inner.resign())?
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            if outside_runtime().is_ok() {
                within(self.shared.runtime(), DROP_WAIT, inner.resign());
            }
        }
    }
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("blocking::Election")
            .field(&self.inner)
            .finish()
    }
}

impl Leadership {
    /// The term: the fencing token to write with.
    pub fn term(&self) -> u64 {
        self.inner.term()
    }

    /// Whether this leadership still holds (checked now).
    pub fn is_current(&self) -> bool {
        self.inner.is_current()
    }

    /// Waits up to `limit` for this leadership to be lost: why, or `None`
    /// if it still holds then (or the candidate resigned).
    ///
    /// # Errors
    ///
    /// [`LockError::InsideRuntime`](crate::LockError::InsideRuntime).
    pub fn wait_lost(&self, limit: Duration) -> Result<Option<LostReason>> {
        outside_runtime()?;
        Ok(within(self.shared.runtime(), limit, self.inner.lost()).flatten())
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("blocking::Leadership")
            .field("term", &self.term())
            .finish_non_exhaustive()
    }
}

impl<T> DerefMut for DistMutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.get_mut()
    }
}

impl<T> DerefMut for DistRwLockWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.get_mut()
    }
}
