//! Acquiring a server's own named lock: this process's turn at the key,
//! one uncontended attempt on the key's holder session, and, if refused, a
//! wait on the server on a waiter session, first come, first served.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{
    backend::{AcquireRequest, Acquired, LeaseKind, Mode, Share, Wait},
    LockError, Result, Token,
};
use tokio::time::Instant;

use super::{
    answered_within, backend_error, lock, EndOnDrop, Owned, Retry, Session, SqlBackend, Turn,
};
use crate::{Dialect, Granted};

/// How a mode takes the key's local turn: readers of one process share
/// it (their session holds the key shared, once per reader); any other
/// mode takes it alone.
fn share(mode: Mode) -> Share {
    if mode == Mode::Read {
        Share::Shared
    } else {
        Share::Alone
    }
}

/// How long a key counts as contended after an attempt at it was refused:
/// its next waits skip the try on the holder session.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// Why a wait on the server gave no answer.
enum WaitFailed<D: Dialect> {
    /// Its session ended (or none could be opened): worth waiting again on
    /// a new one, with the turn at the key given back.
    SessionEnded(LockError, Turn<D>),
    /// Anything else: the caller's error.
    Other(LockError),
}

impl<D: Dialect> SqlBackend<D> {
    pub(super) async fn lock_or_wait(&self, req: &AcquireRequest<'_>) -> Result<Option<Acquired>> {
        if self.inner.dialect.queues(req.mode) {
            return self.acquire_queued(req).await;
        }
        let id = self.inner.dialect.lock_id(req.key, req.mode);
        let Some(turn) = self.inner.local.take(&id, share(req.mode), req.wait).await else {
            return Ok(None);
        };
        let mut retry = Retry::new(req.wait, self.inner.dialect.settings().connect_timeout());
        let mut turn = turn;
        loop {
            // Refused a moment ago: the try would most likely be refused
            // again, so wait on the server at once (one statement less).
            if req.wait == Wait::No || !self.recently_contended(&id) {
                let (holder, sent, fence, back) =
                    self.try_on_holder(&id, req.mode, turn, &mut retry).await?;
                if let Some(fence) = fence {
                    return self.granted(
                        req,
                        holder,
                        id,
                        Some(back),
                        false,
                        sent,
                        fence,
                        *req.token,
                    );
                }
                turn = back;
                self.mark_contended(&id);
                if req.wait == Wait::No {
                    return Ok(None);
                }
            }
            match self.wait_on_server(req, &id, turn).await {
                Ok(outcome) => return Ok(outcome),
                // The waiter session ended (a server restart, a cut
                // connection): wait again on a new one, within the limit.
                Err(WaitFailed::SessionEnded(error, back)) => {
                    retry.after(error).await?;
                    turn = back;
                }
                Err(WaitFailed::Other(error)) => return Err(error),
            }
        }
    }

