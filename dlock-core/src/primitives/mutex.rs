//! `DistMutex<T>`: a value behind a distributed lock, used like
//! `tokio::sync::Mutex<T>`.

use std::{
    cell::UnsafeCell,
    fmt,
    future::Future,
    ops::{Deref, DerefMut},
    sync::Arc,
};

use tokio::{sync::Semaphore, time::Instant};

use crate::{
    error::{LockError, Result},
    locker::guard::LockGuard,
    locker::options::{wait_deadline, LockOptions},
    locker::scope::Scoped,
    locker::Locker,
};

/// A value protected by a distributed lock: like [`tokio::sync::Mutex<T>`],
/// but exclusive across processes and machines.
///
/// [`lock`](DistMutex::lock) returns a guard that derefs to `T` while this
/// process holds the distributed lock on the mutex's key. Use it when the
/// state a critical section touches lives in this process (a cache, a local
/// connection, a counter) and the exclusion must cover every process that
/// locks the same key. For state that lives only in the lock service's
/// world (an external store), a data-less [`Locker::lock`] is enough.
///
/// Tasks of one process contending one `DistMutex` queue locally first, in
/// FIFO order, so only one of them at a time talks to the backend.
///
/// # Re-locking
///
/// `DistMutex` is never reentrant, because a second guard would be a second
/// `&mut T`. Inside the scope of a hold of its key through the same locker
/// (a `#[distributed_lock]` body on that key, [`DistMutexGuard::scope`],
/// [`LockGuard::scope`], [`Locker::with_lock`]), locking it returns
/// [`LockError::WouldDeadlock`] at once instead of waiting for itself.
///
/// Outside a scope it behaves as `tokio::sync::Mutex` does: locking it again
/// while a guard lives, even in the same task, waits for that guard (up to
/// the wait limit). That is what makes futures joined in one task exclude
/// each other. Run code that may lock the mutex again inside the guard's
/// [scope](DistMutexGuard::scope) to get the error instead.
///
/// # Examples
///
/// ```
/// use dlock_core::{DistMutex, Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let stock = DistMutex::new(&locker, "stock:42", 300_u32);
///
/// let mut left = stock.lock().await?;
/// *left -= 1;
/// assert_eq!(*left, 299);
/// drop(left);
/// # Ok(())
/// # }
/// ```
pub struct DistMutex<T> {
    locker: Locker,
    key: String,
    options: LockOptions,
    /// One permit: the local queue in front of the backend.
    local: Semaphore,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and at most one guard
// exists at a time (the local permit), so sharing the mutex between threads
// moves `T` between them but never shares it: `T: Send` suffices, as for
// `tokio::sync::Mutex`.
unsafe impl<T: Send> Send for DistMutex<T> {}
// SAFETY: see above.
unsafe impl<T: Send> Sync for DistMutex<T> {}

impl<T> DistMutex<T> {
    /// A mutex over `value`, locked through `locker` on `key`, with the
    /// locker's default options.
    ///
    /// The key is checked when the mutex is first locked.
    pub fn new(locker: &Locker, key: impl Into<String>, value: T) -> Self {
        Self::with_options(locker, key, value, LockOptions::new())
    }

    /// A mutex whose locks use `options` (unset ones take the locker's
    /// defaults).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistMutex, Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// let opts = LockOptions::new().wait(Duration::from_secs(3));
    /// let cache = DistMutex::with_options(&locker, "cache:refresh", Vec::<u8>::new(), opts);
    /// assert_eq!(cache.key(), "cache:refresh");
    /// ```
    pub fn with_options(
        locker: &Locker,
        key: impl Into<String>,
        value: T,
        options: LockOptions,
    ) -> Self {
        DistMutex {
            locker: locker.clone(),
            key: key.into(),
            options,
            local: Semaphore::new(1),
            value: UnsafeCell::new(value),
        }
    }

