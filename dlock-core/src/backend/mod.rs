//! The seam between dlock-core and a lock server: the [`Backend`] trait.
//!
//! A backend speaks its server's protocol and nothing else: it acquires with
//! a token (waiting for a notification from the server, not polling),
//! releases and renews by comparing that token on the server, and reports
//! loss its server tells it about. Guards, drop release, reentrancy,
//! options, wait limits, the watchdog, the lost signal and tracing live in
//! [`Locker`](crate::Locker), once for every backend.

use std::{fmt, future::Future, pin::Pin, time::Duration};

use tokio::time::Instant;

use crate::{error::Result, key::LockKey, token::Token};

pub use crate::locker::lease::LossReporter;

mod backoff;
mod capabilities;
mod dyn_backend;
mod finish;
mod holder;
mod keyhash;
mod list;
mod mode;
mod request;
mod session;
mod timers;
mod turns;
mod url;
pub mod wait;

pub use crate::locker::connection::ConnectionStates;
pub use backoff::Backoff;
pub use capabilities::Capabilities;
pub use dyn_backend::DynBackend;
pub use finish::{Abandoned, FinishOnDrop};
pub use holder::{unsupported_holder, Holder, HolderNote, HOLDER_POLL, MAX_HOLDER_NOTE};
pub use keyhash::key_hash;
pub use list::{
    unsupported_list, HeldLock, ListCursor, ListPage, ListRequest, ListedKey, DEFAULT_LIST_PAGE,
    MAX_LIST_PAGE,
};
pub use mode::{admitted, permits_taken, Mode};
pub use request::{
    AcquireRequest, Acquired, LeaseKind, ReleaseOutcome, RenewOutcome, RenewRequest, Wait,
};
pub use session::SessionHolders;
pub use timers::LeaseTimers;
pub use turns::{LocalTurn, LocalTurns, Share};
pub use url::{parse_url_duration, percent_decode, redact_url, BackendUrl, HostPort, TlsFiles};

