//! The lost signal: one per acquisition, shared by its guards, the watchdog and
//! the backend, which each may find that the lock is gone.

use std::{
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use crate::{error::LostReason, key::LockKey, locker::options::clock_drift};

/// Loss state of one acquisition.
///
/// Once lost, always lost: `is_lost` never goes back to `false`, even when a
/// renewal that was sent in time is answered late.
#[derive(Debug)]
pub(crate) struct LeaseState {
    key: LockKey,
    backend: &'static str,
    /// Whether the lost event shows the key.
    trace_key: bool,
    inner: Mutex<Inner>,
    notify: Notify,
    /// How much longer than the holder's lease the server keeps the lock
    /// ([`LockOptions::lock_delay`](crate::LockOptions::lock_delay)):
    /// every lease this state is given is the server's, and the holder's
    /// ends this much earlier.
    delay: Duration,
}

#[derive(Debug)]
struct Inner {
    /// When the lease runs out by the holder's clock; `None` when a backend
    /// session keeps it and reports the loss itself.
    deadline: Option<Instant>,
    lost: Option<LostReason>,
    /// The guards are gone and the lock is being released: later reports
    /// are about a lock nobody holds, and are not news.
    released: bool,
    /// The backend is disconnected and cannot tell whether the lock holds.
    unsure: bool,
    /// How long the lease lasts from a renewal (set by `start`).
    length: Duration,
}

impl LeaseState {
    pub(crate) fn new(key: LockKey, backend: &'static str, trace_key: bool) -> Self {
        LeaseState {
            key,
            backend,
            trace_key,
            inner: Mutex::new(Inner {
                deadline: None,
                lost: None,
                released: false,
                unsure: false,
                length: Duration::ZERO,
            }),
            notify: Notify::new(),
            delay: Duration::ZERO,
        }
    }

    /// This state, for a lock the server keeps `delay` past the holder's
    /// lease.
    pub(crate) fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// How much longer than the holder's lease the server keeps the lock.
    pub(crate) fn delay(&self) -> Duration {
        self.delay
    }

    /// When a server lease asked for at `sent` ends by the holder's clock.
    fn end(&self, sent: Instant, lease: Duration) -> Instant {
        lease_end(sent, lease, self.delay)
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // The critical sections below cannot panic, so poisoning cannot leave
        // the state half-written; recover instead of propagating a panic.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the holder's clock: the lease was asked for at `sent`.
    pub(crate) fn start(&self, sent: Instant, lease: Duration) {
        let mut inner = self.inner();
        inner.length = lease.saturating_sub(self.delay);
        let end = self.end(sent, lease);
        // A renewal the backend reported before the guard was made counts.
        inner.deadline = Some(inner.deadline.map_or(end, |d| d.max(end)));
    }

    /// Until when the server keeps a lock this holder lost by its own
    /// clock (its lease ran out unrenewed): the end of the holder's lease
    /// plus the delay. `None` without a delay, or while the lock holds.
    pub(crate) fn delayed_until(&self) -> Option<Instant> {
        if self.delay.is_zero() {
            return None;
        }
        let inner = self.inner();
        match (&inner.lost, inner.deadline) {
            (Some(LostReason::LeaseExpired), Some(end)) => end.checked_add(self.delay),
            _ => None,
        }
    }

    /// How long the holder's lease lasts from a renewal (the server's, as
    /// given to `start`, less the delay).
    pub(crate) fn length(&self) -> Duration {
        self.inner().length
    }

    /// The reason the lock was lost, if it was, checking the deadline against
    /// `now`.
    pub(crate) fn check(&self, now: Instant) -> Option<LostReason> {
        let mut inner = self.inner();
        if inner.lost.is_none() && inner.deadline.is_some_and(|d| now >= d) {
            self.set_lost(&mut inner, LostReason::LeaseExpired);
        }
        inner.lost.clone()
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.check(Instant::now()).is_some()
    }

    /// Marks the lock lost. Returns `false` if it already was.
    pub(crate) fn mark_lost(&self, reason: LostReason) -> bool {
        let mut inner = self.inner();
        if inner.lost.is_some() {
            return false;
        }
        // If the lease ran out first, that is why it was lost, whoever
        // noticed it.
        let reason = match inner.deadline {
            Some(d) if Instant::now() >= d => LostReason::LeaseExpired,
            _ => reason,
        };
        self.set_lost(&mut inner, reason);
        true
    }

    /// The last guard went: the lock is being released on purpose.
    pub(crate) fn mark_released(&self) {
        self.inner().released = true;
    }

    fn set_lost(&self, inner: &mut Inner, reason: LostReason) {
        if inner.released {
            return;
        }
        let key = crate::key::TracedKey {
            key: &self.key,
            shown: self.trace_key,
        };
        tracing::warn!(key = %key, backend = self.backend, %reason, "dlock lock lost");
        crate::metrics::lost(self.backend, &reason);
        inner.lost = Some(reason);
        self.notify.notify_waiters();
    }

    /// A renewal sent at `sent` succeeded: move the deadline, unless the old
    /// one has already passed (then the lock may have changed hands, and the
    /// guard stays lost).
    pub(crate) fn extend(&self, sent: Instant, lease: Duration) {
        let now = Instant::now();
        let mut inner = self.inner();
        if inner.lost.is_some() {
            return;
        }
        match inner.deadline {
            Some(d) if now >= d => self.set_lost(&mut inner, LostReason::LeaseExpired),
            Some(d) => inner.deadline = Some(d.max(self.end(sent, lease))),
            // Not started yet: `start` keeps whichever end is later.
            None => inner.deadline = Some(self.end(sent, lease)),
        }
    }

    /// A request sent at `sent` may move the lease's end to `lease` after
    /// it: until its answer, the guard counts with the earlier of the two
    /// ends.
    pub(crate) fn cap(&self, sent: Instant, lease: Duration) {
        let mut inner = self.inner();
        let end = self.end(sent, lease);
        if inner.deadline.is_some_and(|d| end < d) {
            inner.deadline = Some(end);
            self.notify.notify_waiters();
        }
    }

    /// A fixed lease was moved by a request sent at `sent`: it now ends
    /// `lease` after that, earlier or later than before, unless the old end
    /// has passed (then the lock may have changed hands, and the guard
    /// stays lost). Returns whether the guard still holds.
    pub(crate) fn reset(&self, sent: Instant, lease: Duration) -> bool {
        let now = Instant::now();
        let mut inner = self.inner();
        if inner.lost.is_some() {
            return false;
        }
        if inner.deadline.is_some_and(|d| now >= d) {
            self.set_lost(&mut inner, LostReason::LeaseExpired);
            return false;
        }
        inner.deadline = Some(self.end(sent, lease));
        inner.length = lease.saturating_sub(self.delay);
        // An earlier end: `lost` sleeps until the old one.
        self.notify.notify_waiters();
        true
    }

    /// Whether the backend cannot tell right now if the lock is still
    /// held (disconnected, within its session timeout).
    pub(crate) fn is_unsure(&self) -> bool {
        self.inner().unsure
    }

    fn set_unsure(&self, unsure: bool) {
        self.inner().unsure = unsure;
    }

    /// Completes when the lock is lost.
    pub(crate) async fn lost(&self) -> LostReason {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = self.check(Instant::now()) {
                return reason;
            }
            let deadline = self.inner().deadline;
            match deadline {
                Some(d) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(d) => {}
                    }
                }
                None => notified.await,
            }
        }
    }
}

