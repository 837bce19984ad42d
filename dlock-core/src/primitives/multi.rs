//! Several keys at once: [`Locker::lock_all`] and its [`MultiGuard`].

use std::{collections::BTreeSet, fmt, future::Future};

use tokio::time::Instant;

use crate::{
    error::{LockError, Result},
    locker::guard::LockGuard,
    locker::options::{wait_deadline, LockOptions},
    locker::scope::Scoped,
    locker::Locker,
    LostReason,
};

impl Locker {
    /// Acquires every key of `keys`, or none, within one wait limit (that
    /// of `options`, or the locker's default).
    ///
    /// The keys are taken one at a time in one canonical order (sorted),
    /// whatever order the caller names them in, so two callers that lock
    /// the same keys through `lock_all` cannot deadlock. If one is not
    /// granted within what is left of the limit, or fails, or the future is
    /// dropped, every key taken so far is given back: released and
    /// answered before the error returns, or (when dropped) released in
    /// the background as a dropped guard is.
    ///
    /// Inside a scope that holds one of the keys (see
    /// [Reentrancy](crate::Locker#reentrancy)), that key is re-entered, as
    /// [`lock`](Locker::lock) would; the others are acquired. The order
    /// protects callers that take all their keys at once: one that holds
    /// a key in its scope and then asks for others may still wait on a
    /// caller that holds those and waits for the first, as with any two
    /// locks taken in two orders.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for an empty list, or a key named
    /// twice; otherwise as [`lock_with`](Locker::lock_with), for the first
    /// key that was not granted (a [`LockError::Timeout`] names it).
    /// [`LockError::Lost`] if a key taken first was lost by the time the
    /// last was granted (a fixed lease shorter than the wait), three times
    /// or past the wait limit: each time, every key is given back and
    /// taken again, so the guard returned never names a lost key.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped `lock_all` leaves no key held.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{LockOptions, Locker, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let options = LockOptions::new().wait(Duration::from_secs(5));
    /// // Moves money between two accounts, in whatever order they come.
    /// let both = locker.lock_all(["account:9", "account:2"], options).await?;
    /// assert_eq!(both.keys().collect::<Vec<_>>(), ["account:2", "account:9"]);
    /// both.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_all<I, K>(&self, keys: I, options: LockOptions) -> Result<MultiGuard>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let mut sorted = BTreeSet::new();
        for key in keys {
            let key = key.as_ref();
            if !sorted.insert(key.to_owned()) {
                return Err(crate::InvalidReason::DuplicateKey {
                    key: key.to_owned(),
                }
                .into());
            }
        }
        if sorted.is_empty() {
            return Err(crate::InvalidReason::NoKeys.into());
        }
        let options = options.or(self.defaults());
        // Kept only once every key is the caller's: a key given back
        // unused is released at once.
        self.check_server_lease_options(options)?;
        let (options, hold_at_least) = options.take_hold_at_least();
        // A limit too large for the clock (`Duration::MAX`) waits forever.
        let deadline = wait_deadline(Instant::now(), options.get_wait().flatten());
        let mut attempt = 1;
        loop {
            let guards = self.take_each(&sorted, options, deadline).await?;
            // A key taken first can lapse while a later one is awaited
            // (a fixed lease shorter than the wait): never handed out.
            let Some(lost) = guards.iter().find(|guard| guard.is_lost()) else {
                if let Some(at_least) = hold_at_least {
                    for guard in &guards {
                        guard.hold().hold_at_least(at_least);
                    }
                }
                return Ok(MultiGuard { guards });
            };
            let key = lost.key().to_owned();
            let reason = lost.lost().await;
            give_back(guards).await;
            let out_of_time = deadline.is_some_and(|d| Instant::now() >= d);
            if attempt == LOCK_ALL_ATTEMPTS || out_of_time {
                return Err(LockError::Lost { key, reason });
            }
            attempt += 1;
        }
    }

    /// Takes every key in order, each within what is left of `deadline`;
    /// on the first refusal or failure, gives back what it took.
    async fn take_each(
        &self,
        sorted: &BTreeSet<String>,
        options: LockOptions,
        deadline: Option<Instant>,
    ) -> Result<Vec<LockGuard>> {
        let mut guards = Vec::with_capacity(sorted.len());
        for key in sorted {
            let options = match deadline {
                Some(deadline) => options.wait(deadline.saturating_duration_since(Instant::now())),
                None => options,
            };
            match self.lock_with(key, options).await {
                Ok(guard) => guards.push(guard),
                Err(error) => {
                    // Given back before the caller hears, so that the keys
                    // are free when it does.
                    give_back(guards).await;
                    return Err(error);
                }
            }
        }
        Ok(guards)
    }
}

