//! What core asks of a backend and what the backend answers: acquire,
//! release and renew.

use std::time::Duration;

use tokio::time::Instant;

#[cfg(doc)]
use super::Capabilities;
use super::{LossReporter, Mode};
use crate::{key::LockKey, token::Token};

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
    /// How long the server keeps the lock without a renewal: the holder's
    /// lease and the [`delay`](AcquireRequest::delay) after it.
    pub lease: Duration,
    /// Whether the lease will be renewed or is fixed.
    pub lease_kind: LeaseKind,
    /// How long to wait.
    pub wait: Wait,
    /// Where to report a loss the server tells the backend about.
    pub loss: LossReporter,
    /// Whether waiters must be served in the order they came:
    /// [`LockOptions::fair`](crate::LockOptions::fair), `None` where the
    /// caller left it to the backend's default. A backend without a
    /// cheaper unfair way ignores it.
    pub fair: Option<bool>,
    /// The note to store with the grant, in the same request (see
    /// [`HolderNote`](super::HolderNote)), for
    /// [`Backend::holder`](super::Backend::holder) and
    /// [`Backend::list`](super::Backend::list) to show.
    pub note: &'a str,
    /// Of the [`lease`](AcquireRequest::lease), how long the server keeps
    /// the lock past the holder's own lease
    /// ([`LockOptions::lock_delay`](crate::LockOptions::lock_delay)):
    /// a grant is worth having, and a waiter's place in a line lives, by
    /// the [`holder_lease`](AcquireRequest::holder_lease) alone.
    pub delay: Duration,
}

impl AcquireRequest<'_> {
    /// The holder's lease: the [`lease`](AcquireRequest::lease) less the
    /// [`delay`](AcquireRequest::delay).
    pub fn holder_lease(&self) -> Duration {
        self.lease.saturating_sub(self.delay)
    }
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