    /// The key of the distributed lock.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Locks the mutex: first locally, then on the backend, within the wait
    /// limit as a whole.
    ///
    /// # Errors
    ///
    /// [`LockError::WouldDeadlock`] inside the scope of a hold of the key
    /// (see [Re-locking](DistMutex#re-locking)); otherwise as
    /// [`Locker::lock`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future gives up its place in the local queue
    /// and leaves nothing on the server.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistMutex, DistMutexGuard, LockError, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let m = DistMutex::new(&locker, "counter", 0);
    /// let mut g = m.lock().await?;
    /// *g += 1;
    /// // Inside the guard's scope, a second lock is refused rather than
    /// // waiting for itself:
    /// DistMutexGuard::scope(&g, async {
    ///     assert!(matches!(m.lock().await, Err(LockError::WouldDeadlock { .. })));
    /// })
    /// .await;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock(&self) -> Result<DistMutexGuard<'_, T>> {
        let start = Instant::now();
        match self.acquire(false).await? {
            Some(lock) => Ok(DistMutexGuard {
                mutex: self,
                lock: Some(lock),
            }),
            None => Err(self.timeout(start)),
        }
    }

    /// One attempt: `Ok(None)` if another task or process holds the lock.
    ///
    /// # Errors
    ///
    /// As [`lock`](DistMutex::lock), without `Timeout`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistMutex, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let m = DistMutex::new(&locker, "k", ());
    /// assert!(m.try_lock().await?.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_lock(&self) -> Result<Option<DistMutexGuard<'_, T>>> {
        Ok(self.acquire(true).await?.map(|lock| DistMutexGuard {
            mutex: self,
            lock: Some(lock),
        }))
    }

    /// Locks the mutex behind an `Arc`, for a guard that is `'static`.
    ///
    /// # Errors
    ///
    /// As [`lock`](DistMutex::lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistMutex, Locker, MemoryBackend};
    /// use std::sync::Arc;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let m = Arc::new(DistMutex::new(&locker, "k", 1));
    /// let g = m.clone().lock_owned().await?;
    /// tokio::spawn(async move { assert_eq!(*g, 1) }).await.unwrap();
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_owned(self: Arc<Self>) -> Result<OwnedDistMutexGuard<T>> {
        let start = Instant::now();
        match self.acquire(false).await? {
            Some(lock) => Ok(OwnedDistMutexGuard {
                mutex: self,
                lock: Some(lock),
            }),
            None => Err(self.timeout(start)),
        }
    }

    /// [`try_lock`](DistMutex::try_lock) for a mutex behind an `Arc`.
    ///
    /// # Errors
    ///
    /// As [`try_lock`](DistMutex::try_lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistMutex, Locker, MemoryBackend};
    /// use std::sync::Arc;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let m = Arc::new(DistMutex::new(&locker, "k", 1));
    /// assert!(m.try_lock_owned().await?.is_some());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_lock_owned(self: Arc<Self>) -> Result<Option<OwnedDistMutexGuard<T>>> {
        Ok(self.acquire(true).await?.map(|lock| OwnedDistMutexGuard {
            mutex: self,
            lock: Some(lock),
        }))
    }

    /// The value, through exclusive access to the mutex: no lock is taken.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{DistMutex, Locker, MemoryBackend};
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// let mut m = DistMutex::new(&locker, "k", 1);
    /// *m.get_mut() += 1;
    /// assert_eq!(m.into_inner(), 2);
    /// ```
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    /// The value, consuming the mutex.
    pub fn into_inner(self) -> T {
        self.value.into_inner()
    }

    fn timeout(&self, start: Instant) -> LockError {
        LockError::Timeout {
            key: self.key.clone(),
            waited: start.elapsed(),
        }
    }

    /// Takes the local turn, then the distributed lock. `Ok(None)` when the
    /// wait limit passed (or, with `once`, when either was busy).
    async fn acquire(&self, once: bool) -> Result<Option<LockGuard>> {
        if self.locker.is_held_in_scope(&self.key) {
            return Err(LockError::WouldDeadlock {
                key: self.key.clone(),
            });
        }
        let start = Instant::now();
        let wait = self.options.or(self.locker.defaults()).get_wait().flatten();
        let deadline = wait_deadline(start, wait);
        let permit = if once {
            self.local.try_acquire().ok()
        } else {
            let turn = self.local.acquire();
            match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, turn)
                    .await
                    .ok()
                    .and_then(Result::ok),
                None => turn.await.ok(),
            }
        };
        // The semaphore is never closed, so no permit means busy or timed out.
        let Some(permit) = permit else {
            return Ok(None);
        };
        permit.forget();
        let turn = LocalTurn(self);
        let remote = if once {
            self.locker.try_lock_with(&self.key, self.options).await
        } else {
            let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let options = match remaining {
                Some(left) => self.options.wait(left),
                None => self.options.wait_forever(),
            };
            match self.locker.lock_with(&self.key, options).await {
                Ok(lock) => Ok(Some(lock)),
                Err(LockError::Timeout { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        };
        if let Ok(Some(_)) = remote {
            // The guard gives the turn back when it goes.
            std::mem::forget(turn);
        }
        remote
    }

    fn unlock_local(&self) {
        self.local.add_permits(1);
    }
}

/// The local turn, given back if the distributed lock is not taken.
struct LocalTurn<'a, T>(&'a DistMutex<T>);

