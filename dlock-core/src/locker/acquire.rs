//! One acquisition, start to end: the hold already in scope, the lease
//! and the wait limit, the backend's answer turned into a guard, and the
//! release of an attempt cut short.

use std::{sync::Arc, time::Duration};

use tokio::{runtime::Handle, time::Instant};
use tracing::Instrument;

use super::Locker;
use crate::{
    backend::{
        AcquireRequest, Backend, DynBackend, HolderNote, LeaseKind, LossReporter, Mode, Wait,
    },
    error::{LockError, Result},
    key::LockKey,
    locker::guard::{Hold, LockGuard},
    locker::lease::LeaseState,
    locker::options::{
        validate_lease, wait_deadline, Lease, LockOptions, MAX_LEASE, MAX_LOCK_DELAY, MIN_LEASE,
    },
    locker::release::{Release, ReleaseOnDrop},
    locker::scope::Scope,
    metrics::{self, AcquireOutcome},
    token::Token,
};

/// How long the servers may take to say they are there, when a wait limit
/// passed without a grant (see [`Backend::check_servers`]).
const CHECK_SERVERS_WITHIN: Duration = Duration::from_secs(1);

/// How long past the wait limit a backend may take to answer for its own
/// wait, before the attempt is dropped. A server ends a wait it bounds
/// itself (PostgreSQL's `lock_timeout`, a line's own deadline) a little
/// after the client's deadline, one way of the network later, and the
/// backend then undoes what the server may have granted in that instant:
/// a wait dropped before that would be ended from outside, after
/// `Timeout` was returned, and could be granted a release that comes in
/// between, keeping the next owner out for that moment.
const ANSWER_AFTER_LIMIT_WITHIN: Duration = Duration::from_millis(500);

impl Locker {
    /// Asks the backend whether its servers answer, bounded to
    /// [`CHECK_SERVERS_WITHIN`]; no answer in time is their error.
    async fn check_servers(&self) -> Result<()> {
        let backend = &self.shared.backend;
        match tokio::time::timeout(CHECK_SERVERS_WITHIN, backend.check_servers()).await {
            Ok(answer) => answer,
            Err(_) => Err(LockError::backend(
                backend.name(),
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the servers did not answer when the wait limit passed",
                ),
            )),
        }
    }

    /// Refuses what `options` (merged with the defaults) ask the server to
    /// keep past a release or a loss, where the backend cannot:
    /// a [`hold_at_least`](LockOptions::hold_at_least) or a
    /// [`lock_delay`](LockOptions::lock_delay) on a backend whose locks end
    /// with the client's session, a hold longer than a fixed lease, a delay
    /// over [`MAX_LOCK_DELAY`]. Answers the delay.
    pub(crate) fn check_server_lease_options(&self, options: LockOptions) -> Result<Duration> {
        server_lease_options(&*self.shared.backend, options)
    }
}

/// What [`Locker::check_server_lease_options`] checks, for `backend`; a
/// locker's defaults are checked when it is built.
pub(crate) fn server_lease_options(
    backend: &dyn DynBackend,
    options: LockOptions,
) -> Result<Duration> {
    let delay = options.get_lock_delay().unwrap_or(Duration::ZERO);
    let at_least = options.get_hold_at_least();
    let unsupported = |what| LockError::Unsupported {
        backend: backend.name(),
        what,
    };
    let server_leases = backend.capabilities().has_server_leases();
    if !delay.is_zero() && !server_leases {
        return Err(unsupported(
            "lock_delay (its locks end with the client's session or process)",
        ));
    }
    if delay > MAX_LOCK_DELAY {
        return Err(crate::InvalidReason::LockDelay { delay }.into());
    }
    let Some(at_least) = at_least else {
        return Ok(delay);
    };
    if !server_leases {
        return Err(unsupported(
            "hold_at_least (its locks end with the client's session or process)",
        ));
    }
    let fixed = match options.get_lease() {
        Some(Lease::Fixed(lease)) => Some(lease),
        _ => None,
    };
    if at_least > MAX_LEASE || fixed.is_some_and(|lease| at_least > lease) {
        return Err(crate::InvalidReason::HoldAtLeast {
            at_least,
            lease: fixed,
        }
        .into());
    }
    Ok(delay)
}

