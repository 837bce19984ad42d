//! `CountingBackend`: a pass-through backend that counts the calls core makes.

use std::sync::{
    atomic::{AtomicBool, AtomicUsize, Ordering},
    Arc,
};

use dlock_core::{
    backend::{
        AcquireRequest, Acquired, Backend, Capabilities, DynBackend, Holder, ListPage, ListRequest,
        Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
    },
    LockKey, Result, Token,
};

/// Wraps a real backend and counts the calls made to it, to check that
/// something (a re-entered lock) made no server round trip; and, armed by
/// [`release_at_first_proclaim`](CountingBackend::release_at_first_proclaim),
/// injects one fault: the lock is released behind its holder's back (with
/// its own token) as the holder first proclaims, as an operator's forced
/// unlock between a grant and the first write would.
///
/// # Examples
///
/// ```
/// use dlock_core::{Locker, MemoryBackend};
/// use dlock_testkit::CountingBackend;
/// use std::sync::Arc;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let counting = Arc::new(CountingBackend::new(Arc::new(MemoryBackend::new())));
/// let locker = Locker::from_arc(counting.clone());
/// let _g = locker.lock("k").await?;
/// assert_eq!(counting.acquires(), 1);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct CountingBackend {
    inner: Arc<dyn DynBackend>,
    acquires: AtomicUsize,
    releases: AtomicUsize,
    renewals: AtomicUsize,
    renewals_answered: AtomicUsize,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
    /// Whether the next proclaim releases the lock first.
    release_at_proclaim: AtomicBool,
    /// Whether a proclaim did.
    released_at_proclaim: AtomicBool,
    /// How long each renewal waits before it is passed on.
    renew_delay: std::time::Duration,
}

impl CountingBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn DynBackend>) -> Self {
        CountingBackend {
            inner,
            acquires: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
            renewals: AtomicUsize::new(0),
            renewals_answered: AtomicUsize::new(0),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
            release_at_proclaim: AtomicBool::new(false),
            released_at_proclaim: AtomicBool::new(false),
            renew_delay: std::time::Duration::ZERO,
        }
    }

    /// Holds each renewal back for `delay` before it is passed on: a
    /// renewal on its way while its lock is released.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::MemoryBackend;
    /// use dlock_testkit::CountingBackend;
    /// use std::{sync::Arc, time::Duration};
    ///
    /// let slow = CountingBackend::new(Arc::new(MemoryBackend::new()))
    ///     .renew_delay(Duration::from_millis(50));
    /// # drop(slow);
    /// ```
    pub fn renew_delay(mut self, delay: std::time::Duration) -> Self {
        self.renew_delay = delay;
        self
    }

    /// Arms the one fault: the first proclaim from now on releases the
    /// lock (with its holder's own token) before it is passed on, so it
    /// finds the lock not held.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::MemoryBackend;
    /// use dlock_testkit::CountingBackend;
    /// use std::sync::Arc;
    ///
    /// let faulty = CountingBackend::new(Arc::new(MemoryBackend::new())).release_at_first_proclaim();
    /// assert!(!faulty.released_at_proclaim());
    /// ```
    pub fn release_at_first_proclaim(self) -> Self {
        self.release_at_proclaim.store(true, Ordering::SeqCst);
        self
    }

    /// Whether the armed fault has been injected.
    pub fn released_at_proclaim(&self) -> bool {
        self.released_at_proclaim.load(Ordering::SeqCst)
    }

    /// Calls of `acquire` so far.
    pub fn acquires(&self) -> usize {
        self.acquires.load(Ordering::SeqCst)
    }

    /// Calls of `release` so far.
    pub fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }

    /// Calls of `renew` so far (one per watchdog tick with locks to renew).
    pub fn renewals(&self) -> usize {
        self.renewals.load(Ordering::SeqCst)
    }

    /// Calls of `renew` that have returned (or whose future was dropped)
    /// so far: while fewer than [`renewals`](Self::renewals), a renewal is
    /// on its way.
    pub fn renewals_answered(&self) -> usize {
        self.renewals_answered.load(Ordering::SeqCst)
    }

    /// The most `acquire` calls that were in progress at the same time.
    pub fn max_concurrent_acquires(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }
}

/// Counts one `acquire` in progress until dropped (completed or cancelled).
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Backend for CountingBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let in_flight = InFlight(self.in_flight.clone());
        let acquire = self.inner.acquire(req);
        let _in_flight = in_flight;
        acquire.await
    }

    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(key, mode, token).await
    }

    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        self.renewals.fetch_add(1, Ordering::SeqCst);
        let answered = Answered(&self.renewals_answered);
        let _answered = answered;
        tokio::time::sleep(self.renew_delay).await;
        self.inner.renew(locks).await
    }

    async fn check_servers(&self) -> Result<()> {
        self.inner.check_servers().await
    }
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        if self.release_at_proclaim.swap(false, Ordering::SeqCst) {
            self.released_at_proclaim.store(true, Ordering::SeqCst);
            self.inner.release(key, Mode::Exclusive, token).await?;
        }
        self.inner.proclaim(key, token, value).await
    }
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        self.inner.holder(key).await
    }
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        self.inner.holder_changed(key, seen).await
    }
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        self.inner.list(req).await
    }
    fn connection_state(&self) -> tokio::sync::watch::Receiver<dlock_core::ConnectionState> {
        self.inner.connection_state()
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.inner.force_release(key).await
    }
    async fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: std::time::Duration,
    ) -> Result<Option<(tokio::time::Instant, std::time::Duration)>> {
        self.inner.extend(key, mode, token, lease).await
    }
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        self.inner.permits_taken(key, limit).await
    }
}

/// Counts a renewal as answered when dropped: returned or abandoned.
struct Answered<'a>(&'a AtomicUsize);

impl Drop for Answered<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}
