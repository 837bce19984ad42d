//! Per-call options (`LockOptions`) and how they combine with a `Locker`'s defaults.

use std::time::Duration;

use tokio::time::Instant;

use crate::{backend::HolderNote, error::Result};

/// The shortest fixed lease accepted. The holder counts its lease 1 % + 2 ms
/// short, to absorb clock drift, so a shorter lease would be over almost
/// before the answer arrived.
pub const MIN_LEASE: Duration = Duration::from_millis(10);
/// The longest lease accepted (30 days). A longer lease keeps a crashed
/// holder's lock longer than any operator would wait.
pub const MAX_LEASE: Duration = Duration::from_secs(30 * 24 * 3600);

/// The longest [`lock_delay`](LockOptions::lock_delay): a minute, as
/// Chubby allows.
pub const MAX_LOCK_DELAY: Duration = Duration::from_secs(60);
/// The shortest watchdog lease accepted: the watchdog renews at a third of
/// it, and a shorter period would renew faster than a round trip.
pub const MIN_WATCHDOG_LEASE: Duration = Duration::from_millis(30);

/// How long a lease lasts.
///
/// # Examples
///
/// ```
/// use dlock_core::{Lease, LockOptions};
/// use std::time::Duration;
///
/// let fixed = LockOptions::new().lease(Duration::from_secs(10));
/// assert_eq!(fixed.get_lease(), Some(Lease::Fixed(Duration::from_secs(10))));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// The lease is renewed by a watchdog for as long as the guard lives; a
    /// crashed holder keeps the lock for at most the locker's watchdog lease.
    Watchdog,
    /// The lease is never renewed: the lock expires after this long, and the
    /// guard reports itself lost at that moment.
    Fixed(Duration),
}

/// Options for one call of [`Locker::lock_with`](crate::Locker::lock_with).
///
/// Options left unset take the [`Locker`](crate::Locker)'s defaults.
///
/// # Examples
///
/// ```
/// use dlock_core::{Locker, LockOptions, MemoryBackend};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = Locker::new(MemoryBackend::new());
/// let opts = LockOptions::new()
///     .wait(Duration::from_secs(5))
///     .lease(Duration::from_secs(30));
/// let guard = locker.lock_with("invoice:7", opts).await?;
/// assert!(!guard.is_lost());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockOptions {
    wait: Option<Option<Duration>>,
    lease: Option<Lease>,
    hold_at_least: Option<Duration>,
    lock_delay: Option<Duration>,
    fair: Option<bool>,
    note: Option<NoteSetting>,
}

/// A [`LockOptions::holder_note`] as given: checked at the acquire, so
/// that the builder stays infallible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NoteSetting {
    Note(HolderNote),
    TooLong(usize),
}

impl LockOptions {
    /// Options that take every default from the locker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits `limit` for the lock, then fails with
    /// [`LockError::Timeout`](crate::LockError::Timeout). A zero limit makes one attempt.
    ///
    /// At the limit the backend ends its wait on the server and answers
    /// once the server has let it go, a round trip later: a grant the
    /// server made in that instant is yours, and nothing of the wait is
    /// left on the server when `Timeout` comes. Past the limit, the wait
    /// for that answer lasts at most half a second; an answer later than
    /// that is dropped, and the wait is cleaned up behind the `Timeout`
    /// (so are the file backend's waits, whose thread cannot be stopped:
    /// it lets a lock that comes later go at once).
    pub fn wait(mut self, limit: Duration) -> Self {
        self.wait = Some(Some(limit));
        self
    }

    /// Waits as long as it takes.
    pub fn wait_forever(mut self) -> Self {
        self.wait = Some(None);
        self
    }