impl Locker {
    pub(super) async fn acquire(
        &self,
        key: &str,
        mode: Mode,
        options: LockOptions,
        once: bool,
    ) -> Result<Option<LockGuard>> {
        let key = LockKey::new(key)?;
        if let Mode::Permits { count, limit } = mode {
            Mode::permits(count, limit)?;
        }
        if !self.shared.backend.capabilities().supports(mode) {
            return Err(LockError::Unsupported {
                backend: self.shared.backend.name(),
                what: if mode == Mode::Read || mode == Mode::Write {
                    "read-write locks"
                } else {
                    "semaphores"
                },
            });
        }
        let options = options.or(self.shared.defaults);
        let (lease, lease_kind) = match options.get_lease().unwrap_or(Lease::Watchdog) {
            Lease::Watchdog => (self.shared.watchdog.lease(), LeaseKind::Watchdog),
            Lease::Fixed(lease) => {
                validate_lease(lease, MIN_LEASE)?;
                (lease, LeaseKind::Fixed)
            }
        };
        let delay = self.check_server_lease_options(options)?;
        let note = options
            .get_holder_note()?
            .unwrap_or_else(HolderNote::process);
        let hold_at_least = options.get_hold_at_least();
        if mode == Mode::Exclusive {
            if let Some(hold) = Scope::find(&self.shared, &key) {
                return LockGuard::reentered(hold).map(Some);
            }
        }
        let runtime = Handle::try_current().map_err(|_| LockError::NoRuntime)?;
        let start = Instant::now();
        let backend_name = self.shared.backend.name();
        let timer = metrics::AcquireTimer::start(backend_name, mode, start);
        let wait = match options.get_wait().flatten() {
            _ if once => Wait::No,
            // A zero limit is one whole attempt: bounded by a deadline that
            // has passed already, a request to a server would be cut off
            // before its answer could arrive, and never acquire.
            Some(limit) if limit.is_zero() => Wait::No,
            limit => match wait_deadline(start, limit) {
                Some(deadline) => Wait::Until(deadline),
                None => Wait::Forever,
            },
        };
        let span = tracing::info_span!(
            "dlock.acquire",
            key = %self.shared.traced(&key),
            mode = ?mode,
            backend = backend_name,
            waited_us = tracing::field::Empty,
            acquired = tracing::field::Empty,
            fence = tracing::field::Empty,
        );
        let acquire = async {
            let token = Token::generate();
            let lease_state = Arc::new(
                LeaseState::new(key.clone(), backend_name, self.shared.trace_keys)
                    .with_delay(delay),
            );
            // The server keeps the lock `delay` past the holder's lease.
            let lease = lease + delay;
            let request = AcquireRequest {
                key: &key,
                mode,
                token: &token,
                lease,
                lease_kind,
                wait,
                loss: LossReporter(lease_state.clone()),
                fair: options.get_fair(),
                note: note.as_str(),
                delay,
            };
            // Until the backend has answered for itself, the attempt may have
            // won on the server: if it is cut short (by the wait limit, by
            // the caller dropping this future, or by an error mid-flight),
            // release the token so no orphan holds the key for a lease.
            let mut unanswered = ReleaseOnDrop {
                runtime: &runtime,
                shared: &self.shared,
                release: Release {
                    key: key.clone(),
                    mode,
                    token,
                    lease,
                    until: None,
                    renewed_by: None,
                },
                armed: true,
            };
            let attempt = self.shared.backend.acquire(request);
            // The backend bounds its own wait, and answers for it; this
            // bound ends it whatever the backend does.
            let (outcome, cut_short) = match wait {
                Wait::Until(deadline) => match deadline.checked_add(ANSWER_AFTER_LIMIT_WITHIN) {
                    Some(give_up) => match tokio::time::timeout_at(give_up, attempt).await {
                        Ok(outcome) => (outcome, false),
                        Err(_) => (Ok(None), true),
                    },
                    // A limit the clock cannot count past: the backend's
                    // own bound is the only one.
                    None => (attempt.await, false),
                },
                Wait::No | Wait::Forever => (attempt.await, false),
            };
            unanswered.armed = cut_short || outcome.is_err();
            // Give back what an attempt cut short may hold now, before any
            // further await: the next waiter should not wait on it.
            drop(unanswered);
            let outcome = match (outcome, wait) {
                // Not granted within the limit: a timeout, unless the servers
                // stopped answering, whose error is then the truth.
                (Ok(None), Wait::Until(_)) => self.check_servers().await.map(|()| None),
                (outcome, _) => outcome,
            };
            let waited = start.elapsed();
            let span = tracing::Span::current();
            span.record("waited_us", waited.as_micros() as u64);
            let outcome =
                outcome.inspect_err(|error| tracing::warn!(%error, "dlock acquire failed"))?;
            span.record("acquired", outcome.is_some());
            let Some(acquired) = outcome else {
                return Ok(None);
            };
            if let Some(fence) = acquired.fence() {
                span.record("fence", fence);
            }
            let (from, length) = acquired.lease_from().unwrap_or((acquired.sent_at(), lease));
            lease_state.start(from, length);
            // No `.await` from the backend's answer to the hold that releases
            // on drop: a cancellation cannot strand the lock in between.
            let renewed = lease_kind == LeaseKind::Watchdog && !acquired.is_kept_alive_by_backend();
            let hold = Hold::new(
                &self.shared,
                key.clone(),
                mode,
                token,
                acquired.fence(),
                lease_state,
                renewed,
                lease_kind == LeaseKind::Fixed,
                runtime.clone(),
            );
            let guard = LockGuard::fresh(hold)?;
            if let Some(at_least) = hold_at_least {
                guard.hold().hold_at_least(at_least);
            }
            Ok(Some(guard))
        };
        let result = acquire.instrument(span).await;
        timer.finish(match &result {
            Ok(Some(_)) => AcquireOutcome::Acquired,
            Ok(None) if wait == Wait::No => AcquireOutcome::Busy,
            Ok(None) => AcquireOutcome::Timeout,
            Err(_) => AcquireOutcome::Error,
        });
        result
    }
}
