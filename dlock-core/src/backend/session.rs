//! `SessionHolders`: the guards that live on one backend session (an etcd
//! lease, a ZooKeeper session), renewed together and lost together. Written
//! once here so that session backends only speak their server's protocol.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use tokio::time::Instant;

use crate::{
    error::LostReason, locker::connection::ConnectionStates, locker::lease::LossReporter,
    token::Token,
};

/// The guards held on one session, with when the session was last known
/// alive. `T` is what the backend keeps per lock (its key name, or `()`).
///
/// # Examples
///
/// ```
/// use dlock_core::backend::SessionHolders;
/// use std::time::Duration;
/// use tokio::time::Instant;
///
/// let holders: SessionHolders<String> = SessionHolders::new(Instant::now());
/// // after each successful keepalive sent at `sent`:
/// holders.renewed(Instant::now(), Duration::from_secs(10));
/// // when the server says the session is gone:
/// assert!(holders.expire());
/// assert!(holders.is_expired());
/// ```
#[derive(Debug)]
pub struct SessionHolders<T> {
    inner: Mutex<Inner<T>>,
    ended: tokio::sync::Notify,
    /// The backend's connection state, fed by this session (see
    /// [`reporting_to`](SessionHolders::reporting_to)).
    states: Option<ConnectionStates>,
}

#[derive(Debug)]
struct Inner<T> {
    renewed_at: Instant,
    /// The renewal last passed on to every guard (see `renewed`).
    passed_on: Instant,
    /// Whether the guards were told the session is unsure.
    unsure: bool,
    expired: bool,
    holders: HashMap<Token, Holder<T>>,
}

#[derive(Debug)]
struct Holder<T> {
    loss: LossReporter,
    /// A fixed lease's end: renewals never extend the guard past it.
    ends: Option<Instant>,
    data: T,
}

impl<T: Clone> SessionHolders<T> {
    /// No holders, on a session known alive at `renewed_at`.
    pub fn new(renewed_at: Instant) -> Self {
        SessionHolders {
            inner: Mutex::new(Inner {
                renewed_at,
                passed_on: renewed_at,
                unsure: false,
                expired: false,
                holders: HashMap::new(),
            }),
            ended: tokio::sync::Notify::new(),
            states: None,
        }
    }