    /// A fixed lease: the lock expires `lease` after it was granted, and is
    /// never renewed. A lock won after a wait gets its whole lease, on every
    /// backend; the holder counts it from just before the request that won
    /// the lock was sent (the grant, or a little earlier), so its guard
    /// ends no later than the server's hold.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(Lease::Fixed(lease));
        self
    }

    /// A lease renewed by the watchdog while the guard lives.
    pub fn watchdog(mut self) -> Self {
        self.lease = Some(Lease::Watchdog);
        self
    }

    /// Keeps the key held until `at_least` after the grant, whenever the
    /// guard is released: a release before then leaves the lock on the
    /// server until that time (by the server's lease, so the releasing
    /// process may exit), with its fence and holder unchanged. A job that
    /// runs once per period takes it with `hold_at_least` a little under
    /// the period, so that a fast run on one machine and a late tick on
    /// another do not both run the same period. A lock lost before then
    /// (a crash, with a lease shorter than `at_least`) frees as usual.
    /// When the hold ends, the key goes to whoever asks first: a waiter
    /// already in line is woken (on Redis, a read-write lock's or
    /// semaphore's waiter at its next look instead), but not served first.
    /// Only a grant the caller got is held on: a key that
    /// [`lock_all`](crate::Locker::lock_all) gives back unused is released
    /// at once.
    ///
    /// Backends whose locks end with the client's session or process
    /// refuse it with [`LockError::Unsupported`](crate::LockError::Unsupported)
    /// (see [`Capabilities::has_server_leases`](crate::backend::Capabilities::has_server_leases)).
    /// With a fixed lease it may not exceed the lease. A re-entered guard
    /// keeps the first acquisition's.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let once_a_minute = LockOptions::new().hold_at_least(Duration::from_secs(55));
    /// let guard = locker.lock_with("report:hourly", once_a_minute).await?;
    /// // ... the job, done in a second ...
    /// guard.release().await?;
    /// assert!(locker.try_lock("report:hourly").await?.is_none()); // until 55 s after the grant
    /// # Ok(())
    /// # }
    /// ```
    pub fn hold_at_least(mut self, at_least: Duration) -> Self {
        self.hold_at_least = Some(at_least);
        self
    }

    /// After a loss without a release, keeps the key from everyone for
    /// `delay` more: a holder whose lease ran out, whose renewals stopped
    /// reaching the server, or whose process died, is past its lease by
    /// its own clock while the server still refuses the key for `delay`.
    /// A store that cannot check fencing tokens gets that long for the
    /// lost holder's last writes to land or fail. A release while the
    /// lock holds frees the key at once, as always; a release after the
    /// holder's lease ran out (a guard dropped once it was lost) keeps the
    /// delay. At most [`MAX_LOCK_DELAY`].
    ///
    /// The server's lease is the lock's lease plus `delay`; the guard
    /// counts the lease alone, so it reports
    /// [`lost`](crate::LockGuard::lost) before anyone else can be granted
    /// the key. Backends whose locks end with the client's session or
    /// process refuse it with
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) (see
    /// [`Capabilities::has_server_leases`](crate::backend::Capabilities::has_server_leases)).
    /// A re-entered guard keeps the first acquisition's.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, LockOptions, MemoryBackend};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let options = LockOptions::new()
    ///     .lease(Duration::from_millis(100))
    ///     .lock_delay(Duration::from_millis(500));
    /// let guard = locker.lock_with("ledger", options).await?;
    /// guard.lost().await; // the lease ran out, and the guard is kept
    /// tokio::time::sleep(Duration::from_millis(100)).await;
    /// assert!(locker.try_lock("ledger").await?.is_none()); // until the delay is over
    /// # Ok(())
    /// # }
    /// ```
    pub fn lock_delay(mut self, delay: Duration) -> Self {
        self.lock_delay = Some(delay);
        self
    }

    /// Whether waiters are served in the order they came (`true`, the
    /// default) or whoever asks first after a release wins (`false`).
    ///
    /// Unfair locking takes the key the way most Redis lock libraries do:
    /// a plain attempt, and a wait for the server's word that the key was
    /// released, with no line. It needs fewer requests per lock and hands
    /// a key over faster under contention, but a waiter may be passed over
    /// again and again (starvation). The owner token, the lost signal,
    /// fencing and cancel safety are kept. Backends without a cheaper
    /// unfair way (every one but Redis) lock fairly either way.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::LockOptions;
    ///
    /// let fast = LockOptions::new().fair(false);
    /// assert_eq!(fast.get_fair(), Some(false));
    /// ```
    pub fn fair(mut self, fair: bool) -> Self {
        self.fair = Some(fair);
        self
    }

    /// The note stored with the grant, for operators who read the key's
    /// [`holder`](crate::Locker::holder) or [`list`](crate::Locker::list)
    /// the held locks: what job, request or deploy holds it. Without one,
    /// a lock carries `HOSTNAME:PID` ([`HolderNote::process`]). It travels
    /// with the acquire request: no extra round trip.
    ///
    /// At most [`MAX_HOLDER_NOTE`](crate::backend::MAX_HOLDER_NOTE) bytes:
    /// a longer note makes the acquire fail with
    /// [`InvalidReason::HolderNote`](crate::InvalidReason::HolderNote),
    /// before anything is sent. Backends that store no note (see the
    /// README's table) ignore it.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, LockOptions, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let noted = LockOptions::new().holder_note("nightly-report, run 812");
    /// let _guard = locker.lock_with("report", noted).await?;
    /// let holder = locker.holder("report").await?.expect("held");
    /// assert_eq!(holder.note(), Some("nightly-report, run 812"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn holder_note(mut self, note: impl AsRef<str>) -> Self {
        let note = note.as_ref();
        self.note = Some(match HolderNote::new(note) {
            Ok(note) => NoteSetting::Note(note),
            Err(_) => NoteSetting::TooLong(note.len()),
        });
        self
    }

    /// The [`holder_note`](LockOptions::holder_note) set here, if any.
    ///
    /// # Errors
    ///
    /// [`InvalidReason::HolderNote`](crate::InvalidReason::HolderNote) for
    /// a note set too long.
    pub fn get_holder_note(&self) -> Result<Option<HolderNote>> {
        match self.note {
            None => Ok(None),
            Some(NoteSetting::Note(note)) => Ok(Some(note)),
            Some(NoteSetting::TooLong(len)) => Err(crate::InvalidReason::HolderNote {
                len,
                max: crate::backend::MAX_HOLDER_NOTE,
            }
            .into()),
        }
    }

    /// The wait limit set here: `None` if unset, `Some(None)` for no limit.
    pub fn get_wait(&self) -> Option<Option<Duration>> {
        self.wait
    }

    /// The lease set here, if any.
    pub fn get_lease(&self) -> Option<Lease> {
        self.lease
    }

    /// The [`hold_at_least`](LockOptions::hold_at_least) set here, if any.
    pub fn get_hold_at_least(&self) -> Option<Duration> {
        self.hold_at_least
    }

    /// The [`lock_delay`](LockOptions::lock_delay) set here, if any.
    pub fn get_lock_delay(&self) -> Option<Duration> {
        self.lock_delay
    }

    /// The [`fair`](LockOptions::fair) choice set here, if any.
    pub fn get_fair(&self) -> Option<bool> {
        self.fair
    }

    /// These options without their `hold_at_least`, and it.
    pub(crate) fn take_hold_at_least(mut self) -> (LockOptions, Option<Duration>) {
        let at_least = self.hold_at_least.take();
        (self, at_least)
    }

    /// Fills unset options from `defaults`.
    pub(crate) fn or(self, defaults: LockOptions) -> LockOptions {
        LockOptions {
            wait: self.wait.or(defaults.wait),
            lease: self.lease.or(defaults.lease),
            hold_at_least: self.hold_at_least.or(defaults.hold_at_least),
            lock_delay: self.lock_delay.or(defaults.lock_delay),
            fair: self.fair.or(defaults.fair),
            note: self.note.or(defaults.note),
        }
    }
}

