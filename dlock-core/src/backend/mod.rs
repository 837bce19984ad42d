//! The seam between dlock-core and a lock server: the [`Backend`] trait.
//!
//! A backend speaks its server's protocol and nothing else: it acquires with
//! a token (waiting for a notification from the server, not polling),
//! releases and renews by comparing that token on the server, and reports
//! loss its server tells it about. Guards, drop release, reentrancy,
//! options, wait limits, the watchdog, the lost signal and tracing live in
//! [`Locker`](crate::Locker), once for every backend.

use std::{fmt, future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::time::Instant;

use crate::{error::Result, key::LockKey, token::Token};

pub use crate::lease::LossReporter;

mod backoff;
pub mod memory;
mod session;
mod timers;
mod url;

pub use backoff::Backoff;
pub use session::SessionHolders;
pub use timers::LeaseTimers;
pub use url::{parse_url_duration, percent_decode, redact_url, BackendUrl, HostPort, TlsFiles};

/// A boxed, `Send` future, so that [`Backend`] can be used as `dyn Backend`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A lock server, as dlock-core sees it.
///
/// Implementations must be usable as `Arc<dyn Backend>`, and their futures
/// must be cancel safe: dropping an [`acquire`](Backend::acquire) future at
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
/// use std::sync::Arc;
///
/// let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
/// assert_eq!(backend.name(), "memory");
/// let locker = Locker::from_arc(backend);
/// # drop(locker);
/// ```
pub trait Backend: Send + Sync + fmt::Debug + 'static {
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
    /// The returned [`Acquired::sent_at`] must be taken just before the
    /// request that won the lock was sent: the holder's lease clock starts
    /// there.
    fn acquire<'a>(&'a self, req: AcquireRequest<'a>) -> BoxFuture<'a, Result<Option<Acquired>>>;

    /// Releases what `token` holds of `key` in `mode` if, and only if, it
    /// holds it, in one atomic step on the server. Releasing twice is not an
    /// error: the second time says [`ReleaseOutcome::NotHeld`].
    fn release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>>;

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
    fn abandon<'a>(&'a self, key: &'a LockKey, mode: Mode, token: &'a Token) -> BoxFuture<'a, ()> {
        let _ = (key, mode, token);
        Box::pin(std::future::ready(()))
    }

    /// Renews every lock in `locks` whose token still holds it, for its
    /// lease, in as few round trips as the server allows. The result has one
    /// outcome per request, in order. An `Err` means nothing is known about
    /// any of them.
    fn renew<'a>(&'a self, locks: &'a [RenewRequest]) -> BoxFuture<'a, Result<Vec<RenewOutcome>>>;

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
    fn check_servers(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(std::future::ready(Ok(())))
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
    fn proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>> {
        let _ = (key, token, value);
        Box::pin(std::future::ready(Err(unsupported_holder(self.name()))))
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
    fn holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>> {
        let _ = key;
        Box::pin(std::future::ready(Err(unsupported_holder(self.name()))))
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
    fn holder_changed<'a>(
        &'a self,
        key: &'a LockKey,
        seen: Option<&'a Holder>,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = (key, seen);
        Box::pin(async {
            tokio::time::sleep(HOLDER_POLL).await;
            Ok(())
        })
    }
}

/// How often [`Backend::holder_changed`]'s default reads the holder again.
pub const HOLDER_POLL: Duration = Duration::from_millis(500);

/// What [`Backend::proclaim`] and [`Backend::holder`] answer by default,
/// and a backend that can read holders in some setups only answers in the
/// others.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::unsupported_holder, LockError};
///
/// assert!(matches!(unsupported_holder("redis"), LockError::Unsupported { .. }));
/// ```
pub fn unsupported_holder(backend: &'static str) -> crate::LockError {
    crate::LockError::Unsupported {
        backend,
        what: "publishing and reading a lock's holder (proclaim, holder)",
    }
}

/// The holder of a key's exclusive lock, as [`Backend::holder`] reads it.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Holder;
///
/// let holder = Holder::new(Some(7), Some(b"node-a".to_vec()));
/// assert_eq!(holder.fence(), Some(7));
/// assert_eq!(holder.value(), Some(&b"node-a"[..]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    fence: Option<u64>,
    value: Option<Vec<u8>>,
}

impl Holder {
    /// A holder with fencing token `fence`, that proclaimed `value`.
    pub fn new(fence: Option<u64>, value: Option<Vec<u8>>) -> Self {
        Holder { fence, value }
    }

