//! The watchdog: one timer per locker renews every lease it keeps alive, in one
//! batched `Backend::renew` call per tick.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use tokio::{runtime::Handle, time::Instant};

use crate::{
    backend::{Backend, RenewOutcome, RenewRequest},
    error::LostReason,
    key::LockKey,
    lease::LeaseState,
    token::Token,
};

/// Renews at this fraction of the lease, so two renewals can fail before the
/// lease runs out.
const RENEWALS_PER_LEASE: u32 = 3;

/// The watchdog of one locker (and its clones). Its timer task holds only a
/// `Weak` of it, so the task ends when the last locker and hold are gone.
#[derive(Debug)]
pub(crate) struct Watchdog {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    lease: Duration,
    backend: Arc<dyn Backend>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    /// The id of the timer task that is running, if one is. A task that
    /// ends for any reason (no locks left, its runtime shut down, a panic)
    /// clears it, so the next registration starts a new one.
    timer: Option<u64>,
}

#[derive(Debug)]
struct Entry {
    request: RenewRequest,
    lease: Arc<LeaseState>,
}

impl Watchdog {
    pub(crate) fn new(lease: Duration, backend: Arc<dyn Backend>) -> Self {
        Watchdog {
            inner: Arc::new(Inner {
                lease,
                backend,
                state: Mutex::default(),
            }),
        }
    }

    /// The lease the watchdog keeps renewing.
    pub(crate) fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// Starts renewing `key` for `token`; returns the id to unregister with.
    /// Starts the timer task on `runtime` if it is not running.
    pub(crate) fn register(
        &self,
        key: LockKey,
        token: Token,
        lease: Arc<LeaseState>,
        runtime: &Handle,
    ) -> u64 {
        let inner = &self.inner;
        let mut state = inner.state();
        state.next_id += 1;
        let id = state.next_id;
        let request = RenewRequest {
            key,
            token,
            lease: inner.lease,
        };
        state.entries.insert(id, Entry { request, lease });
        if state.timer.is_none() {
            state.timer = Some(id);
            let timer = Timer {
                watchdog: Arc::downgrade(inner),
                id,
            };
            runtime.spawn(run(timer, inner.lease / RENEWALS_PER_LEASE));
        }
        id
    }

    pub(crate) fn unregister(&self, id: u64) {
        self.inner.state().entries.remove(&id);
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The locks to renew now; `None` when there are none, and the timer
    /// task `timer` should stop.
    fn due(&self, timer: u64) -> Option<Vec<(RenewRequest, Arc<LeaseState>)>> {
        let mut state = self.state();
        if state.entries.is_empty() {
            if state.timer == Some(timer) {
                state.timer = None;
            }
            return None;
        }
        Some(
            state
                .entries
                .values()
                .filter(|e| !e.lease.is_lost())
                .map(|e| (e.request.clone(), e.lease.clone()))
                .collect(),
        )
    }
}

/// The running timer task's identity; clears it from the watchdog when the
/// task ends, however it ends.
struct Timer {
    watchdog: Weak<Inner>,
    id: u64,
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some(watchdog) = self.watchdog.upgrade() {
            let mut state = watchdog.state();
            if state.timer == Some(self.id) {
                state.timer = None;
            }
        }
    }
}

async fn run(timer: Timer, period: Duration) {
    let mut ticker = tokio::time::interval_at(Instant::now() + period, period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(watchdog) = timer.watchdog.upgrade() else {
            return;
        };
        let Some(batch) = watchdog.due(timer.id) else {
            return;
        };
        if batch.is_empty() {
            continue;
        }
        let requests: Vec<RenewRequest> = batch.iter().map(|(r, _)| r.clone()).collect();
        let backend = &watchdog.backend;
        let sent = Instant::now();
        // A renewal slower than a period is as good as failed: the next tick
        // tries again, and the holders' clocks decide when the lease is over.
        match tokio::time::timeout(period, backend.renew(&requests)).await {
            Ok(Ok(outcomes)) if outcomes.len() == batch.len() => {
                for ((request, lease), outcome) in batch.iter().zip(outcomes) {
                    match outcome {
                        RenewOutcome::Renewed => lease.extend(sent, request.lease),
                        RenewOutcome::NotHeld => {
                            lease.mark_lost(LostReason::NotHeld);
                        }
                        RenewOutcome::Unknown => {}
                    }
                }
            }
            Ok(Ok(outcomes)) => {
                tracing::error!(
                    backend = backend.name(),
                    asked = batch.len(),
                    answered = outcomes.len(),
                    "dlock renewal answered for the wrong number of locks"
                );
            }
            Ok(Err(error)) => {
                tracing::warn!(backend = backend.name(), locks = batch.len(), %error, "dlock renewal failed");
            }
            Err(_) => {
                tracing::warn!(
                    backend = backend.name(),
                    locks = batch.len(),
                    ?period,
                    "dlock renewal timed out"
                );
            }
        }
        // Fire the loss of every lease that ran out without a renewal.
        let now = Instant::now();
        for (_, lease) in &batch {
            lease.check(now);
        }
    }
}
