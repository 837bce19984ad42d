//! Waiting for a server's own named lock, driven by core's wait engine
//! ([`drive`](dlock_core::backend::wait::drive)): this process's turn at
//! the key first, then one uncontended attempt on the key's holder session
//! and, if refused, a wait on the server on a waiter session, first come,
//! first served. The wait keeps its place in the server's queue until the
//! wait limit ([`WaitSteps::look_again_within`] is `None`).

use std::{sync::Arc, time::Duration};

use dlock_core::{
    backend::{
        wait::{Armed, Look, StepError, TurnAt, WaitSteps, Woken},
        AcquireRequest, Acquired, BoxFuture, LeaseKind, LocalTurn, Mode, Share,
    },
    Token,
};
use tokio::time::Instant;

use super::{
    answered_within, backend_error, lock, step_error, Answer, EndOnDrop, Owned, Session, SqlBackend,
};
use crate::{Dialect, Granted};

/// How long a key counts as contended after an attempt at it was refused:
/// its next waits skip the try on the holder session.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// The wait steps of a lock the server has (a plain lock, a read-write
/// lock where the server shares): the look is an attempt on the key's
/// holder session, and the wait for a change a wait on the server, which
/// ends by itself with the grant.
pub(super) struct ServerWait<'b, D: Dialect> {
    pub(super) backend: &'b SqlBackend<D>,
    pub(super) id: D::Id,
}