    /// The holder's fencing token; `None` on a backend that records a
    /// holder's token only when it proclaims (the SQL backends: writing it
    /// at every acquisition would cost every lock a write).
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    /// What the holder proclaimed, if it has yet.
    pub fn value(&self) -> Option<&[u8]> {
        self.value.as_deref()
    }

    /// What the holder proclaimed, owned.
    pub fn into_value(self) -> Option<Vec<u8>> {
        self.value
    }
}

impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    fn acquire<'a>(&'a self, req: AcquireRequest<'a>) -> BoxFuture<'a, Result<Option<Acquired>>> {
        (**self).acquire(req)
    }
    fn release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        (**self).release(key, mode, token)
    }
    fn abandon<'a>(&'a self, key: &'a LockKey, mode: Mode, token: &'a Token) -> BoxFuture<'a, ()> {
        (**self).abandon(key, mode, token)
    }
    fn renew<'a>(&'a self, locks: &'a [RenewRequest]) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        (**self).renew(locks)
    }
    fn check_servers(&self) -> BoxFuture<'_, Result<()>> {
        (**self).check_servers()
    }
    fn proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>> {
        (**self).proclaim(key, token, value)
    }
    fn holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>> {
        (**self).holder(key)
    }
    fn holder_changed<'a>(
        &'a self,
        key: &'a LockKey,
        seen: Option<&'a Holder>,
    ) -> BoxFuture<'a, Result<()>> {
        (**self).holder_changed(key, seen)
    }
}

/// What a backend guarantees beyond the properties every backend has.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Capabilities;
///
/// let caps = Capabilities::new().fencing(true).fifo(true);
/// assert!(caps.has_fencing() && caps.is_fifo());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    fencing: bool,
    fifo: bool,
    session_leases: bool,
    read_write: bool,
    semaphores: bool,
}

impl Capabilities {
    /// No capabilities.
    pub const fn new() -> Self {
        Capabilities {
            fencing: false,
            fifo: false,
            session_leases: false,
            read_write: false,
            semaphores: false,
        }
    }

    /// Every acquisition gets a fencing token greater than those of all
    /// earlier acquisitions of the same key.
    pub const fn fencing(mut self, yes: bool) -> Self {
        self.fencing = yes;
        self
    }

    /// Waiters are granted the lock in the order they asked for it.
    pub const fn fifo(mut self, yes: bool) -> Self {
        self.fifo = yes;
        self
    }

    /// Locks live on a session of the client (etcd lease, ZooKeeper
    /// session): a guard that is leaked keeps its lock for as long as its
    /// client lives, and the lock ends only when the client dies and its
    /// session expires.
    pub const fn session_leases(mut self, yes: bool) -> Self {
        self.session_leases = yes;
        self
    }

    /// Read-write locks: [`Mode::Read`] and [`Mode::Write`].
    pub const fn read_write(mut self, yes: bool) -> Self {
        self.read_write = yes;
        self
    }

    /// Semaphores: [`Mode::Permits`].
    pub const fn semaphores(mut self, yes: bool) -> Self {
        self.semaphores = yes;
        self
    }

    /// Whether read-write locks are offered.
    pub const fn has_read_write(&self) -> bool {
        self.read_write
    }

    /// Whether semaphores are offered.
    pub const fn has_semaphores(&self) -> bool {
        self.semaphores
    }

    /// Whether `mode` is offered (plain locks always are).
    pub const fn supports(&self, mode: Mode) -> bool {
        match mode {
            Mode::Exclusive => true,
            Mode::Read | Mode::Write => self.read_write,
            Mode::Permits { .. } => self.semaphores,
        }
    }

    /// Whether locks live on a client session.
    pub const fn has_session_leases(&self) -> bool {
        self.session_leases
    }

    /// Whether fencing tokens are given.
    pub const fn has_fencing(&self) -> bool {
        self.fencing
    }

    /// Whether waiters are served first come, first served.
    pub const fn is_fifo(&self) -> bool {
        self.fifo
    }
}

/// How long an acquire may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// One attempt only.
    No,
    /// Until this instant.
    Until(Instant),
    /// As long as it takes.
    Forever,
}

impl Wait {
    /// The deadline, if there is one. `Wait::No` has a deadline of now.
    pub fn deadline(&self) -> Option<Instant> {
        match self {
            Wait::No => Some(Instant::now()),
            Wait::Until(d) => Some(*d),
            Wait::Forever => None,
        }
    }
}