/// Checks a fixed or watchdog lease duration.
pub(crate) fn validate_lease(lease: Duration, min: Duration) -> Result<()> {
    if lease < min || lease > MAX_LEASE {
        return Err(crate::InvalidReason::Lease {
            lease,
            min,
            max: MAX_LEASE,
        }
        .into());
    }
    Ok(())
}

/// The instant a wait of `limit` started at `start` ends; `None` when it
/// never ends, including when it is too far away to represent.
pub(crate) fn wait_deadline(start: Instant, limit: Option<Duration>) -> Option<Instant> {
    limit.and_then(|limit| start.checked_add(limit))
}

/// How much earlier than the server the holder considers its lease over, to
/// absorb clock rate differences: 1% of the lease plus 2 ms, as in Redlock.
pub(crate) fn clock_drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_options_take_defaults() {
        let defaults = LockOptions::new()
            .wait(Duration::from_secs(1))
            .lease(Duration::from_secs(9));
        let merged = LockOptions::new().wait_forever().or(defaults);
        assert_eq!(merged.get_wait(), Some(None));
        assert_eq!(
            merged.get_lease(),
            Some(Lease::Fixed(Duration::from_secs(9)))
        );
    }

    #[test]
    fn lease_bounds_are_enforced() {
        assert!(validate_lease(Duration::ZERO, MIN_LEASE).is_err());
        assert!(validate_lease(Duration::from_millis(9), MIN_LEASE).is_err());
        assert!(validate_lease(MIN_LEASE, MIN_LEASE).is_ok());
        assert!(validate_lease(MAX_LEASE, MIN_LEASE).is_ok());
        assert!(validate_lease(MAX_LEASE + Duration::from_nanos(1), MIN_LEASE).is_err());
        assert!(validate_lease(Duration::MAX, MIN_LEASE).is_err());
    }

    #[test]
    fn huge_wait_limits_mean_forever_instead_of_overflowing() {
        let now = Instant::now();
        assert_eq!(wait_deadline(now, Some(Duration::MAX)), None);
        assert_eq!(wait_deadline(now, None), None);
        assert!(wait_deadline(now, Some(Duration::from_secs(1))).is_some());
    }
}
