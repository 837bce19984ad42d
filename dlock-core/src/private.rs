//! What `#[distributed_lock]`'s expansion calls. Not a public API: names
//! and signatures here change without notice.

use std::{borrow::Borrow, future::Future};

pub use std::time::Duration;

pub use crate::{LockError, LockGuard, LockOptions, Locker, MultiGuard, Scoped};

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

/// Takes every lock of `keys = [...]`, all or none; `once` is
/// `wait = "none"`: one attempt at each, and `LockError::WouldBlock`
/// naming the first key held elsewhere.
pub async fn acquire_all<L: Borrow<Locker>>(
    locker: Result<L, LockError>,
    keys: Vec<String>,
    options: LockOptions,
    once: bool,
) -> Result<MultiGuard, LockError> {
    let locker = locker?;
    let locker = locker.borrow();
    if once {
        match locker.lock_all(&keys, options.wait(Duration::ZERO)).await {
            Err(LockError::Timeout { key, .. }) => Err(LockError::WouldBlock { key }),
            other => other,
        }
    } else {
        locker.lock_all(&keys, options).await
    }
}

/// What an annotated fn's body runs under: one lock's guard, or the
/// guard of several.
pub trait Held {
    /// `body`, run inside the scope of every lock held.
    fn scoped<F: Future>(&self, body: F) -> Scoped<'_, F>;
    /// Completes when a lock held is lost, with the error that says so.
    fn lost_error(&self) -> impl Future<Output = LockError> + Send + '_;
    /// Whether a lock held is lost now.
    fn is_lost(&self) -> bool;
}

impl Held for LockGuard {
    fn scoped<F: Future>(&self, body: F) -> Scoped<'_, F> {
        self.scope(body)
    }

    async fn lost_error(&self) -> LockError {
        LockError::Lost {
            key: self.key().to_owned(),
            reason: self.lost().await,
        }
    }

    fn is_lost(&self) -> bool {
        LockGuard::is_lost(self)
    }
}

impl Held for MultiGuard {
    fn scoped<F: Future>(&self, body: F) -> Scoped<'_, F> {
        self.scope(body)
    }

    async fn lost_error(&self) -> LockError {
        let (key, reason) = self.lost().await;
        LockError::Lost { key, reason }
    }

    fn is_lost(&self) -> bool {
        MultiGuard::is_lost(self)
    }
}

/// `body`, run inside the scope of `guard`'s locks.
pub fn scoped<G: Held, F: Future>(guard: &G, body: F) -> Scoped<'_, F> {
    guard.scoped(body)
}

/// Runs `body` until it completes or a lock is lost; a loss drops the
/// body and returns [`LockError::Lost`].
pub async fn run_until_lost<G, F, R>(guard: &G, body: F) -> R
where
    G: Held,
    F: Future<Output = R>,
    R: FromLockError,
{
    tokio::select! {
        // A lost lock must stop the body before it makes more progress.
        biased;
        error = guard.lost_error() => R::from_lock_error(error),
        output = body => output,
    }
}

/// Runs `body` to its end; if a lock was lost meanwhile, drops its output
/// and returns [`LockError::Lost`]: the body's work may have overlapped
/// another owner's, and the caller must not take it as done under the
/// lock.
pub async fn run_then_check<G, F, R>(guard: &G, body: F) -> R
where
    G: Held,
    F: Future<Output = R>,
    R: FromLockError,
{
    let output = body.await;
    if guard.is_lost() {
        return R::from_lock_error(guard.lost_error().await);
    }
    output
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
