//! `DistRwLock<T>`: a value behind a distributed read-write lock, used like
//! `tokio::sync::RwLock<T>`.

use std::{
    cell::UnsafeCell,
    fmt,
    ops::{Deref, DerefMut},
};

use tokio::{
    sync::{RwLock, RwLockReadGuard, RwLockWriteGuard},
    time::Instant,
};

use crate::{
    backend::Mode,
    error::{LockError, Result},
    locker::guard::LockGuard,
    locker::options::{wait_deadline, LockOptions},
    locker::Locker,
};

/// A value protected by a distributed read-write lock: like
/// [`tokio::sync::RwLock<T>`], but across processes and machines. Readers
/// share it, a writer has it alone, and a writer that waits keeps new
/// readers out, so a stream of readers cannot starve it.
///
/// Tasks of one process queue locally first (on a `tokio::sync::RwLock`,
/// fair in the same way), then take the distributed lock. The wait limit
/// covers both. A key's read-write lock is its own object, apart from the
/// key's plain lock and semaphore. It is not reentrant: a read or a write
/// taken again while a write guard of the same lock lives waits for it.
///
/// # Examples
///
/// ```
/// use dlock_core::{DistRwLock, Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let config = DistRwLock::new(&locker, "config", String::from("v1"));
/// {
///     let (a, b) = (config.read().await?, config.read().await?);
///     assert_eq!((a.as_str(), b.as_str()), ("v1", "v1"));
/// }
/// *config.write().await? = String::from("v2");
/// assert_eq!(*config.read().await?, "v2");
/// # Ok(())
/// # }
/// ```
pub struct DistRwLock<T> {
    locker: Locker,
    key: String,
    options: LockOptions,
    local: RwLock<()>,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through guards: shared ones (`&T`)
// while local read guards live, and one exclusive one (`&mut T`) while the
// local write guard lives, as in `tokio::sync::RwLock`, which needs the
// same bounds.
unsafe impl<T: Send> Send for DistRwLock<T> {}
// SAFETY: see above.
unsafe impl<T: Send + Sync> Sync for DistRwLock<T> {}

impl<T> DistRwLock<T> {
    /// A read-write lock over `value` on `key`, through `locker`, with the
    /// locker's default options.
    pub fn new(locker: &Locker, key: impl Into<String>, value: T) -> Self {
        Self::with_options(locker, key, value, LockOptions::new())
    }

    /// A read-write lock whose acquires use `options` (unset ones take the
    /// locker's defaults).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistRwLock, Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// let opts = LockOptions::new().wait(Duration::from_secs(2));
    /// let cache = DistRwLock::with_options(&locker, "cache", 0_u64, opts);
    /// assert_eq!(cache.key(), "cache");
    /// ```
    pub fn with_options(
        locker: &Locker,
        key: impl Into<String>,
        value: T,
        options: LockOptions,
    ) -> Self {
        DistRwLock {
            locker: locker.clone(),
            key: key.into(),
            options,
            local: RwLock::new(()),
            value: UnsafeCell::new(value),
        }
    }

    /// The key of the distributed lock.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Takes a read share, waiting within the wait limit.
    ///
    /// # Errors
    ///
    /// [`LockError::Timeout`] when the wait limit passes;
    /// [`LockError::Unsupported`] if the backend has no read-write locks;
    /// [`LockError::WouldDeadlock`] at once inside the scope of a share of
    /// this lock (a guard's [`scope`](LockGuard::scope)), as
    /// [`DistMutex`](crate::DistMutex) does; otherwise as [`Locker::lock`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped wait leaves nothing behind, locally or on the
    /// server.
    pub async fn read(&self) -> Result<DistRwLockReadGuard<'_, T>> {
        self.refuse_in_own_scope()?;
        let start = Instant::now();
        let deadline = self.deadline(start);
        let local = match deadline {
            Some(d) => tokio::time::timeout_at(d, self.local.read())
                .await
                .map_err(|_| self.timeout(start))?,
            None => self.local.read().await,
        };
        let lock = self.remote(Mode::Read, deadline, start).await?;
        Ok(DistRwLockReadGuard {
            _local: local,
            lock,
            value: self,
        })
    }

