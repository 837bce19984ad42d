//! The memory backend's wait steps, for core's wait engine.

use std::{sync::Arc, time::Duration};

use tokio::{sync::Notify, time::Instant};

use super::{Entry, MemoryBackend, Waiter};
use crate::{
    backend::{
        wait::{Look, StepError, WaitSteps, Woken},
        AcquireRequest, Mode,
    },
    key::LockKey,
    token::Token,
};

/// The memory backend's wait steps: a waiter stands in its key's line (a
/// [`QueuePlace`]), woken by whoever may have admitted it; only the head
/// of the line also looks when the holders' leases end.
pub(super) struct Steps<'a>(pub(super) &'a MemoryBackend);

impl WaitSteps for Steps<'_> {
    type TurnKey = ();
    type Entry = QueuePlace;
    type Wake = ();

    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut QueuePlace>,
        join: bool,
    ) -> std::result::Result<Look<QueuePlace>, StepError> {
        let backend = self.0;
        let (key, mode) = (req.key, req.mode);
        let now = Instant::now();
        let mut state = backend.state();
        let line = state.entry(key, mode);
        line.expire(now);
        let Some(place) = entry else {
            line.check_limit(key, mode).map_err(StepError::Fatal)?;
            if line.queue.is_empty() && line.admits_now(mode) {
                backend.holders_changed(mode);
                return Ok(Look::Granted(state.grant(req, now)));
            }
            if !join {
                state.forget_if_idle(key, mode);
                return Ok(Look::Refused {
                    entry: None,
                    again: None,
                });
            }
            let wake = Arc::new(Notify::new());
            line.queue.push_back(Waiter {
                token: *req.token,
                mode,
                wake: wake.clone(),
            });
            let again = head_again(line, now);
            return Ok(Look::Refused {
                entry: Some(QueuePlace {
                    backend: backend.clone(),
                    key: key.clone(),
                    mode,
                    token: *req.token,
                    wake,
                    queued: true,
                }),
                again,
            });
        };
        let index = line.queue.iter().position(|w| w.token == *req.token);
        if let Some(index) = index.filter(|&i| line.admits_waiter(i)) {
            line.queue.remove(index);
            place.queued = false;
            let granted = state.grant(req, now);
            backend.holders_changed(mode);
            // Those behind may be admitted too now (readers, permits), and
            // the new head must watch the holders' expiry.
            state.entry(key, mode).wake();
            return Ok(Look::Granted(granted));
        }
        let again = if index == Some(0) {
            head_again(line, now)
        } else {
            None
        };
        Ok(Look::Refused { entry: None, again })
    }

    // `arm` keeps its default: a wake-up that comes before the wait is
    // kept by the waiter's `Notify` (`notify_one` stores it).

    async fn changed(
        &self,
        _req: &AcquireRequest<'_>,
        entry: &mut QueuePlace,
        _wake: &mut Option<()>,
        until: Instant,
    ) -> std::result::Result<Woken, StepError> {
        let _ = tokio::time::timeout_at(until, entry.wake.notified()).await;
        Ok(Woken::LookAgain)
    }

    // `withdraw` keeps its default: the place's `Drop` leaves the line.

    fn unreachable_after(&self) -> Duration {
        // Nothing here fails for a while and then recovers.
        Duration::ZERO
    }
}

/// When the head of a line should look again unwoken: when the first of
/// the holders' leases ends (expiry announces nothing).
fn head_again(line: &Entry, now: Instant) -> Option<Duration> {
    line.next_expiry()
        .map(|at| at.saturating_duration_since(now))
}

/// A waiter's place in a key's line, given up on drop.
pub(super) struct QueuePlace {
    backend: MemoryBackend,
    key: LockKey,
    mode: Mode,
    token: Token,
    wake: Arc<Notify>,
    queued: bool,
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        if !self.queued {
            return;
        }
        let mut state = self.backend.state();
        let entry = state.entry(&self.key, self.mode);
        entry.queue.retain(|w| w.token != self.token);
        entry.expire(Instant::now());
        entry.wake();
        state.forget_if_idle(&self.key, self.mode);
    }
}