impl<T> Drop for LocalTurn<'_, T> {
    fn drop(&mut self) {
        self.0.unlock_local();
    }
}

impl<T: fmt::Debug> fmt::Debug for DistMutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("DistMutex");
        d.field("key", &self.key);
        match self.local.try_acquire() {
            Ok(_permit) => {
                // SAFETY: holding the only local permit, nobody holds a guard.
                d.field("value", unsafe { &*self.value.get() })
            }
            Err(_) => d.field("value", &format_args!("<locked>")),
        };
        d.finish()
    }
}

/// Shared helpers of both guard kinds; associated functions, so they never
/// shadow methods of `T`.
macro_rules! guard_helpers {
    () => {
        /// The distributed lock's guard: fencing token, loss signal.
        pub fn lock_guard(this: &Self) -> &LockGuard {
            this.lock.as_ref().expect("present until release")
        }

        /// This acquisition's fencing token (see [`LockGuard::fencing_token`]).
        pub fn fencing_token(this: &Self) -> Option<u64> {
            Self::lock_guard(this).fencing_token()
        }

        /// Whether the distributed lock has been lost (see [`LockGuard::is_lost`]).
        pub fn is_lost(this: &Self) -> bool {
            Self::lock_guard(this).is_lost()
        }

        /// Runs `future` inside the scope of this guard's lock (see
        /// [`LockGuard::scope`]): locking the mutex there returns
        /// [`LockError::WouldDeadlock`] at once, and a plain lock of its key
        /// through the same locker re-enters.
        pub fn scope<F: Future>(this: &Self, future: F) -> Scoped<'_, F> {
            Self::lock_guard(this).scope(future)
        }
    };
}

/// The guard of [`DistMutex::lock`]: derefs to `T`.
///
/// Dropping it releases the distributed lock (see [`LockGuard`] for when that
/// reaches the server) and lets the next local task in. Its helpers are
/// associated functions (`DistMutexGuard::fencing_token(&guard)`), so they
/// never shadow methods of `T`.
///
/// # Examples
///
/// ```
/// use dlock_core::{DistMutex, DistMutexGuard, Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let m = DistMutex::new(&locker, "k", String::from("a"));
/// let mut g = m.lock().await?;
/// g.push('b');
/// assert!(DistMutexGuard::fencing_token(&g).is_some());
/// DistMutexGuard::release(g).await?;
/// # Ok(())
/// # }
/// ```
#[must_use = "if unused the lock will immediately unlock"]
#[clippy::has_significant_drop]
pub struct DistMutexGuard<'a, T> {
    mutex: &'a DistMutex<T>,
    lock: Option<LockGuard>,
}

