//! `LockerBuilder`, and `BackendExt::into_locker`.

use std::{sync::Arc, time::Duration};

use crate::{
    backend::{Backend, DynBackend},
    error::Result,
    locker::options::{validate_lease, Lease, LockOptions, MIN_LEASE, MIN_WATCHDOG_LEASE},
    locker::shared::{PendingReleases, Shared},
    locker::watchdog::Watchdog,
    locker::{Locker, DEFAULT_WATCHDOG_LEASE},
};

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
    backend: Arc<dyn DynBackend>,
    defaults: LockOptions,
    watchdog_lease: Duration,
    trace_keys: bool,
}

impl LockerBuilder {
    /// A builder over a shared backend.
    pub fn from_arc(backend: Arc<dyn DynBackend>) -> Self {
        LockerBuilder {
            backend,
            defaults: LockOptions::new().wait_forever().watchdog(),
            watchdog_lease: DEFAULT_WATCHDOG_LEASE,
            trace_keys: true,
        }
    }

    /// Whether traces (the `dlock.acquire` and `dlock.hold` spans, and the
    /// lost and re-entered events) show lock keys (default: yes). Keys may
    /// hold personal data (`user:{email}`); with `false` they show
    /// `(hidden)`. Errors returned to the caller still name the key.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{LockerBuilder, MemoryBackend};
    /// use std::sync::Arc;
    ///
    /// let locker = LockerBuilder::from_arc(Arc::new(MemoryBackend::new()))
    ///     .trace_keys(false)
    ///     .build()?;
    /// # drop(locker);
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn trace_keys(mut self, shown: bool) -> Self {
        self.trace_keys = shown;
        self
    }

    /// Waits `limit` by default (see [`LockOptions::wait`](crate::LockOptions::wait)).
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

    /// Keeps a key from everyone `delay` past a loss without a release, by
    /// default (see [`LockOptions::lock_delay`](crate::LockOptions::lock_delay)).
    /// [`build`](LockerBuilder::build) checks it against the backend.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{LockError, Locker, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// let careful = Locker::builder(MemoryBackend::new())
    ///     .lock_delay(Duration::from_secs(15))
    ///     .build()?;
    /// # drop(careful);
    /// let too_long = Locker::builder(MemoryBackend::new())
    ///     .lock_delay(Duration::from_secs(61))
    ///     .build();
    /// assert!(matches!(too_long, Err(LockError::InvalidOptions { .. })));
    /// # Ok::<(), LockError>(())
    /// ```
    pub fn lock_delay(mut self, delay: Duration) -> Self {
        self.defaults = self.defaults.lock_delay(delay);
        self
    }

    /// Serves waiters in order (`true`) or lets whoever asks first win
    /// (`false`), by default (see [`LockOptions::fair`](crate::LockOptions::fair)).
    pub fn fair(mut self, fair: bool) -> Self {
        self.defaults = self.defaults.fair(fair);
        self
    }

    /// The note every lock of this locker carries unless its options say
    /// another (see [`LockOptions::holder_note`](crate::LockOptions::holder_note)).
    pub fn holder_note(mut self, note: impl AsRef<str>) -> Self {
        self.defaults = self.defaults.holder_note(note);
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
    /// [`LockError::InvalidOptions`](crate::LockError::InvalidOptions) if a
    /// default is out of range;
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) for a
    /// default `lock_delay` or `hold_at_least` the backend cannot keep.
    pub fn build(self) -> Result<Locker> {
        validate_lease(self.watchdog_lease, MIN_WATCHDOG_LEASE)?;
        self.defaults.get_holder_note()?;
        crate::locker::acquire::server_lease_options(&*self.backend, self.defaults)?;
        if let Some(Lease::Fixed(lease)) = self.defaults.get_lease() {
            validate_lease(lease, MIN_LEASE)?;
        }
        Ok(Locker::from_shared(Shared {
            watchdog: Watchdog::new(self.watchdog_lease, self.backend.clone()),
            backend: self.backend,
            defaults: self.defaults,
            pending: PendingReleases::default(),
            trace_keys: self.trace_keys,
        }))
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
pub trait BackendExt: Backend + Sized + 'static {
    /// A locker over this backend with the default options.
    fn into_locker(self) -> Locker {
        Locker::new(self)
    }
}

impl<B: Backend + 'static> BackendExt for B {}

/// The constructors of [`Locker`] live here, beside the builder they use,
/// so that `locker` does not import `builder` back.
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
    pub fn new(backend: impl Backend + 'static) -> Locker {
        Locker::from_arc(Arc::new(backend))
    }

    /// A locker over a shared backend, with the default options.
    pub fn from_arc(backend: Arc<dyn DynBackend>) -> Locker {
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
    pub fn builder(backend: impl Backend + 'static) -> LockerBuilder {
        LockerBuilder::from_arc(Arc::new(backend))
    }
}