/// A boxed, `Send` future: what [`DynBackend`]'s methods answer.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A lock server, as dlock-core sees it.
///
/// Implement it with `async fn`s (each future must be `Send`); every
/// `Backend` is also a [`DynBackend`], the form a [`Locker`](crate::Locker)
/// holds. The futures must be cancel safe: dropping an [`acquire`](Backend::acquire) future at
/// any `.await` must leave nothing on the server that blocks other owners
/// (no orphan key, node or queue entry).
///
/// As a second line of defence, core calls [`release`](Backend::release)
/// with the token of every acquire that did not answer for itself (it was
/// dropped, cut short by the wait limit, or failed), so a grant whose reply
/// was still in flight does not hold the key until its lease runs out.
/// Release must therefore accept tokens that never held the lock.
///
/// # Examples
///
/// A backend is used through a [`Locker`](crate::Locker):
///
/// ```
/// use dlock_core::{backend::Backend, Locker, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// assert_eq!(backend.name(), "memory");
/// let locker = Locker::new(backend);
/// # drop(locker);
/// ```
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short name for errors and traces, such as `"redis"`.
    fn name(&self) -> &'static str;

    /// What this backend guarantees beyond the required properties.
    fn capabilities(&self) -> Capabilities;

    /// Acquires `req.key` for `req.token`.
    ///
    /// With [`Wait::No`], makes one attempt. Otherwise waits, woken by the
    /// server, until the lock is granted or `req.wait`'s deadline passes.
    /// Returns `Ok(None)` if the lock was not acquired.
    ///
    /// At the deadline the backend ends its wait on the server itself, and
    /// answers once the server has let it go (a grant made in that instant
    /// is undone, or returned). [`Locker`](crate::Locker) waits half a
    /// second past the deadline for that answer; a wait still running then
    /// is dropped, and ended from outside after the caller was told. A
    /// wait no request can end (a thread blocked in `flock(2)`) may answer
    /// at the deadline, if it lets a grant that comes later go at once.
    ///
    /// The returned [`Acquired::sent_at`] must be taken just before the
    /// request that won the lock was sent: the holder's lease clock starts
    /// there.
    fn acquire(
        &self,
        req: AcquireRequest<'_>,
    ) -> impl Future<Output = Result<Option<Acquired>>> + Send;

    /// Releases what `token` holds of `key` in `mode` if, and only if, it
    /// holds it, in one atomic step on the server. Releasing twice is not an
    /// error: the second time changes nothing. A release sent again because
    /// the answer to the first was lost should say
    /// [`ReleaseOutcome::Released`] where the server can tell (Redis, etcd
    /// and ZooKeeper do), and says [`ReleaseOutcome::NotHeld`] otherwise.
    fn release(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
    ) -> impl Future<Output = Result<ReleaseOutcome>> + Send;

    /// Gives up on releasing `key` for `token`: [`release`](Backend::release)
    /// has failed for as long as the lock's lease. Core calls this once, and
    /// sends no more releases for the token.
    ///
    /// A backend whose locks expire on the server by their own lease (a key
    /// with a TTL) has nothing to do: core stopped renewing the lock when
    /// its guard went, and the default does nothing. A backend whose locks
    /// live on a session it keeps alive (an etcd lease, a ZooKeeper session)
    /// must stop keeping the one that carries this token's lock alive, so
    /// that the lock expires within one more session timeout; every other
    /// lock on that session is then reported lost, and later acquisitions
    /// use a new session.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use dlock_core::{backend::{Backend, Mode}, LockKey, MemoryBackend, Token};
    ///
    /// let backend = MemoryBackend::new();
    /// // Nothing keeps a memory lock alive but its lease: nothing to do.
    /// backend
    ///     .abandon(&LockKey::new("k").unwrap(), Mode::Exclusive, &Token::generate())
    ///     .await;
    /// # }
    /// ```
    fn abandon(&self, key: &LockKey, mode: Mode, token: &Token) -> impl Future<Output = ()> + Send {
        let _ = (key, mode, token);
        std::future::ready(())
    }

    /// Renews every lock in `locks` whose token still holds it, for its
    /// lease, in as few round trips as the server allows. The result has one
    /// outcome per request, in order. An `Err` means nothing is known about
    /// any of them.
    fn renew(
        &self,
        locks: &[RenewRequest],
    ) -> impl Future<Output = Result<Vec<RenewOutcome>>> + Send;

    /// Whether the servers answer now. The [`Locker`](crate::Locker) asks
    /// once when a wait limit passes without a grant: if the servers do not
    /// answer, the caller gets their error rather than
    /// [`LockError::Timeout`](crate::LockError::Timeout), which says that
    /// another owner holds the lock (a web service would answer 409 where
    /// 500 is the truth).
    ///
    /// The default, for a backend without servers, answers `Ok(())`.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use dlock_core::{backend::Backend, MemoryBackend};
    ///
    /// assert!(MemoryBackend::new().check_servers().await.is_ok());
    /// # }
    /// ```
    fn check_servers(&self) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    /// Publishes `value` as what the holder of `key`'s exclusive lock
    /// says, for [`holder`](Backend::holder) to read, if `token` holds it
    /// now: checked by the token in the same atomic step as the write,
    /// on the server where the server keeps tokens (Redis, etcd), or on
    /// the session or node that holds the lock (ZooKeeper, SQL). Returns whether it was written (`false`: the token does
    /// not hold the lock, and nothing was changed). Call it on the client
    /// that took the lock: a backend may know its own holds only.
    ///
    /// The value lives exactly as long as the token's hold: a release, an
    /// expiry or a crash takes it with the lock, and the next holder shows
    /// none until it proclaims its own. Leader election publishes a
    /// leader's value this way (see
    /// [`Election::proclaim`](crate::Election::proclaim)).
    ///
    /// The default answers [`LockError::Unsupported`](crate::LockError::Unsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_core::{backend::Backend, BackendExt, LockKey, MemoryBackend};
    ///
    /// let server = MemoryBackend::new();
    /// let guard = server.clone().into_locker().lock("leader").await?;
    /// let key = LockKey::new("leader")?;
    /// assert!(server.proclaim(&key, guard.token(), b"10.0.0.7:8080").await?);
    /// let holder = server.holder(&key).await?.expect("held");
    /// assert_eq!(holder.value(), Some(&b"10.0.0.7:8080"[..]));
    /// assert_eq!(holder.fence(), guard.fencing_token());
    /// # Ok(())
    /// # }
    /// ```
    fn proclaim(
        &self,
        key: &LockKey,
        token: &Token,
        value: &[u8],
    ) -> impl Future<Output = Result<bool>> + Send {
        let _ = (key, token, value);
        std::future::ready(Err(unsupported_holder(self.name())))
    }

    /// Who holds `key`'s exclusive lock now: its fencing token and what it
    /// [proclaimed](Backend::proclaim), or `None` if nobody does. One read,
    /// not a wait. Held is what the server says: on Redis a lock handed to
    /// a waiter that has not taken it yet is free; on etcd and ZooKeeper
    /// the first in line holds it from the moment it is first.
    ///
    /// The default answers [`LockError::Unsupported`](crate::LockError::Unsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_core::{backend::Backend, BackendExt, LockKey, MemoryBackend};
    ///
    /// let server = MemoryBackend::new();
    /// let key = LockKey::new("leader")?;
    /// assert!(server.holder(&key).await?.is_none());
    /// let guard = server.clone().into_locker().lock("leader").await?;
    /// let holder = server.holder(&key).await?.expect("held");
    /// assert_eq!(holder.fence(), guard.fencing_token());
    /// assert_eq!(holder.value(), None);
    /// # Ok(())
    /// # }
    /// ```
    fn holder(&self, key: &LockKey) -> impl Future<Output = Result<Option<Holder>>> + Send {
        let _ = key;
        std::future::ready(Err(unsupported_holder(self.name())))
    }

    /// One page of the locks held now whose key starts with
    /// `req.prefix`, after `req.after`, at most `req.limit` of them: each
    /// with its holders (mode, fence, note, age and lease left where the
    /// server records them) and its waiters where the server counts them.
    /// Every key is answered once across the pages of one listing, in the
    /// backend's order; a lock taken or released while the pages are read
    /// may or may not be on them. Reads only; takes no lock.
    ///
    /// A page must not cost the server more than the keys it covers (no
    /// load of every key): a listing works at any number of held locks.
    ///
    /// The default answers [`LockError::Unsupported`](crate::LockError::Unsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_core::{backend::{Backend, ListRequest}, BackendExt, MemoryBackend};
    ///
    /// let server = MemoryBackend::new();
    /// let _guard = server.clone().into_locker().lock("jobs/7").await?;
    /// let page = server.list(ListRequest::new("jobs/", 100)).await?;
    /// assert_eq!(page.locks[0].key().name(), Some("jobs/7"));
    /// assert!(page.next.is_none());
    /// # Ok(())
    /// # }
    /// ```
    fn list(&self, req: ListRequest<'_>) -> impl Future<Output = Result<ListPage>> + Send {
        let _ = req;
        std::future::ready(Err(unsupported_list(self.name(), "listing of held locks")))
    }

    /// Completes when `key`'s holder, or what it proclaimed, may no longer
    /// be `seen` (what [`holder`](Backend::holder) last read): at once if
    /// it differs already. [`Locker::observe`](crate::Locker::observe)
    /// reads the holder again each time it completes, so it may complete
    /// when nothing changed, but must not stay pending past a change:
    /// arm the wake-up before the read that compares with `seen`.
    ///
    /// A backend whose server can tell (a watch, a message) is woken by
    /// it, and at the end of the holder's lease, which runs out with
    /// nobody told. The default, for a backend whose server cannot, waits
    /// [`HOLDER_POLL`] and completes: the holder is read once per period.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_core::{backend::Backend, BackendExt, LockKey, MemoryBackend};
    ///
    /// let server = MemoryBackend::new();
    /// let key = LockKey::new("leader")?;
    /// let seen = server.holder(&key).await?;
    /// let changed = server.holder_changed(&key, seen.as_ref());
    /// let guard = server.clone().into_locker().lock("leader").await?;
    /// changed.await?; // woken by the grant
    /// assert!(server.holder(&key).await?.is_some());
    /// # drop(guard);
    /// # Ok(())
    /// # }
    /// ```
    fn holder_changed(
        &self,
        key: &LockKey,
        seen: Option<&Holder>,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (key, seen);
        async {
            tokio::time::sleep(HOLDER_POLL).await;
            Ok(())
        }
    }

    /// Frees `key`'s plain lock, whoever holds it: for operators, when a
    /// holder is stuck or gone in a way its lease does not cover. Returns
    /// whether a holder was removed (`false`: the key was free). The first
    /// waiter in line gets the lock next, as after a release.
    ///
    /// **Dangerous.** The holder may still be inside its critical
    /// section; only the next holder's greater fencing token protects data
    /// from it. Its guard is told it lost the lock
    /// ([`LostReason::NotHeld`](crate::LostReason::NotHeld)): at once
    /// where the server tells it, otherwise at its next renewal or check.
    /// Each backend's docs say how.
    ///
    /// The default answers [`LockError::Unsupported`](crate::LockError::Unsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_core::{backend::Backend, BackendExt, LockKey, MemoryBackend};
    ///
    /// let server = MemoryBackend::new();
    /// let guard = server.clone().into_locker().lock("stuck").await?;
    /// assert!(server.force_release(&LockKey::new("stuck")?).await?);
    /// assert!(guard.is_lost());
    /// # Ok(())
    /// # }
    /// ```
    fn force_release(&self, key: &LockKey) -> impl Future<Output = Result<bool>> + Send {
        let _ = key;
        std::future::ready(Err(crate::LockError::Unsupported {
            backend: self.name(),
            what: "forced releases",
        }))
    }

    /// Moves the end of a fixed lease: what `token` holds of `key` in
    /// `mode` now lasts `lease` from when the server sees this request
    /// (earlier or later than before), if and only if the token still
    /// holds it, checked on the server in the same step. Answers when the
    /// guard's lease now runs, as the instant a request was sent and a
    /// length from it (a backend whose session keeps its locks vouches for
    /// no more than the session's own lease), or `None` if the token no
    /// longer holds the lock.
    ///
    /// [`LockGuard::extend`](crate::LockGuard::extend) calls this, for
    /// fixed leases only. A backend whose [`renew`](Backend::renew) moves
    /// a fixed lease's end on the server can answer with
    /// [`extend_by_renewal`].
    ///
    /// The default answers [`LockError::Unsupported`](crate::LockError::Unsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use std::time::Duration;
    /// use dlock_core::{backend::{Backend, Mode}, BackendExt, LockKey, LockOptions, MemoryBackend};
    ///
    /// let server = MemoryBackend::new();
    /// let locker = server.clone().into_locker();
    /// let options = LockOptions::new().lease(Duration::from_secs(5));
    /// let guard = locker.lock_with("report", options).await?;
    /// let key = LockKey::new("report")?;
    /// let until = server.extend(&key, Mode::Exclusive, guard.token(), Duration::from_secs(60)).await?;
    /// assert!(until.is_some_and(|(_, lease)| lease == Duration::from_secs(60)));
    /// # Ok(())
    /// # }
    /// ```
    fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<(Instant, Duration)>>> + Send {
        let _ = (key, mode, token, lease);
        std::future::ready(Err(crate::LockError::Unsupported {
            backend: self.name(),
            what: "extending fixed leases",
        }))
    }

    /// How many of `key`'s semaphore permits are held now (of `limit`),
    /// read without taking any: a snapshot for dashboards and back
    /// pressure, which may have changed by the time it is read. Permits
    /// whose lease has ended on the server are not counted; a holder
    /// whose process died counts until its lease or session ends.
    ///
    /// [`DistSemaphore::available`](crate::DistSemaphore::available)
    /// calls this. The default answers
    /// [`LockError::Unsupported`](crate::LockError::Unsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_core::{backend::Backend, BackendExt, DistSemaphore, LockKey, MemoryBackend};
    ///
    /// let server = MemoryBackend::new();
    /// let pool = DistSemaphore::new(&server.clone().into_locker(), "pool", 3);
    /// let _permit = pool.acquire().await?;
    /// assert_eq!(server.permits_taken(&LockKey::new("pool")?, 3).await?, 1);
    /// # Ok(())
    /// # }
    /// ```
    fn permits_taken(&self, key: &LockKey, limit: u32) -> impl Future<Output = Result<u32>> + Send {
        let _ = (key, limit);
        std::future::ready(Err(crate::LockError::Unsupported {
            backend: self.name(),
            what: "reading a semaphore's permits",
        }))
    }

    /// What the backend knows of its connection to the servers (see
    /// [`ConnectionState`](crate::ConnectionState)), fed by its own
    /// signals through a [`ConnectionStates`].
    ///
    /// The default, for a backend with no connection to lose (the
    /// in-process and file backends), stays
    /// [`Connected`](crate::ConnectionState::Connected).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{backend::Backend, ConnectionState, MemoryBackend};
    ///
    /// let state = MemoryBackend::new().connection_state();
    /// assert_eq!(*state.borrow(), ConnectionState::Connected);
    /// ```
    fn connection_state(&self) -> tokio::sync::watch::Receiver<crate::ConnectionState> {
        // A sender that lives as long as the process: `changed()` waits
        // forever rather than failing at once.
        static ALWAYS: std::sync::OnceLock<tokio::sync::watch::Sender<crate::ConnectionState>> =
            std::sync::OnceLock::new();
        ALWAYS
            .get_or_init(|| tokio::sync::watch::Sender::new(crate::ConnectionState::Connected))
            .subscribe()
    }
}

