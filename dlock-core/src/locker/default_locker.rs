//! The process-wide default locker, which `#[distributed_lock]` uses when it
//! is given no `locker = ...`.

use std::sync::RwLock;

use crate::{
    error::{LockError, Result},
    locker::Locker,
};

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
