//! `DistSemaphore`: N permits shared across processes, each owned and
//! leased like a lock.

use std::{fmt, ops::Deref};

use crate::{
    backend::Mode, error::Result, locker::guard::LockGuard, locker::options::LockOptions,
    locker::Locker,
};

/// A counting semaphore across processes and machines: at most `permits`
/// permits of its key are held at once, by every client together. Used
/// like [`tokio::sync::Semaphore`]: "at most 5 workers call this API at
/// once".
///
/// Unlike a counter on a server, every permit has an owner (a token) and a
/// lease, renewed by the watchdog while its guard lives: a crashed holder's
/// permits come back when its lease runs out, never before and never lost
/// for good. Waiters are served first come, first served where the backend
/// is FIFO: a waiter for 3 permits is not passed by later waiters for 1. A
/// wait that is dropped leaves no permit and no place in the queue behind.
///
/// The permit count is part of the semaphore: every client of one key must
/// name the same `permits`. One that names another count, while anyone holds
/// or waits, gets [`LockError::InvalidOptions`](crate::LockError::InvalidOptions).
///
/// A key's semaphore is its own object, apart from the key's plain lock and
/// read-write lock.
///
/// # Examples
///
/// ```
/// use dlock_core::{DistSemaphore, Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let api = DistSemaphore::new(&locker, "partner-api", 5);
/// let permit = api.acquire().await?;
/// // ... call the API, at most 5 callers at once across every process ...
/// permit.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct DistSemaphore {
    locker: Locker,
    key: String,
    permits: u32,
    options: LockOptions,
}

impl DistSemaphore {
    /// A semaphore of `permits` permits on `key`, through `locker`, with the
    /// locker's default options. A count of 0 is an error at the first
    /// acquire.
    pub fn new(locker: &Locker, key: impl Into<String>, permits: u32) -> Self {
        Self::with_options(locker, key, permits, LockOptions::new())
    }

    /// A semaphore whose acquires use `options` (unset ones take the
    /// locker's defaults): a wait limit, a fixed lease.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistSemaphore, Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// let opts = LockOptions::new().wait(Duration::from_secs(2));
    /// let pool = DistSemaphore::with_options(&locker, "workers", 8, opts);
    /// assert_eq!(pool.permits(), 8);
    /// ```
    pub fn with_options(
        locker: &Locker,
        key: impl Into<String>,
        permits: u32,
        options: LockOptions,
    ) -> Self {
        DistSemaphore {
            locker: locker.clone(),
            key: key.into(),
            permits,
            options,
        }
    }

    /// The semaphore's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How many permits the semaphore has.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// Takes one permit, waiting within the wait limit.
    ///
    /// # Errors
    ///
    /// As [`acquire_many`](DistSemaphore::acquire_many).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped wait leaves no permit and no queue entry.
    pub async fn acquire(&self) -> Result<Permit> {
        self.acquire_many(1).await
    }

    /// Takes `count` permits at once, waiting within the wait limit.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](crate::LockError::InvalidOptions) unless `1 <= count <= permits`, or if
    /// the semaphore's holders name another permit count;
    /// [`LockError::Timeout`](crate::LockError::Timeout) when the wait limit passes;
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) if the backend has no semaphores;
    /// otherwise as [`Locker::lock`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistSemaphore, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let cpu = DistSemaphore::new(&locker, "render-farm", 8);
    /// let big_job = cpu.acquire_many(6).await?;
    /// assert_eq!(big_job.count(), 6);
    /// assert!(cpu.try_acquire_many(3).await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn acquire_many(&self, count: u32) -> Result<Permit> {
        let mode = Mode::permits(count, self.permits)?;
        let guard = self.locker.lock_mode(&self.key, mode, self.options).await?;
        Ok(Permit { guard, count })
    }

    /// One attempt at one permit: `Ok(None)` if none is free now, or if
    /// others wait first.
    ///
    /// # Errors
    ///
    /// As [`acquire_many`](DistSemaphore::acquire_many), without `Timeout`.
    pub async fn try_acquire(&self) -> Result<Option<Permit>> {
        self.try_acquire_many(1).await
    }

    /// One attempt at `count` permits.
    ///
    /// # Errors
    ///
    /// As [`acquire_many`](DistSemaphore::acquire_many), without `Timeout`.
    pub async fn try_acquire_many(&self, count: u32) -> Result<Option<Permit>> {
        let mode = Mode::permits(count, self.permits)?;
        let guard = self
            .locker
            .try_lock_mode(&self.key, mode, self.options)
            .await?;
        Ok(guard.map(|guard| Permit { guard, count }))
    }
}

impl DistSemaphore {
    /// How many permits are free now, read from the servers without
    /// taking any: the limit less the permits held. A snapshot, for
    /// dashboards and back pressure: another client may take or give back
    /// permits before it is used; to take one, [`try_acquire`](Self::try_acquire).
    ///
    /// # Errors
    ///
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) from a
    /// backend without semaphores; the backend's error if its servers
    /// cannot be read.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistSemaphore, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let pool = DistSemaphore::new(&locker, "db-connections", 3);
    /// let held = pool.acquire_many(2).await?;
    /// assert_eq!(pool.available().await?, 1);
    /// held.release().await?;
    /// assert_eq!(pool.available().await?, 3);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn available(&self) -> Result<u32> {
        let key = crate::LockKey::new(&self.key)?;
        let backend = self.locker.backend();
        if !backend
            .capabilities()
            .supports(Mode::Permits { count: 1, limit: 1 })
        {
            return Err(crate::LockError::Unsupported {
                backend: backend.name(),
                what: "semaphores",
            });
        }
        let taken = backend.permits_taken(&key, self.permits).await?;
        Ok(self.permits.saturating_sub(taken))
    }
}

impl fmt::Debug for DistSemaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistSemaphore")
            .field("key", &self.key)
            .field("permits", &self.permits)
            .finish_non_exhaustive()
    }
}

/// Permits of a [`DistSemaphore`], held until dropped or
/// [released](Permit::release).
///
/// It derefs to its [`LockGuard`]: [`is_lost`](LockGuard::is_lost),
/// [`lost`](LockGuard::lost) and the other signals work as for a lock. Its
/// [fencing token](LockGuard::fencing_token) orders acquisitions of the
/// semaphore, but several permits are held at once, so it does not prove
/// its holder alone.
///
/// # Examples
///
/// ```
/// use dlock_core::{DistSemaphore, Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let permit = DistSemaphore::new(&locker, "uploads", 3).acquire().await?;
/// assert!(!permit.is_lost());
/// drop(permit); // released on drop, as a lock is
/// # Ok(())
/// # }
/// ```
#[must_use = "if unused the permits are given back at once"]
#[derive(Debug)]
pub struct Permit {
    guard: LockGuard,
    count: u32,
}

impl Permit {
    /// How many permits this holds.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Gives the permits back now and reports the result (see
    /// [`LockGuard::release`]).
    ///
    /// # Errors
    ///
    /// [`LockError::Lost`](crate::LockError::Lost) if the permits were lost before; the backend's
    /// error if the release failed (it is sent again in the background).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn release(self) -> Result<()> {
        self.guard.release().await
    }

    /// The underlying guard.
    pub fn into_guard(self) -> LockGuard {
        self.guard
    }
}

impl Deref for Permit {
    type Target = LockGuard;

    fn deref(&self) -> &LockGuard {
        &self.guard
    }
}