/// How many times [`Locker::lock_all`] takes the keys again after finding
/// one lost by the time it had them all.
const LOCK_ALL_ATTEMPTS: u32 = 3;

/// Releases `guards`, last taken first.
async fn give_back(guards: Vec<LockGuard>) {
    for guard in guards.into_iter().rev() {
        let _ = guard.release().await;
    }
}

/// Proof that every key of a [`Locker::lock_all`] is held.
///
/// Dropping it releases every key (in the background, as dropping each
/// [`LockGuard`] does); [`release`](MultiGuard::release) releases them and
/// waits for the answers. It counts as lost as soon as any of its keys is.
///
/// # Examples
///
/// ```
/// use dlock_core::{LockOptions, Locker, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let all = locker.lock_all(["a", "b"], LockOptions::new()).await?;
/// // Inside its scope, each key re-enters.
/// all.scope(async {
///     let again = locker.lock("b").await?;
///     assert_eq!(again.fencing_token(), all.guards()[1].fencing_token());
///     Ok::<_, dlock_core::LockError>(())
/// })
/// .await?;
/// assert!(!all.is_lost());
/// # Ok(())
/// # }
/// ```
pub struct MultiGuard {
    /// One guard per key, in the canonical (sorted) order.
    guards: Vec<LockGuard>,
}

impl MultiGuard {
    /// The guards, one per key, sorted by key.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// The keys, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.guards.iter().map(LockGuard::key)
    }

    /// Whether any key has been lost.
    pub fn is_lost(&self) -> bool {
        self.guards.iter().any(LockGuard::is_lost)
    }

    /// Completes when the first key is lost: which, and why.
    pub async fn lost(&self) -> (String, LostReason) {
        let losses = self
            .guards
            .iter()
            .map(|guard| Box::pin(async move { (guard.key().to_owned(), guard.lost().await) }));
        futures_select_first(losses).await
    }

    /// Runs `future` inside the scope of every key: locking any of them
    /// through the same locker inside it re-enters at once (see
    /// [`LockGuard::scope`]).
    pub fn scope<F: Future>(&self, future: F) -> Scoped<'_, F> {
        Scoped::all(self.guards.iter().map(LockGuard::hold), future)
    }

    /// Releases every key, in the reverse of the order they were taken,
    /// and waits for the answers.
    ///
    /// # Errors
    ///
    /// The first error of the releases (every release is tried):
    /// [`LockError::Lost`] if a key was lost, or the backend's error.
    pub async fn release(self) -> Result<()> {
        let mut first = None;
        for guard in self.guards.into_iter().rev() {
            if let Err(error) = guard.release().await {
                first.get_or_insert(error);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl fmt::Debug for MultiGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiGuard")
            .field("guards", &self.guards)
            .finish()
    }
}

/// The output of whichever of `futures` completes first.
async fn futures_select_first<F: Future + Unpin>(
    futures: impl IntoIterator<Item = F>,
) -> F::Output {
    let mut futures: Vec<F> = futures.into_iter().collect();
    std::future::poll_fn(move |cx| {
        for future in &mut futures {
            if let std::task::Poll::Ready(output) = std::pin::Pin::new(future).poll(cx) {
                return std::task::Poll::Ready(output);
            }
        }
        std::task::Poll::Pending
    })
    .await
}