/// Who keeps a lease alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseKind {
    /// The lock lives while its guard does: core's watchdog renews it, or the
    /// backend's session keeps it (see [`Acquired::kept_alive_by_backend`]).
    Watchdog,
    /// The lock expires after the lease and is never renewed.
    Fixed,
}

/// What an acquisition takes of its key.
///
/// A key names three objects, one per kind, that never meet: the plain
/// lock ([`Mode::Exclusive`]), the read-write lock ([`Mode::Read`] and
/// [`Mode::Write`]) and the semaphore ([`Mode::Permits`]). A backend keeps
/// them apart on its server.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Mode;
///
/// let permits = Mode::permits(2, 5)?;
/// assert_eq!(permits, Mode::Permits { count: 2, limit: 5 });
/// assert!(Mode::permits(6, 5).is_err());
/// assert!(Mode::Read.is_shared() && !Mode::Write.is_shared());
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mode {
    /// The whole key, alone: a plain lock.
    Exclusive,
    /// A reader of the key's read-write lock: with other readers, never
    /// with a writer, and never ahead of a writer that waits.
    Read,
    /// The writer of the key's read-write lock: alone.
    Write,
    /// `count` of the `limit` permits of the key's semaphore. Every holder
    /// and waiter of one semaphore names the same `limit`.
    Permits {
        /// How many permits this acquisition takes (1 to `limit`).
        count: u32,
        /// How many permits the semaphore has.
        limit: u32,
    },
}

impl Mode {
    /// `count` of `limit` permits.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](crate::LockError::InvalidOptions)
    /// unless `1 <= count <= limit`.
    pub fn permits(count: u32, limit: u32) -> Result<Mode> {
        if limit == 0 || count == 0 || count > limit {
            return Err(crate::LockError::InvalidOptions {
                reason: format!(
                    "a semaphore acquire takes 1 to `limit` permits of at least 1: \
                     got {count} of {limit}"
                ),
            });
        }
        Ok(Mode::Permits { count, limit })
    }

    /// How a server's queue entry says what it takes: `r`, `w`,
    /// `p{count}/{limit}`, and empty for a plain lock. The inverse of
    /// [`Mode::from_tag`].
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::backend::Mode;
    ///
    /// let two_of_five = Mode::Permits { count: 2, limit: 5 };
    /// assert_eq!(two_of_five.tag(), "p2/5");
    /// assert_eq!(Mode::from_tag("p2/5"), Some(two_of_five));
    /// assert_eq!(Mode::from_tag(&Mode::Read.tag()), Some(Mode::Read));
    /// assert_eq!(Mode::from_tag("p2"), None);
    /// ```
    pub fn tag(&self) -> String {
        match self {
            Mode::Read => "r".to_owned(),
            Mode::Write => "w".to_owned(),
            Mode::Permits { count, limit } => format!("p{count}/{limit}"),
            Mode::Exclusive => String::new(),
        }
    }

    /// The mode a [`tag`](Mode::tag) names; `None` for one it does not
    /// write.
    pub fn from_tag(tag: &str) -> Option<Mode> {
        match tag {
            "r" => Some(Mode::Read),
            "w" => Some(Mode::Write),
            "" => Some(Mode::Exclusive),
            _ => {
                let (count, limit) = tag.strip_prefix('p')?.split_once('/')?;
                Some(Mode::Permits {
                    count: count.parse().ok()?,
                    limit: limit.parse().ok()?,
                })
            }
        }
    }

    /// Whether other holders may hold the key with this one (a reader, or
    /// a permit).
    pub const fn is_shared(&self) -> bool {
        matches!(self, Mode::Read | Mode::Permits { .. })
    }
}

/// Whether an acquisition of `mode` holds its key, given the modes of
/// everything ahead of it in the key's queue (holders, and waiters that
/// came first): first come, first served. A reader holds when no writer is
/// ahead (so a waiting writer keeps later readers out), permits when those
/// ahead and its own fit the limit, anything else when nothing is ahead.
/// The one admission rule of every backend that queues shared modes
/// itself; pass [`Mode::Exclusive`] for an entry it cannot read, which
/// then blocks everything behind it.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::{admitted, Mode};
///
/// let two_of_three = Mode::Permits { count: 2, limit: 3 };
/// assert!(admitted(Mode::Read, [Mode::Read, Mode::Read]));
/// assert!(!admitted(Mode::Read, [Mode::Read, Mode::Write]));
/// assert!(admitted(two_of_three, [Mode::Permits { count: 1, limit: 3 }]));
/// assert!(!admitted(two_of_three, [two_of_three]));
/// assert!(admitted(Mode::Write, []));
/// ```
pub fn admitted(mode: Mode, ahead: impl IntoIterator<Item = Mode>) -> bool {
    let mut ahead = ahead.into_iter();
    match mode {
        Mode::Read => ahead.all(|m| m == Mode::Read),
        Mode::Permits { count, limit } => {
            let limit = u64::from(limit);
            let mut taken = u64::from(count);
            ahead.all(|m| {
                taken += match m {
                    Mode::Permits { count, .. } => u64::from(count),
                    _ => limit + 1,
                };
                taken <= limit
            }) && taken <= limit
        }
        _ => ahead.next().is_none(),
    }
}