/// The instant a server lease asked for at `sent` ends by the holder's
/// clock: `delay` earlier, less the drift margin. Saturates instead of
/// overflowing.
fn lease_end(sent: Instant, lease: Duration, delay: Duration) -> Instant {
    let holders = lease.saturating_sub(delay);
    let usable = holders.saturating_sub(clock_drift(holders));
    sent.checked_add(usable).unwrap_or(sent)
}

/// The handle a backend keeps to report that a lock it granted is gone.
///
/// A backend whose server ends the lock on its own (an expired etcd lease or
/// ZooKeeper session) calls [`report`](LossReporter::report); the guard's
/// [`is_lost`](crate::LockGuard::is_lost) and
/// [`lost`](crate::LockGuard::lost) see it at once. Reporting more than once
/// is harmless.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::LossReporter;
/// use dlock_core::LostReason;
///
/// fn on_session_expired(holders: &[LossReporter]) {
///     for h in holders {
///         h.report(LostReason::SessionExpired);
///     }
/// }
/// # on_session_expired(&[]);
/// ```
#[derive(Clone, Debug)]
pub struct LossReporter(pub(crate) Arc<LeaseState>);

impl LossReporter {
    /// Marks the lock lost for `reason`. Returns `false` if it already was.
    pub fn report(&self, reason: LostReason) -> bool {
        self.0.mark_lost(reason)
    }

