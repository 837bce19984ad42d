//! Reentrancy by scope: a `tokio::task_local!` that lists the holds the
//! current future runs under.
//!
//! A scope is entered by polling a future through [`Scoped`]: the body of
//! `#[distributed_lock]`, [`LockGuard::scope`](crate::LockGuard::scope) and
//! [`Locker::with_lock`](crate::Locker::with_lock). While that future (and
//! anything it awaits, at any depth) runs, a lock of one of the scope's keys
//! through the same locker re-enters the hold. Whatever is polled outside
//! the future (a future joined beside it, a spawned task, code after it)
//! sees the scope it was itself polled in, and contends.
//!
//! The scope holds `Weak`s: it never keeps a lock alive, and a hold that
//! ended (released, leaked, dropped) re-enters nothing. Nothing is recorded
//! outside the future, so nothing is left behind when it ends.

use std::{
    fmt,
    future::Future,
    marker::PhantomData,
    pin::Pin,
    sync::{Arc, Weak},
    task::{Context, Poll},
};

use pin_project::pin_project;

use crate::{
    backend::Mode,
    key::LockKey,
    locker::guard::{Hold, LockGuard},
    locker::shared::Shared,
};

tokio::task_local! {
    static SCOPE: Scope;
}

/// The holds a future runs under: a list that shares its tail with the
/// scope it was entered from.
#[derive(Clone, Default)]
pub(crate) struct Scope(Option<Arc<Link>>);

struct Link {
    hold: Weak<Hold>,
    outer: Scope,
}

impl Scope {
    /// The scope of the future being polled now (empty outside any).
    fn current() -> Scope {
        SCOPE.try_with(Scope::clone).unwrap_or_default()
    }

    /// This scope with `hold` added.
    fn with(&self, hold: Weak<Hold>) -> Scope {
        Scope(Some(Arc::new(Link {
            hold,
            outer: self.clone(),
        })))
    }

    /// The live hold of `key` through `shared`'s locker in the current
    /// scope, if there is one.
    pub(crate) fn find(shared: &Arc<Shared>, key: &LockKey) -> Option<Arc<Hold>> {
        Self::find_where(|hold| hold.is_of(shared, key))
    }

    /// Whether the current scope holds a read or write share of `key`'s
    /// read-write lock through `shared`'s locker (the plain lock and the
    /// semaphore of a key are other objects).
    pub(crate) fn holds_share(shared: &Arc<Shared>, key: &LockKey) -> bool {
        Self::find_where(|hold| {
            hold.is_on(shared, key) && matches!(hold.mode(), Mode::Read | Mode::Write)
        })
        .is_some()
    }

    /// The innermost live hold of the current scope that `wanted` picks.
    fn find_where(wanted: impl Fn(&Hold) -> bool) -> Option<Arc<Hold>> {
        SCOPE
            .try_with(|scope| {
                // Bounded: every link was made by one `Scoped` future, and
                // scopes nest no deeper than the futures that entered them.
                let mut next = scope.0.as_deref();
                while let Some(link) = next {
                    if let Some(hold) = link.hold.upgrade() {
                        if wanted(&hold) {
                            return Some(hold);
                        }
                    }
                    next = link.outer.0.as_deref();
                }
                None
            })
            .ok()
            .flatten()
    }
}

/// A future that runs inside the scope of a held lock: locking the same
/// key through the same [`Locker`](crate::Locker) (or a clone) anywhere
/// inside it re-enters the hold at once, without asking the server.
///
/// Made by [`LockGuard::scope`](crate::LockGuard::scope),
/// [`DistMutexGuard::scope`](crate::DistMutexGuard::scope) and
/// [`OwnedDistMutexGuard::scope`](crate::OwnedDistMutexGuard::scope). It
/// borrows the guard, so the guard cannot be released, dropped or moved
/// away while the scope runs.
///
/// The scope it adds to is the one it is first polled in, so scopes nest:
/// inside two nested scoped futures, both keys re-enter.
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
/// guard
///     .scope(async {
///         // Inside the scope: re-entered at once.
///         let inner = locker.lock("report:daily").await?;
///         assert_eq!(inner.fencing_token(), guard.fencing_token());
///         Ok::<_, dlock_core::LockError>(())
///     })
///     .await?;
/// # Ok(())
/// # }
/// ```
#[pin_project]
#[must_use = "futures do nothing unless you `.await` or poll them"]
pub struct Scoped<'a, F> {
    #[pin]
    future: F,
    /// The holds the future runs under (one, or all of a `MultiGuard`'s).
    holds: Vec<Weak<Hold>>,
    /// The scope the future runs in, fixed when it is first polled.
    scope: Option<Scope>,
    guard: PhantomData<&'a ()>,
}

impl<F> Scoped<'_, F> {
    pub(crate) fn new(hold: &Arc<Hold>, future: F) -> Self {
        Self::all([hold], future)
    }

    pub(crate) fn all<'h>(holds: impl IntoIterator<Item = &'h Arc<Hold>>, future: F) -> Self {
        Scoped {
            future,
            holds: holds.into_iter().map(Arc::downgrade).collect(),
            scope: None,
            guard: PhantomData,
        }
    }
}

impl<F: Future> Future for Scoped<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let holds = this.holds;
        let scope = this
            .scope
            .get_or_insert_with(|| {
                holds
                    .iter()
                    .fold(Scope::current(), |scope, hold| scope.with(hold.clone()))
            })
            .clone();
        let future = this.future;
        SCOPE.sync_scope(scope, || future.poll(cx))
    }
}

impl<F> fmt::Debug for Scoped<'_, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scoped").finish_non_exhaustive()
    }
}

/// [`LockGuard::scope`] lives here, beside [`Scoped`], so that `guard` does
/// not import `scope` back.
impl LockGuard {
    /// Runs `future` inside this lock's scope: any lock of the same key
    /// through the same [`Locker`](crate::Locker) (or a clone), at any depth
    /// inside `future`, re-enters this hold at once, without asking the
    /// server. Code outside `future` is not in the scope: a future joined
    /// beside it, a spawned task, and whatever runs after it contend for
    /// the key like any other owner (see [Reentrancy](crate::Locker#reentrancy)).
    ///
    /// The returned future borrows the guard, so the guard stays held (it
    /// cannot be released, dropped or moved away) while the scope runs.
    ///
    /// # Cancel safety
    ///
    /// As cancel safe as `future`; the scope itself leaves nothing behind.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{LockError, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    ///
    /// async fn audit(locker: &Locker) -> Result<u64, LockError> {
    ///     // Re-enters when called inside a scope holding "account:7".
    ///     let guard = locker.lock("account:7").await?;
    ///     Ok(guard.fencing_token().unwrap_or(0))
    /// }
    ///
    /// let guard = locker.lock("account:7").await?;
    /// let fence = guard.scope(audit(&locker)).await?;
    /// assert_eq!(Some(fence), guard.fencing_token());
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn scope<F: Future>(&self, future: F) -> Scoped<'_, F> {
        Scoped::new(self.hold(), future)
    }
}