/// [`Backend::extend`] for a backend whose [`renew`](Backend::renew)
/// sets a lock's lease on the server, fixed or not, after checking its
/// token (a key with a TTL): one renewal of the one lock.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// use std::time::Duration;
/// use dlock_core::{backend::{extend_by_renewal, Mode}, LockKey, MemoryBackend, Token};
///
/// // A token that holds nothing: nothing is extended.
/// let key = LockKey::new("k")?;
/// let lease = Duration::from_secs(1);
/// let until = extend_by_renewal(&MemoryBackend::new(), &key, Mode::Exclusive, &Token::generate(), lease).await?;
/// assert_eq!(until, None);
/// # Ok(())
/// # }
/// ```
pub async fn extend_by_renewal<B: Backend + ?Sized>(
    backend: &B,
    key: &LockKey,
    mode: Mode,
    token: &Token,
    lease: std::time::Duration,
) -> Result<Option<(tokio::time::Instant, std::time::Duration)>> {
    let sent = tokio::time::Instant::now();
    let request = [RenewRequest {
        key: key.clone(),
        mode,
        token: *token,
        lease,
    }];
    let outcomes = backend.renew(&request).await?;
    match outcomes.first() {
        Some(RenewOutcome::Renewed) => Ok(Some((sent, lease))),
        Some(RenewOutcome::NotHeld) => Ok(None),
        // Some servers did not answer: the lease may or may not have moved.
        _ => Err(crate::LockError::backend(
            backend.name(),
            std::io::Error::other("the servers did not all answer the extension"),
        )),
    }
}