    /// Whether the lock has been lost, by report or by its deadline.
    pub fn is_lost(&self) -> bool {
        self.0.is_lost()
    }

    /// The lease was renewed by a request sent at `sent`, for `lease`: the
    /// guard holds until then (less the drift margin), unless its old
    /// deadline has already passed.
    pub fn extend(&self, sent: Instant, lease: Duration) {
        self.0.extend(sent, lease);
    }

    /// Says whether the backend is cut off from its server and cannot tell
    /// if the lock still holds (a ZooKeeper session that is disconnected
    /// but not yet expired). The guard stays held meanwhile, and reports
    /// [`HoldState::Unsure`](crate::HoldState::Unsure).
    pub fn set_unsure(&self, unsure: bool) {
        self.0.set_unsure(unsure);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> LeaseState {
        LeaseState::new(LockKey::new("k").unwrap(), "test", true)
    }

    #[tokio::test(start_paused = true)]
    async fn fixed_lease_is_lost_at_its_deadline_and_stays_lost() {
        let s = state();
        let sent = Instant::now();
        s.start(sent, Duration::from_secs(1));
        assert!(!s.is_lost());
        let reason = s.lost().await;
        assert_eq!(reason, LostReason::LeaseExpired);
        let elapsed = sent.elapsed();
        assert!(elapsed <= Duration::from_secs(1), "lost after {elapsed:?}");
        assert!(
            elapsed >= Duration::from_millis(980),
            "lost after {elapsed:?}"
        );
        s.extend(Instant::now(), Duration::from_secs(10));
        assert!(s.is_lost(), "a renewal must not revive a lost lease");
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_moves_the_deadline() {
        let s = state();
        s.start(Instant::now(), Duration::from_secs(1));
        tokio::time::sleep(Duration::from_millis(500)).await;
        s.extend(Instant::now(), Duration::from_secs(1));
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(!s.is_lost());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(s.is_lost());
    }

    /// With a delay, every lease given is the server's: the holder's ends
    /// the delay earlier, its drift margin taken on the holder's lease
    /// alone (a short lease with a long delay is not lost at its grant),
    /// and once it ran out the server keeps the lock until the holder's
    /// end plus the delay.
    #[tokio::test(start_paused = true)]
    async fn a_delay_is_the_servers_and_not_the_holders() {
        let delay = Duration::from_secs(60);
        let s = state().with_delay(delay);
        let sent = Instant::now();
        s.start(sent, Duration::from_millis(100) + delay);
        assert_eq!(s.length(), Duration::from_millis(100));
        assert!(!s.is_lost(), "lost at its grant");
        assert_eq!(
            s.delayed_until(),
            None,
            "a lock that holds is kept by nobody"
        );
        tokio::time::sleep(Duration::from_millis(90)).await;
        s.extend(Instant::now(), Duration::from_millis(100) + delay);
        tokio::time::sleep(Duration::from_millis(90)).await;
        assert!(!s.is_lost(), "a renewal did not move the holder's end");
        assert_eq!(s.lost().await, LostReason::LeaseExpired);
        let lost = sent.elapsed();
        assert!(
            (Duration::from_millis(180)..=Duration::from_millis(190)).contains(&lost),
            "lost {lost:?} after the grant, its renewal 90 ms in"
        );
        let until = s.delayed_until().expect("kept after the loss");
        assert!(until >= sent + lost + delay - Duration::from_millis(1));
    }

    #[tokio::test]
    async fn report_wakes_lost_future() {
        let s = Arc::new(state());
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.lost().await }
        });
        tokio::task::yield_now().await;
        assert!(LossReporter(s.clone()).report(LostReason::SessionExpired));
        assert!(!LossReporter(s).report(LostReason::NotHeld));
        assert_eq!(waiter.await.unwrap(), LostReason::SessionExpired);
    }
}