    /// One uncontended attempt on `id`'s holder session, on a new session
    /// if it ended (within `retry`): the session, when the attempt was sent,
    /// the fence if granted, and the turn back.
    ///
    /// The undo of a grant nobody takes is armed inside the statement's own
    /// task, from the server's answer: an attempt dropped before it was
    /// sent undoes nothing, and one dropped after undoes exactly the hold
    /// the server granted to it. An unlock sent for a read that was never
    /// granted would remove another reader's hold of the same session,
    /// where the server stacks them.
    async fn try_on_holder(
        &self,
        id: &D::Id,
        mode: Mode,
        turn: Turn<D>,
        retry: &mut Retry,
    ) -> Result<(Arc<Session<D>>, Instant, Option<i64>, Turn<D>)> {
        // The turn goes with the statement once it is sent: a grant's undo
        // keeps it until the unlock ran, so that no other task's hold of
        // the key on the session is undone instead.
        let turn = Arc::new(Mutex::new(Some(turn)));
        loop {
            let holder = match self.holder(id).await {
                Ok(holder) => holder,
                Err(e) => {
                    retry.after(e).await?;
                    continue;
                }
            };
            let (attempt, on, cell) = (id.clone(), holder.clone(), turn.clone());
            // Another reader of this process may hold the key on the
            // session: then a writer that waits comes first.
            let behind_writers = mode == Mode::Read && self.inner.local.others(id);
            let answer = holder
                .run(move |d, c| {
                    Box::pin(async move {
                        let answer = if behind_writers {
                            d.try_read_behind_writers(c, &attempt).await
                        } else {
                            d.try_lock(c, &attempt, mode).await
                        };
                        let undo = |granted| UnlockOnDrop {
                            session: Some(on.clone()),
                            id: attempt.clone(),
                            mode,
                            turn: lock(&cell).take(),
                            granted,
                        };
                        match answer {
                            // Undone when dropped unclaimed: with the task's
                            // output, if the caller left.
                            Ok(Some(fence)) => Ok(Some((fence, undo(true)))),
                            Ok(None) => Ok(None),
                            // The session ended, and its locks with it.
                            Err(e) if d.ends_the_session(&e) => Err(e),
                            // A failure after the grant is possible (the
                            // token could not be taken): undone at once.
                            Err(e) => {
                                drop(undo(false));
                                Err(e)
                            }
                        }
                    })
                })
                .await;
            match answer {
                Ok((sent, Some((fence, undo)))) => {
                    let turn = undo.defuse().expect("a grant's undo holds the turn");
                    return Ok((holder, sent, Some(fence), turn));
                }
                Ok((sent, None)) => {
                    let turn = lock(&turn).take().expect("a refusal leaves the turn");
                    return Ok((holder, sent, None, turn));
                }
                // The session ended (the server restarted, the connection
                // was cut) before or while the attempt ran: its locks went
                // with it; try on a new one.
                Err(e) if !holder.is_usable() && lock(&turn).is_some() => {
                    retry.after(backend_error::<D>(e)).await?;
                }
                Err(e) => return Err(backend_error::<D>(e)),
            }
        }
    }

    /// Whether an attempt at `id` was refused within [`CONTENDED_FOR`].
    fn recently_contended(&self, id: &D::Id) -> bool {
        lock(&self.inner.contended)
            .get(id)
            .is_some_and(|at| at.elapsed() < CONTENDED_FOR)
    }

    /// Remembers that an attempt at `id` was refused now; forgets keys
    /// not refused for a while once there are many.
    fn mark_contended(&self, id: &D::Id) {
        let mut contended = lock(&self.inner.contended);
        if contended.len() >= 1024 {
            contended.retain(|_, at| at.elapsed() < CONTENDED_FOR);
        }
        contended.insert(id.clone(), Instant::now());
    }

