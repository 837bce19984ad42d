//! The watchdog: a timer per locker and runtime renews the leases it keeps
//! alive, in one batched `Backend::renew` call per tick.
//!
//! Each hold is renewed by the timer of the runtime it was taken on. A timer
//! that stops ticking (its runtime shut down, or is no longer driven, as a
//! current-thread runtime outside `block_on`) has its holds adopted by the
//! timers that still tick, so renewal never depends on one runtime.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use tokio::{
    runtime::{self, Handle},
    time::Instant,
};

use crate::{
    backend::{Backend, DynBackend, Mode, RenewOutcome, RenewRequest},
    error::LostReason,
    key::LockKey,
    locker::lease::LeaseState,
    token::Token,
};

/// Renews at this fraction of the lease, so two renewals can fail before the
/// lease runs out.
const RENEWALS_PER_LEASE: u32 = 3;

/// The watchdog of one locker (and its clones). Its timer tasks hold only a
/// `Weak` of it, so they end when the last locker and hold are gone.
#[derive(Debug)]
pub(crate) struct Watchdog {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    lease: Duration,
    backend: Arc<dyn DynBackend>,
    state: Mutex<State>,
    /// Told when a renewal has been answered (or has timed out).
    settled: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    /// The timer task running on each runtime. A task that ends for any
    /// reason (no locks left, its runtime shut down, a panic) removes
    /// itself, so the next registration on that runtime starts a new one.
    timers: HashMap<runtime::Id, TimerState>,
    /// The entries of the renewals on their way, by id (an entry may be
    /// in two, from two timers).
    renewing: HashMap<u64, u32>,
}

#[derive(Debug)]
struct Entry {
    request: RenewRequest,
    lease: Arc<LeaseState>,
    /// The runtime the hold was taken on, whose timer renews it.
    runtime: runtime::Id,
}

#[derive(Debug)]
struct TimerState {
    id: u64,
    /// When the task last ticked (or was started).
    ticked_at: Instant,
}

impl Watchdog {
    pub(crate) fn new(lease: Duration, backend: Arc<dyn DynBackend>) -> Self {
        Watchdog {
            inner: Arc::new(Inner {
                lease,
                backend,
                state: Mutex::default(),
                settled: tokio::sync::Notify::new(),
            }),
        }
    }

    /// The lease the watchdog keeps renewing.
    pub(crate) fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// Starts renewing `key` for `token`; returns the id to unregister with.
    /// Starts a timer task on `runtime` if none runs there.
    pub(crate) fn register(
        &self,
        key: LockKey,
        mode: Mode,
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
            mode,
            token,
            // The server keeps the lock the delay past the holder's lease.
            lease: inner.lease + lease.delay(),
        };
        let runtime_id = runtime.id();
        state.entries.insert(
            id,
            Entry {
                request,
                lease,
                runtime: runtime_id,
            },
        );
        if let std::collections::hash_map::Entry::Vacant(vacant) = state.timers.entry(runtime_id) {
            vacant.insert(TimerState {
                id,
                ticked_at: Instant::now(),
            });
            let timer = Timer {
                watchdog: Arc::downgrade(inner),
                id,
                runtime: runtime_id,
            };
            runtime.spawn(run(timer, inner.lease / RENEWALS_PER_LEASE));
        }
        id
    }

    pub(crate) fn unregister(&self, id: u64) {
        self.inner.state().entries.remove(&id);
    }

    /// Completes once no renewal of entry `id` is on its way: at once if
    /// none is, else when it has been answered or has timed out (a renewal
    /// period at most).
    pub(crate) async fn renewal_settled(&self, id: u64) {
        loop {
            let settled = self.inner.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if !self.inner.state().renewing.contains_key(&id) {
                return;
            }
            settled.await;
        }
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The locks `timer` renews now: those taken on its runtime, and those
    /// whose runtime's timer has not ticked for a period and a half (or is
    /// gone): a renewal then still comes before the lease (three periods)
    /// runs out.
    /// `None` when there are none, and the timer task should stop.
    fn due(
        &self,
        timer: &Timer,
        period: Duration,
    ) -> Option<Vec<(u64, RenewRequest, Arc<LeaseState>)>> {
        let now = Instant::now();
        let mut state = self.state();
        if let Some(mine) = state.timers.get_mut(&timer.runtime) {
            if mine.id == timer.id {
                mine.ticked_at = now;
            }
        }
        let state = &mut *state;
        let stalled = |runtime: &runtime::Id| {
            state
                .timers
                .get(runtime)
                .is_none_or(|t| now.saturating_duration_since(t.ticked_at) > period * 3 / 2)
        };
        let mut serves_any = false;
        let mut due = Vec::new();
        for (&id, entry) in &state.entries {
            if entry.runtime != timer.runtime && !stalled(&entry.runtime) {
                continue;
            }
            serves_any = true;
            if !entry.lease.is_lost() {
                due.push((id, entry.request.clone(), entry.lease.clone()));
            }
        }
        for (id, _, _) in &due {
            *state.renewing.entry(*id).or_default() += 1;
        }
        if !serves_any {
            if state
                .timers
                .get(&timer.runtime)
                .is_some_and(|t| t.id == timer.id)
            {
                state.timers.remove(&timer.runtime);
            }
            return None;
        }
        Some(due)
    }
}

/// A running timer task's identity; removes it from the watchdog when the
/// task ends, however it ends.
struct Timer {
    watchdog: Weak<Inner>,
    id: u64,
    runtime: runtime::Id,
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some(watchdog) = self.watchdog.upgrade() {
            let mut state = watchdog.state();
            if state
                .timers
                .get(&self.runtime)
                .is_some_and(|t| t.id == self.id)
            {
                state.timers.remove(&self.runtime);
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
        let Some(batch) = watchdog.due(&timer, period) else {
            return;
        };
        if batch.is_empty() {
            continue;
        }
        let requests: Vec<RenewRequest> = batch.iter().map(|(_, r, _)| r.clone()).collect();
        // Marked in `due`, unmarked however this renewal ends.
        let _settles = Settles {
            watchdog: &watchdog,
            ids: batch.iter().map(|(id, _, _)| *id).collect(),
        };
        let backend = &watchdog.backend;
        let sent = Instant::now();
        // A renewal slower than a period is as good as failed: the next tick
        // tries again, and the holders' clocks decide when the lease is over.
        let answer = tokio::time::timeout(period, backend.renew(&requests)).await;
        let outcome = match &answer {
            Ok(Ok(_)) => "ok",
            Ok(Err(_)) => "error",
            Err(_) => "timeout",
        };
        crate::metrics::renewal(backend.name(), outcome, sent.elapsed());
        match answer {
            Ok(Ok(outcomes)) if outcomes.len() == batch.len() => {
                for ((_, request, lease), outcome) in batch.iter().zip(outcomes) {
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
        for (_, _, lease) in &batch {
            lease.check(now);
        }
    }
}

/// A renewal's entries, marked as on their way until it is dropped.
struct Settles<'a> {
    watchdog: &'a Inner,
    ids: Vec<u64>,
}

impl Drop for Settles<'_> {
    fn drop(&mut self) {
        let mut state = self.watchdog.state();
        for id in &self.ids {
            if let std::collections::hash_map::Entry::Occupied(mut count) =
                state.renewing.entry(*id)
            {
                *count.get_mut() -= 1;
                if *count.get() == 0 {
                    count.remove();
                }
            }
        }
        drop(state);
        self.watchdog.settled.notify_waiters();
    }
}