    /// No holders, on a session opened (so known alive) at `renewed_at`,
    /// that feeds the backend's connection state: the opening and every
    /// renewal are [`answered`](ConnectionStates::answered),
    /// [`unsure`](SessionHolders::unsure) is
    /// [`suspended`](ConnectionStates::suspended), and an
    /// [`expire`](SessionHolders::expire) that loses guards is
    /// [`lost`](ConnectionStates::lost) (also when the backend ends the
    /// session itself, since those guards are lost too). A session ended
    /// with no guard on it (a waiter's, given up) changes nothing, and an
    /// expired session reports nothing more.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{backend::{ConnectionStates, SessionHolders}, ConnectionState};
    /// use tokio::time::Instant;
    ///
    /// let states = ConnectionStates::new("mybackend");
    /// let holders: SessionHolders<()> = SessionHolders::reporting_to(Instant::now(), states.clone());
    /// holders.unsure();
    /// assert_eq!(states.get(), ConnectionState::Suspended);
    /// holders.expire(); // no guard on it: nothing lost
    /// assert_eq!(states.get(), ConnectionState::Suspended);
    /// ```
    pub fn reporting_to(renewed_at: Instant, states: ConnectionStates) -> Self {
        states.answered();
        SessionHolders {
            states: Some(states),
            ..Self::new(renewed_at)
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner<T>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the session was last known alive (sent time of the request the
    /// server answered).
    pub fn renewed_at(&self) -> Instant {
        self.inner().renewed_at
    }

    /// Whether the session has expired.
    pub fn is_expired(&self) -> bool {
        self.inner().expired
    }

    /// Tracks a lock held on the session (with a fixed lease ending at
    /// `ends`), and returns when the session was last known alive: every
    /// later renewal, and the expiry, reach this guard. `None`, and nothing
    /// tracked, if the session already expired.
    pub fn hold(
        &self,
        token: Token,
        loss: LossReporter,
        ends: Option<Instant>,
        data: T,
    ) -> Option<Instant> {
        let mut inner = self.inner();
        if inner.expired {
            return None;
        }
        inner.holders.insert(token, Holder { loss, ends, data });
        Some(inner.renewed_at)
    }

    /// Moves the end of the fixed lease of a lock still tracked, on a
    /// session not expired, to `lease` from now, and has `timers` end it
    /// then (see [`Backend::extend`](super::Backend::extend)). Answers the
    /// guard's new lease: until then, or until the session's own lease of
    /// `timeout` from when it was last known alive, whichever is earlier;
    /// `None`, and nothing changed, if the lock is not tracked.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::Duration;
    /// use dlock_core::{backend::{LeaseTimers, LossReporter, SessionHolders}, Token};
    /// use tokio::time::Instant;
    ///
    /// let holders: SessionHolders<()> = SessionHolders::new(Instant::now());
    /// let timers = LeaseTimers::new(|_| {});
    /// let timeout = Duration::from_secs(10);
    /// // Not held: nothing to extend.
    /// let lease = Duration::from_secs(60);
    /// assert_eq!(holders.extend_fixed(&Token::generate(), lease, timeout, &timers), None);
    /// # }
    /// ```
    pub fn extend_fixed(
        &self,
        token: &Token,
        lease: Duration,
        timeout: Duration,
        timers: &super::LeaseTimers,
    ) -> Option<(Instant, Duration)> {
        let sent = Instant::now();
        let ends = sent + lease;
        let alive_at = {
            let mut inner = self.inner();
            if inner.expired {
                return None;
            }
            let alive_at = inner.renewed_at;
            inner.holders.get_mut(token)?.ends = Some(ends);
            alive_at
        };
        timers.add(*token, ends);
        Some(if alive_at + timeout < ends {
            (alive_at, timeout)
        } else {
            (sent, lease)
        })
    }

    /// Stops tracking a lock, telling its guard it is lost for `reason` if
    /// one still listens (a release from elsewhere with its token, or a key
    /// deleted behind its back; core releases only once its guard is gone).
    pub fn forget(&self, token: &Token, reason: LostReason) {
        if let Some(holder) = self.inner().holders.remove(token) {
            holder.loss.report(reason);
        }
    }

    /// Whether the lock `token` holds is still tracked: held, and neither
    /// released nor lost.
    pub fn holds(&self, token: &Token) -> bool {
        self.inner().holders.contains_key(token)
    }

    /// The session was renewed by a request sent at `sent`, for `lease`:
    /// every guard holds until then (a fixed lease no further than its end),
    /// and none is unsure any more.
    ///
    /// Passed on to the guards only when it moves their lease by a tenth
    /// of it or more since the renewal last passed on (or they were told
    /// the session is unsure): a backend that counts every answered
    /// statement as a renewal (the SQL backends) then costs each statement
    /// O(1) rather than a visit to every guard of the session, which made
    /// holding 100,000 locks quadratic. A guard's lease so ends at most a
    /// tenth early, never late.
    pub fn renewed(&self, sent: Instant, lease: Duration) {
        let mut inner = self.inner();
        // Under the lock, so that an `unsure` cannot come in between; and
        // not for a session that expired (a statement answered late).
        if let (false, Some(states)) = (inner.expired, &self.states) {
            states.answered();
        }
        inner.renewed_at = sent;
        if !inner.unsure && sent < inner.passed_on + lease / 10 {
            return;
        }
        inner.passed_on = sent;
        inner.unsure = false;
        for holder in inner.holders.values() {
            let lease = match holder.ends {
                Some(ends) => lease.min(ends.saturating_duration_since(sent)),
                None => lease,
            };
            holder.loss.set_unsure(false);
            holder.loss.extend(sent, lease);
        }
    }

    /// The session is disconnected: every guard says it is unsure.
    pub fn unsure(&self) {
        let mut inner = self.inner();
        inner.unsure = true;
        for holder in inner.holders.values() {
            holder.loss.set_unsure(true);
        }
        if let (false, Some(states)) = (inner.expired, &self.states) {
            states.suspended();
        }
    }

    /// The session expired (or was given up): every guard on it is lost,
    /// and [`expired`](SessionHolders::expired) completes. Returns `false`
    /// if it had already expired.
    pub fn expire(&self) -> bool {
        let mut inner = self.inner();
        let first = !inner.expired;
        inner.expired = true;
        let lost = !inner.holders.is_empty();
        for (_, holder) in inner.holders.drain() {
            holder.loss.report(LostReason::SessionExpired);
        }
        if let (true, Some(states)) = (lost, &self.states) {
            states.lost();
        }
        drop(inner);
        self.ended.notify_waiters();
        first
    }

    /// Completes once the session has expired: for a wait on the session
    /// to end with it rather than outlive it.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use dlock_core::backend::SessionHolders;
    /// use tokio::time::Instant;
    ///
    /// let holders: SessionHolders<()> = SessionHolders::new(Instant::now());
    /// holders.expire();
    /// holders.expired().await; // at once
    /// # }
    /// ```
    pub async fn expired(&self) {
        let ended = self.ended.notified();
        tokio::pin!(ended);
        // Registered before the flag is read: an expiry in between wakes us.
        ended.as_mut().enable();
        if self.is_expired() {
            return;
        }
        ended.await;
    }

    /// What the backend keeps for each held lock.
    pub fn snapshot(&self) -> Vec<(Token, T)> {
        self.inner()
            .holders
            .iter()
            .map(|(token, h)| (*token, h.data.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{key::LockKey, locker::lease::LeaseState};

    const LEASE: Duration = Duration::from_secs(10);

    /// A guard on `holders`, its lease counted from the session's last
    /// renewal.
    fn guard(holders: &SessionHolders<()>) -> Arc<LeaseState> {
        let state = Arc::new(LeaseState::new(LockKey::new("k").unwrap(), "test", true));
        let from = holders
            .hold(Token::generate(), LossReporter(state.clone()), None, ())
            .expect("a live session");
        state.start(from, LEASE);
        state
    }

    /// A renewal less than a tenth of the lease after the one last passed
    /// on does not visit the guards (so a statement costs O(1)); the next
    /// one that is not does, and the guards' leases then end at most a
    /// tenth early.
    #[tokio::test(start_paused = true)]
    async fn renewals_reach_the_guards_once_per_tenth_of_the_lease() {
        let t0 = Instant::now();
        let holders = SessionHolders::new(t0);
        let skipped = guard(&holders);
        holders.renewed(t0 + LEASE / 20, LEASE);
        assert!(
            skipped.check(t0 + LEASE + LEASE / 40).is_some(),
            "a renewal within a tenth of the lease was passed on"
        );
        let holders = SessionHolders::new(t0);
        let renewed = guard(&holders);
        holders.renewed(t0 + LEASE / 20, LEASE);
        holders.renewed(t0 + LEASE / 10 + LEASE / 20, LEASE);
        assert_eq!(holders.renewed_at(), t0 + LEASE / 10 + LEASE / 20);
        assert!(
            renewed.check(t0 + LEASE + LEASE / 10).is_none(),
            "a renewal a tenth of the lease later was not passed on"
        );
        assert!(renewed.check(t0 + LEASE + LEASE / 5).is_some());
    }

    /// Once the guards were told the session is unsure, the next renewal
    /// reaches them at once, however soon it comes.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_after_unsure_reaches_the_guards_at_once() {
        let t0 = Instant::now();
        let holders = SessionHolders::new(t0);
        let state = guard(&holders);
        holders.unsure();
        assert!(state.is_unsure());
        holders.renewed(t0 + LEASE / 100, LEASE);
        assert!(!state.is_unsure(), "still unsure after a renewal");
    }
}