impl<D: Dialect> WaitSteps for ServerWait<'_, D> {
    type TurnKey = D::Id;
    /// The server's queue keeps the place: nothing to keep between looks.
    type Entry = ();
    type Wake = ();

    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut ()>,
        join: bool,
    ) -> Answer<Look<()>> {
        let stand = (join && entry.is_none()).then_some(());
        let backend = self.backend;
        let past = req.wait.deadline().is_some_and(|d| Instant::now() >= d);
        // A wait on the server that ran to the limit has looked already;
        // and refused a moment ago, the try would most likely be refused
        // again: wait on the server at once (one statement less).
        if join && ((entry.is_some() && past) || backend.recently_contended(&self.id)) {
            return Ok(Look::Refused {
                entry: stand,
                again: None,
            });
        }
        let (holder, sent, fence) = backend.try_on_holder(&self.id, req.mode).await?;
        let Some(fence) = fence else {
            backend.mark_contended(&self.id);
            return Ok(Look::Refused {
                entry: stand,
                again: None,
            });
        };
        let acquired =
            backend.granted(req, holder, self.id.clone(), false, sent, fence, *req.token)?;
        Ok(Look::Granted(acquired))
    }

    async fn arm(
        &self,
        _req: &AcquireRequest<'_>,
        _entry: &mut (),
        _wake: &mut Option<()>,
    ) -> Answer<Armed> {
        Ok(Armed::Wait)
    }

    async fn changed(
        &self,
        req: &AcquireRequest<'_>,
        _entry: &mut (),
        _wake: &mut Option<()>,
        until: Instant,
    ) -> Answer<Woken> {
        self.backend.wait_on_server(req, &self.id, until).await
    }

    /// Nothing to leave: a wait that ran out left the server's queue.
    async fn withdraw(&self, _req: &AcquireRequest<'_>, _entry: ()) -> Answer<()> {
        Ok(())
    }

    fn unreachable_after(&self) -> Duration {
        self.backend.inner.dialect.settings().connect_timeout()
    }

    /// Readers of one process share the key's turn (their session holds
    /// the key shared, once per reader); any other mode takes it alone.
    /// Taken first: a session's locks are reentrant on the server, and two
    /// scopes must never both hold a key through one session.
    fn turn(&self, req: &AcquireRequest<'_>) -> Option<TurnAt<'_, D::Id>> {
        Some(TurnAt {
            turns: &self.backend.inner.local,
            key: self.id.clone(),
            share: if req.mode == Mode::Read {
                Share::Shared
            } else {
                Share::Alone
            },
            first: true,
        })
    }

    /// Kept with the lock, until its release.
    fn keep_turn(&self, req: &AcquireRequest<'_>, turn: LocalTurn<D::Id>) {
        if let Some(owned) = lock(&self.backend.inner.owned).get_mut(req.token) {
            owned._turn = Some(turn);
        }
    }

    fn look_again_within(&self) -> Option<Duration> {
        None
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// One uncontended attempt on `id`'s holder session: the session, when
    /// the attempt was sent, and the fence if granted.
    ///
    /// A grant nobody takes is undone from the server's answer: an attempt
    /// dropped before it was sent undoes nothing, and one dropped after
    /// undoes exactly the hold the server granted to it (the server stacks
    /// a session's holds of one key, so that unlock takes no other task's).
    /// An attempt that fails after it was sent may have been granted: it is
    /// undone within its own statement, before anything else runs on the
    /// session, where an unlock of a lock it was not granted could only
    /// remove this attempt's own hold.
    async fn try_on_holder(
        &self,
        id: &D::Id,
        mode: Mode,
    ) -> Answer<(Arc<Session<D>>, Instant, Option<i64>)> {
        let holder = self.holder(id).await.map_err(StepError::Retry)?;
        let (attempt, on) = (id.clone(), holder.clone());
        // Another reader of this process may hold the key on the session:
        // then a writer that waits comes first.
        let behind_writers = mode == Mode::Read && self.inner.local.others(id);
        let answer = holder
            .run(move |d, c| {
                Box::pin(async move {
                    let answer = if behind_writers {
                        d.try_read_behind_writers(c, &attempt).await
                    } else {
                        d.try_lock(c, &attempt, mode).await
                    };
                    match answer {
                        // Undone when dropped unclaimed: with the task's
                        // output, if the caller left.
                        Ok(Some(fence)) => Ok(Ok(Some((
                            fence,
                            UnlockOnDrop {
                                session: Some(on),
                                id: attempt,
                                mode,
                            },
                        )))),
                        Ok(None) => Ok(Ok(None)),
                        // The session ended, and its locks with it.
                        Err(e) if d.ends_the_session(&e) => Err(e),
                        // A failure after the grant is possible (the token
                        // could not be taken). A read's unlock could take
                        // another reader's hold of the session instead:
                        // its session ends (its guards are told).
                        Err(e) => {
                            if mode == Mode::Read || d.unlock(c, &attempt, mode).await.is_err() {
                                on.end();
                            }
                            Ok(Err(e))
                        }
                    }
                })
            })
            .await;
        match answer {
            Ok((sent, Ok(Some((fence, mut undo))))) => {
                undo.session = None;
                Ok((holder, sent, Some(fence)))
            }
            Ok((sent, Ok(None))) => Ok((holder, sent, None)),
            Ok((_, Err(e))) => Err(StepError::Fatal(backend_error::<D>(e))),
            // The session ended (the server restarted, the connection was
            // cut) before or while the attempt ran: its locks went with it;
            // tried again on a new one.
            Err(e) => Err(step_error(&holder, e)),
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

    /// Blocks on a waiter session until the server grants the lock or
    /// `until` (the wait limit) passes.
    async fn wait_on_server(
        &self,
        req: &AcquireRequest<'_>,
        id: &D::Id,
        until: Instant,
    ) -> Answer<Woken> {
        let limit = req.wait.deadline().map(|_| {
            until
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        let (mode, waited_for) = (req.mode, id.clone());
        let waited = self
            .on_waiter(req, until, limit, move |d, c| {
                Box::pin(async move { d.wait(c, &waited_for, mode, limit).await })
            })
            .await?;
        let Some((session, sent, granted)) = waited else {
            return Ok(Woken::LookAgain);
        };
        let Some(Granted { fence, took }) = granted else {
            // Not granted: the session is as it was, ready for another wait.
            self.put_idle(session);
            return Ok(Woken::LookAgain);
        };
        // The statement's send time plus the server's time on it is no
        // later than the server's end of it, where its idle clock starts:
        // the lease counts from there. Never later than the answer's
        // arrival, whatever the server's clock said (a lease counted from
        // the future would outlast the server's).
        let took = took.min(sent.elapsed());
        let acquired = self.granted(
            req,
            session,
            id.clone(),
            true,
            sent + took,
            fence,
            *req.token,
        )?;
        Ok(Woken::Granted(acquired))
    }

    /// Runs `statement`, which blocks on the server for `limit`, on a
    /// waiter session that holds nothing, within a waiter slot (they bound
    /// the sessions that wait) taken by `until` if the wait has a limit:
    /// the session, when the statement was sent, and its answer; `None` if
    /// no slot came in time. The slot bounds waits, not holds: it is free
    /// again at the answer.
    ///
    /// A statement dropped mid-way, or failed, ends its session: the
    /// server may grant the session a lock at any moment, and nobody would
    /// release it.
    pub(super) async fn on_waiter<'s, T>(
        &'s self,
        req: &AcquireRequest<'_>,
        until: Instant,
        limit: Option<Duration>,
        statement: impl for<'c> FnOnce(
            &'c D,
            &'c mut D::Conn,
        ) -> BoxFuture<'c, std::result::Result<T, sqlx::Error>>,
    ) -> Answer<Option<(Arc<Session<D>>, Instant, T)>> {
        let slot = self.inner.waiters.clone().acquire_owned();
        let slot = match req.wait.deadline() {
            Some(_) => match tokio::time::timeout_at(until, slot).await {
                Ok(slot) => slot,
                Err(_) => return Ok(None),
            },
            None => slot.await,
        }
        .map_err(|e| StepError::Fatal(backend_error::<D>(e)))?;
        let session = self.waiter_session().await.map_err(StepError::Retry)?;
        let mut abandon = EndOnDrop {
            backend: self.clone(),
            session: Some(session.clone()),
        };
        let mut live = session.live().await.map_err(|e| step_error(&session, e))?;
        let sent = live.sent;
        // Past its limit and a session timeout with no answer, the
        // connection is gone.
        let within = limit.map_or(Duration::MAX, |l| l.saturating_add(session.timeout));
        let answer = answered_within(within, statement(&self.inner.dialect, live.conn())).await;
        let answer = live.done(answer).map_err(|e| step_error(&session, e))?;
        abandon.session = None;
        drop(slot);
        Ok(Some((session, sent, answer)))
    }

    /// Books a grant: the lock is held, on `session`, under the request's
    /// token; `entry` names a queued mode's entry.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn granted(
        &self,
        req: &AcquireRequest<'_>,
        session: Arc<Session<D>>,
        id: D::Id,
        on_waiter: bool,
        sent: Instant,
        fence: i64,
        entry: Token,
    ) -> std::result::Result<Acquired, StepError> {
        let fixed_end = (req.lease_kind == LeaseKind::Fixed).then(|| sent + req.lease);
        let Some(confirmed_at) = session
            .holders
            .hold(*req.token, req.loss.clone(), fixed_end, ())
        else {
            return Err(StepError::Fatal(backend_error::<D>(std::io::Error::other(
                "the session ended as the lock was granted",
            ))));
        };
        lock(&self.inner.owned).insert(
            *req.token,
            Owned {
                session: session.clone(),
                id,
                mode: req.mode,
                releasing: Arc::default(),
                _turn: None,
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
        Ok(match fixed_end {
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
        })
    }
}

/// Undoes an uncontended attempt's grant on the holder session that nobody
/// took: its caller left before reading the answer. Made in the
/// statement's task from the server's answer, so that it undoes exactly
/// what the server granted.
struct UnlockOnDrop<D: Dialect> {
    session: Option<Arc<Session<D>>>,
    id: D::Id,
    mode: Mode,
}

impl<D: Dialect> Drop for UnlockOnDrop<D> {
    fn drop(&mut self) {
        let (id, mode) = (self.id.clone(), self.mode);
        if let Some(session) = self.session.take() {
            session.undo_later(move |d, c| Box::pin(async move { d.unlock(c, &id, mode).await }));
        }
    }
}
