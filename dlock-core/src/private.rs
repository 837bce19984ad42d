//! What `#[distributed_lock]`'s expansion calls. Not a public API: names
//! and signatures here change without notice.

use std::{borrow::Borrow, future::Future};

pub use std::time::Duration;

pub use crate::{LockError, LockGuard, LockOptions, Locker, Scoped};

/// The locker a `locker = <expr>` argument names. Called as a method, so
/// that auto-deref reaches a `Locker` through `&`, `Arc` and friends.
pub trait AsLocker {
    /// The locker.
    fn __dlock_as_locker(&self) -> &Locker;
}

impl AsLocker for Locker {
    fn __dlock_as_locker(&self) -> &Locker {
        self
    }
}

/// The default locker, for an attribute without `locker = ...`.
pub fn default_locker() -> Result<Locker, LockError> {
    crate::default_locker()
}

/// Takes the lock for an annotated fn; `once` is `wait = "none"`.
pub async fn acquire<L: Borrow<Locker>>(
    locker: Result<L, LockError>,
    key: String,
    options: LockOptions,
    once: bool,
) -> Result<LockGuard, LockError> {
    let locker = locker?;
    let locker = locker.borrow();
    if once {
        locker
            .try_lock_with(&key, options)
            .await?
            .ok_or(LockError::WouldBlock { key })
    } else {
        locker.lock_with(&key, options).await
    }
}

/// `body`, run inside the scope of `guard`'s lock.
pub fn scoped<F: Future>(guard: &LockGuard, body: F) -> Scoped<'_, F> {
    guard.scope(body)
}

/// Runs `body` until it completes or the lock is lost; a loss drops the
/// body and returns [`LockError::Lost`].
pub async fn run_until_lost<F, R>(guard: &LockGuard, body: F) -> R
where
    F: Future<Output = R>,
    R: FromLockError,
{
    tokio::select! {
        // A lost lock must stop the body before it makes more progress.
        biased;
        reason = guard.lost() => R::from_lock_error(LockError::Lost {
            key: guard.key().to_owned(),
            reason,
        }),
        output = body => output,
    }
}

/// The return type of an annotated fn: a `Result` whose error can be made
/// from a [`LockError`].
#[diagnostic::on_unimplemented(
    message = "#[distributed_lock] cannot return a lock error as `{Self}`",
    label = "the fn must return `Result<T, E>` with `E: From<dlock_core::LockError>`",
    note = "write `-> Result<T, E>` with an `E` that implements `From<dlock_core::LockError>` (with thiserror: a `#[from] LockError` variant)"
)]
pub trait FromLockError {
    /// The error, as this return type.
    fn from_lock_error(error: LockError) -> Self;
}

impl<T, E: From<LockError>> FromLockError for Result<T, E> {
    fn from_lock_error(error: LockError) -> Self {
        Err(E::from(error))
    }
}

/// `error` as the annotated fn's return type.
pub fn lock_error<R: FromLockError>(error: LockError) -> R {
    R::from_lock_error(error)
}