// SAFETY: sharing the guard shares `&T`, which needs `T: Sync`.
unsafe impl<T: Send + Sync> Sync for DistMutexGuard<'_, T> {}

impl<T> DistMutexGuard<'_, T> {
    guard_helpers!();

    /// Releases the distributed lock now and reports the result (see
    /// [`LockGuard::release`]).
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn release(mut this: Self) -> Result<()> {
        let lock = this.lock.take();
        // Give the local turn back after the server has the lock back (and
        // even if this future is dropped), so the next local task does not
        // find it still held.
        let _turn = LocalTurn(this.mutex);
        std::mem::forget(this);
        match lock {
            Some(lock) => lock.release().await,
            None => Ok(()),
        }
    }
}

impl<T> Drop for DistMutexGuard<'_, T> {
    fn drop(&mut self) {
        drop(self.lock.take());
        self.mutex.unlock_local();
    }
}

impl<T> Deref for DistMutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the only local permit.
        unsafe { &*self.mutex.value.get() }
    }
}

impl<T> DerefMut for DistMutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the only local permit.
        unsafe { &mut *self.mutex.value.get() }
    }
}

impl<T: fmt::Debug> fmt::Debug for DistMutexGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

/// The guard of [`DistMutex::lock_owned`]: like [`DistMutexGuard`], but
/// holds an `Arc` of the mutex, so it is `'static`.
///
/// # Examples
///
/// ```
/// use dlock_core::{DistMutex, Locker, MemoryBackend, OwnedDistMutexGuard};
/// use std::sync::Arc;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let m = Arc::new(DistMutex::new(&locker, "k", 0_u64));
/// let mut g = m.lock_owned().await?;
/// *g += 1;
/// assert!(!OwnedDistMutexGuard::is_lost(&g));
/// # Ok(())
/// # }
/// ```
#[must_use = "if unused the lock will immediately unlock"]
#[clippy::has_significant_drop]
pub struct OwnedDistMutexGuard<T> {
    mutex: Arc<DistMutex<T>>,
    lock: Option<LockGuard>,
}

// SAFETY: sharing the guard shares `&T`, which needs `T: Sync`.
unsafe impl<T: Send + Sync> Sync for OwnedDistMutexGuard<T> {}

impl<T> OwnedDistMutexGuard<T> {
    guard_helpers!();

    /// The mutex this guard locks.
    pub fn mutex(this: &Self) -> &Arc<DistMutex<T>> {
        &this.mutex
    }

    /// Releases the distributed lock now and reports the result.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn release(mut this: Self) -> Result<()> {
        let lock = this.lock.take();
        let result = match lock {
            Some(lock) => lock.release().await,
            None => Ok(()),
        };
        drop(this);
        result
    }
}

impl<T> Drop for OwnedDistMutexGuard<T> {
    fn drop(&mut self) {
        drop(self.lock.take());
        self.mutex.unlock_local();
    }
}

impl<T> Deref for OwnedDistMutexGuard<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the only local permit.
        unsafe { &*self.mutex.value.get() }
    }
}

impl<T> DerefMut for OwnedDistMutexGuard<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the only local permit.
        unsafe { &mut *self.mutex.value.get() }
    }
}

impl<T: fmt::Debug> fmt::Debug for OwnedDistMutexGuard<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: &T) {}
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn guards_and_futures_are_send() {
        assert_send_sync::<DistMutex<u32>>();
        assert_send_sync::<DistMutexGuard<'static, u32>>();
        assert_send_sync::<OwnedDistMutexGuard<u32>>();
        let locker = Locker::new(crate::MemoryBackend::new());
        let m = Arc::new(DistMutex::new(&locker, "k", 0_u32));
        assert_send(&m.lock());
        assert_send(&m.try_lock());
        assert_send(&m.clone().lock_owned());
        assert_send(&locker.lock("k"));
    }
}