    /// One attempt at a read share: `Ok(None)` if a writer holds or waits.
    ///
    /// # Errors
    ///
    /// As [`read`](DistRwLock::read), without `Timeout`.
    pub async fn try_read(&self) -> Result<Option<DistRwLockReadGuard<'_, T>>> {
        self.refuse_in_own_scope()?;
        let Ok(local) = self.local.try_read() else {
            return Ok(None);
        };
        let lock = self
            .locker
            .try_lock_mode(&self.key, Mode::Read, self.options)
            .await?;
        Ok(lock.map(|lock| DistRwLockReadGuard {
            _local: local,
            lock,
            value: self,
        }))
    }

    /// Takes the lock to write, alone, waiting within the wait limit.
    ///
    /// # Errors
    ///
    /// As [`read`](DistRwLock::read).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn write(&self) -> Result<DistRwLockWriteGuard<'_, T>> {
        self.refuse_in_own_scope()?;
        let start = Instant::now();
        let deadline = self.deadline(start);
        let local = match deadline {
            Some(d) => tokio::time::timeout_at(d, self.local.write())
                .await
                .map_err(|_| self.timeout(start))?,
            None => self.local.write().await,
        };
        let lock = self.remote(Mode::Write, deadline, start).await?;
        Ok(DistRwLockWriteGuard {
            _local: local,
            lock,
            value: self,
        })
    }

    /// One attempt to write: `Ok(None)` if anyone holds the lock.
    ///
    /// # Errors
    ///
    /// As [`read`](DistRwLock::read), without `Timeout`.
    pub async fn try_write(&self) -> Result<Option<DistRwLockWriteGuard<'_, T>>> {
        self.refuse_in_own_scope()?;
        let Ok(local) = self.local.try_write() else {
            return Ok(None);
        };
        let lock = self
            .locker
            .try_lock_mode(&self.key, Mode::Write, self.options)
            .await?;
        Ok(lock.map(|lock| DistRwLockWriteGuard {
            _local: local,
            lock,
            value: self,
        }))
    }

    /// The value, through an exclusive borrow: no lock is needed.
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    /// The value, consuming the lock.
    pub fn into_inner(self) -> T {
        self.value.into_inner()
    }

    fn deadline(&self, start: Instant) -> Option<Instant> {
        let wait = self.options.or(self.locker.defaults()).get_wait().flatten();
        wait_deadline(start, wait)
    }

    fn timeout(&self, start: Instant) -> LockError {
        LockError::Timeout {
            key: self.key.clone(),
            waited: start.elapsed(),
        }
    }

    /// The distributed lock, within what is left of the wait limit.
    /// [`LockError::WouldDeadlock`] inside the scope of a read or write
    /// share of this lock: a read or write there would wait for the
    /// scope's own hold (the local lock, or a writer queued behind it) for
    /// ever. The key's plain lock and semaphore are other objects.
    fn refuse_in_own_scope(&self) -> Result<()> {
        if self.locker.holds_share_in_scope(&self.key) {
            return Err(LockError::WouldDeadlock {
                key: self.key.clone(),
            });
        }
        Ok(())
    }

    async fn remote(
        &self,
        mode: Mode,
        deadline: Option<Instant>,
        start: Instant,
    ) -> Result<LockGuard> {
        let options = match deadline {
            Some(d) => self
                .options
                .wait(d.saturating_duration_since(Instant::now())),
            None => self.options.wait_forever(),
        };
        self.locker
            .lock_mode(&self.key, mode, options)
            .await
            .map_err(|e| match e {
                LockError::Timeout { .. } => self.timeout(start),
                e => e,
            })
    }
}

impl<T: fmt::Debug> fmt::Debug for DistRwLock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistRwLock")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// A read share of a [`DistRwLock`]: derefs to `&T`. Its lock guard
/// ([`DistRwLockReadGuard::lock_guard`]) has the loss signal and a fencing
/// token greater than every earlier writer's.
#[must_use = "if unused the lock is released at once"]
pub struct DistRwLockReadGuard<'a, T> {
    _local: RwLockReadGuard<'a, ()>,
    lock: LockGuard,
    value: &'a DistRwLock<T>,
}

/// The lock to write of a [`DistRwLock`]: derefs to `&mut T`. Its lock
/// guard ([`DistRwLockWriteGuard::lock_guard`]) carries a fencing token,
/// as a plain lock's does.
#[must_use = "if unused the lock is released at once"]
pub struct DistRwLockWriteGuard<'a, T> {
    _local: RwLockWriteGuard<'a, ()>,
    lock: LockGuard,
    value: &'a DistRwLock<T>,
}

macro_rules! rw_guard {
    ($guard:ident) => {
        impl<T> $guard<'_, T> {
            /// The distributed lock's guard: fencing token, loss signal.
            /// An associated function, so it never shadows a method of `T`.
            pub fn lock_guard(this: &Self) -> &LockGuard {
                &this.lock
            }

            /// Releases the distributed lock now and reports the result
            /// (see [`LockGuard::release`]); the local lock goes after it.
            ///
            /// # Errors
            ///
            /// As [`LockGuard::release`].
            pub async fn release(this: Self) -> Result<()> {
                let $guard { _local, lock, .. } = this;
                let released = lock.release().await;
                drop(_local);
                released
            }
        }

        impl<T> Deref for $guard<'_, T> {
            type Target = T;

            fn deref(&self) -> &T {
                // SAFETY: a local read or write guard lives as long as this
                // guard, so no `&mut T` exists meanwhile.
                unsafe { &*self.value.value.get() }
            }
        }

        impl<T: fmt::Debug> fmt::Debug for $guard<'_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($guard))
                    .field("value", &**self)
                    .field("lock", &self.lock)
                    .finish()
            }
        }
    };
}

rw_guard!(DistRwLockReadGuard);
rw_guard!(DistRwLockWriteGuard);

impl<T> DerefMut for DistRwLockWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the local write guard lives as long as this guard: no
        // other guard of this lock exists in this process meanwhile.
        unsafe { &mut *self.value.value.get() }
    }
}