    /// Blocks on a waiter session until the server grants the lock or the
    /// wait limit passes.
    async fn wait_on_server(
        &self,
        req: &AcquireRequest<'_>,
        id: &D::Id,
        turn: Turn<D>,
    ) -> std::result::Result<Option<Acquired>, WaitFailed<D>> {
        let deadline = req.wait.deadline();
        let slot = self.inner.waiters.clone();
        let slot = match deadline {
            Some(d) => match tokio::time::timeout_at(d, slot.acquire_owned()).await {
                Ok(slot) => slot,
                Err(_) => return Ok(None),
            },
            None => slot.acquire_owned().await,
        }
        .map_err(|e| WaitFailed::Other(backend_error::<D>(e)))?;
        let session = match self.waiter_session().await {
            Ok(session) => session,
            Err(error) => return Err(WaitFailed::SessionEnded(error, turn)),
        };
        // Ends the session if this future is dropped mid-wait (or the wait
        // fails in a way that may follow a grant): the server may grant
        // the lock to it at any moment, and nobody would release.
        let mut abandon = EndOnDrop {
            backend: self.clone(),
            session: Some(session.clone()),
        };
        let limit = deadline.map(|d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        let waited = match session.live().await {
            Ok(mut live) => {
                let sent = live.sent;
                // A wait blocks on the server for its limit; past that and
                // a session timeout with no answer, the connection is gone.
                let within = limit.map_or(Duration::MAX, |l| l.saturating_add(session.timeout));
                let answer = answered_within(
                    within,
                    self.inner.dialect.wait(live.conn(), id, req.mode, limit),
                )
                .await;
                live.done(answer).map(|granted| (sent, granted))
            }
            Err(e) => Err(e),
        };
        match waited {
            Ok((sent, Some(Granted { fence, took }))) => {
                // The statement's send time plus the server's time on it is
                // no later than the server's end of it, where its idle
                // clock starts: the lease counts from there. Never later
                // than the answer's arrival, whatever the server's clock
                // said (a lease counted from the future would outlast the
                // server's).
                let took = took.min(sent.elapsed());
                abandon.session = None;
                // The slot bounds waits, not holds: free at the grant.
                drop(slot);
                self.granted(
                    req,
                    session,
                    id.clone(),
                    Some(turn),
                    true,
                    sent + took,
                    fence,
                    *req.token,
                )
                .map_err(WaitFailed::Other)
            }
            Ok((_, None)) => {
                // Not granted: the session is as it was, ready for another
                // wait.
                abandon.session = None;
                self.put_idle(session);
                drop(turn);
                Ok(None)
            }
            Err(e) if !session.is_usable() => {
                Err(WaitFailed::SessionEnded(backend_error::<D>(e), turn))
            }
            Err(e) => Err(WaitFailed::Other(backend_error::<D>(e))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn granted(
        &self,
        req: &AcquireRequest<'_>,
        session: Arc<Session<D>>,
        id: D::Id,
        turn: Option<Turn<D>>,
        on_waiter: bool,
        sent: Instant,
        fence: i64,
        entry: Token,
    ) -> Result<Option<Acquired>> {
        let fixed_end = (req.lease_kind == LeaseKind::Fixed).then(|| sent + req.lease);
        let Some(confirmed_at) = session
            .holders
            .hold(*req.token, req.loss.clone(), fixed_end, ())
        else {
            return Err(backend_error::<D>(std::io::Error::other(
                "the session ended as the lock was granted",
            )));
        };
        lock(&self.inner.owned).insert(
            *req.token,
            Owned {
                session: session.clone(),
                id,
                mode: req.mode,
                releasing: Arc::default(),
                _turn: turn,
                fixed_end,
                on_waiter,
                fence,
                entry,
                proclaimed: false,
            },
        );
        let alive_at = confirmed_at.max(sent);
        let mut acquired = Acquired::new(sent).kept_alive_by_backend();
        if self.inner.dialect.fences() {
            acquired = acquired.with_fence(u64::try_from(fence).unwrap_or(0));
        }
        Ok(Some(match fixed_end {
            None => acquired.with_lease_from(alive_at, session.timeout),
            Some(ends) => {
                // Session locks have no TTL: end the lease here.
                self.inner.lease_ends.add(*req.token, ends);
                if alive_at + session.timeout < ends {
                    acquired.with_lease_from(alive_at, session.timeout)
                } else {
                    acquired.with_lease_from(sent, req.lease)
                }
            }
        }))
    }
}

/// Undoes an uncontended attempt's grant on the holder session that nobody
/// took: its caller left before reading the answer, or the attempt failed
/// after the grant. Made in the statement's task from the server's answer,
/// so that it undoes exactly what the server granted. Keeps this process's
/// turn at the key until the unlock ran after the attempt (the session
/// runs one statement at a time, in order), so no other task's grant of
/// the key on that session is undone instead.
struct UnlockOnDrop<D: Dialect> {
    session: Option<Arc<Session<D>>>,
    id: D::Id,
    mode: Mode,
    turn: Option<Turn<D>>,
    /// Whether the server said it granted the lock: if unknown (a failure
    /// after the statement was sent), a read ends the session instead, as
    /// an unlock could remove another reader's hold that the session holds
    /// too.
    granted: bool,
}

impl<D: Dialect> UnlockOnDrop<D> {
    /// Claims the grant: nothing to undo; the turn back.
    fn defuse(mut self) -> Option<Turn<D>> {
        self.session = None;
        self.turn.take()
    }
}

impl<D: Dialect> Drop for UnlockOnDrop<D> {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let turn = self.turn.take();
        if !self.granted && self.mode == Mode::Read {
            // Every hold on the session goes, and their guards are told.
            session.end();
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send it from: end the session instead, when
            // it is dropped with its connection.
            session.holders.expire();
            return;
        };
        let (id, mode) = (self.id.clone(), self.mode);
        runtime.spawn(async move {
            if let Ok(mut live) = session.live().await {
                let answer = answered_within(
                    session.timeout,
                    session.dialect.unlock(live.conn(), &id, mode),
                )
                .await;
                if live.done(answer).is_err() && session.is_usable() {
                    session.end();
                }
            }
            drop(turn);
        });
    }
}