/// One acquire request.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AcquireRequest<'a> {
    /// The key to lock.
    pub key: &'a LockKey,
    /// What to take of it: the whole key, a read or write share, or
    /// permits. A backend is only asked for the modes its
    /// [`Capabilities`] name.
    pub mode: Mode,
    /// The token to store with it.
    pub token: &'a Token,
    /// How long the server keeps the lock without a renewal.
    pub lease: Duration,
    /// Whether the lease will be renewed or is fixed.
    pub lease_kind: LeaseKind,
    /// How long to wait.
    pub wait: Wait,
    /// Where to report a loss the server tells the backend about.
    pub loss: LossReporter,
}

/// A granted lock, as the backend reports it.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Acquired;
/// use tokio::time::Instant;
///
/// let sent = Instant::now();
/// // ... send the request that wins the lock ...
/// let acquired = Acquired::new(sent).with_fence(42);
/// assert_eq!(acquired.fence(), Some(42));
/// ```
#[derive(Debug, Clone)]
pub struct Acquired {
    sent_at: Instant,
    fence: Option<u64>,
    kept_alive_by_backend: bool,
    lease_from: Option<(Instant, Duration)>,
}

impl Acquired {
    /// A lock won by a request sent at `sent_at`.
    pub fn new(sent_at: Instant) -> Self {
        Acquired {
            sent_at,
            fence: None,
            kept_alive_by_backend: false,
            lease_from: None,
        }
    }

    /// Says the server counts this lock's lease from `at` (no earlier than
    /// this instant, by the holder's clock) for `lease`, rather than from
    /// [`sent_at`](Acquired::sent_at) for the requested lease: for a lock
    /// bound to a session lease that was last renewed before this acquire.
    pub fn with_lease_from(mut self, at: Instant, lease: Duration) -> Self {
        self.lease_from = Some((at, lease));
        self
    }

    /// Where the lease is counted from, and how long it is, if not from
    /// `sent_at` for the requested lease.
    pub fn lease_from(&self) -> Option<(Instant, Duration)> {
        self.lease_from
    }

    /// Sets the fencing token.
    pub fn with_fence(mut self, fence: u64) -> Self {
        self.fence = Some(fence);
        self
    }

    /// Says that the backend keeps this lock alive itself (a session lease
    /// with its own keepalive): core's watchdog leaves it alone, and the
    /// backend moves the lease's end with [`LossReporter::extend`] after
    /// each keepalive and reports a loss with [`LossReporter::report`].
    /// Without an `extend`, the guard is lost when the lease counted at
    /// acquisition runs out.
    pub fn kept_alive_by_backend(mut self) -> Self {
        self.kept_alive_by_backend = true;
        self
    }

    /// When the winning request was sent.
    pub fn sent_at(&self) -> Instant {
        self.sent_at
    }

    /// The fencing token, if the backend gives one.
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    /// Whether the backend keeps the lease alive itself.
    pub fn is_kept_alive_by_backend(&self) -> bool {
        self.kept_alive_by_backend
    }
}

/// The result of a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The token held the lock, and now nobody does.
    Released,
    /// The token did not hold the lock (expired, or another owner's now);
    /// nothing was changed.
    NotHeld,
}

/// One lock to renew.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewRequest {
    /// The key.
    pub key: LockKey,
    /// What the token holds of it.
    pub mode: Mode,
    /// The token that must hold it.
    pub token: Token,
    /// The new lease, counted from when the server sees the request.
    pub lease: Duration,
}

/// The result of renewing one lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewOutcome {
    /// The token still held the lock, and its lease was extended.
    Renewed,
    /// The token no longer holds the lock; nothing was changed.
    NotHeld,
    /// No answer for this lock (some servers did not reply): the lease is
    /// not extended, and the holder's clock decides when it is over.
    Unknown,
}
