//! Queued modes: read-write locks and semaphores kept in a queue table,
//! for the modes a server has no lock for (see [`Dialect::queues`]).
//!
//! An acquisition takes its entry lock on the key's holder session and
//! adds its entry; it holds once admitted, first come, first served,
//! behind the live entries ahead of it. A waiter blocks, on a waiter
//! session, on the entry lock of the entry whose leaving may admit it:
//! the last writer ahead for a reader, the last entry ahead for a writer,
//! and for permits the oldest entry ahead (any holder's leaving may admit
//! a permit, so a permit waiter also checks again after
//! [`PERMIT_RECHECK`], a bounded fallback).

use std::{sync::Arc, time::Duration};

use dlock_core::{
    backend::{admitted, AcquireRequest, Acquired, Mode, Wait},
    LockError, Result, Token,
};
use tokio::time::Instant;

use super::{answered_within, backend_error, EndOnDrop, Retry, Session, SqlBackend};
use crate::{Dialect, QueueEntry};

/// How long a permit waiter blocks on the oldest entry ahead before it
/// checks the queue again: another holder may have left first.
const PERMIT_RECHECK: Duration = Duration::from_millis(100);

/// How long an enqueue that found the key's other enqueues holding it up
/// waits before it tries again (the dialect already waited on the server).
const ENQUEUE_AGAIN_AFTER: Duration = Duration::from_millis(20);

/// Why one queued attempt gave no answer.
enum Failed {
    /// The holder session ended (a server restart, a cut connection), and
    /// the entry with it: worth trying again on a new session.
    SessionEnded(LockError),
    /// The statement could not do its work for now, and left the session
    /// as it was (see [`crate::Busy`]): worth trying again on it.
    Busy,
    /// Anything else: the caller's error.
    Other(LockError),
}

/// Takes a token's entry out of the queue if the acquisition is dropped
/// or fails before it answers: after the enqueue in flight, on the same
/// session (which runs one statement at a time, in order).
struct DequeueOnDrop<D: Dialect> {
    session: Option<Arc<Session<D>>>,
    token: Token,
}

impl<D: Dialect> Drop for DequeueOnDrop<D> {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send it from: end the session, which ends the
            // entry lock, and the entry is dead.
            session.holders.expire();
            return;
        };
        let token = self.token;
        runtime.spawn(async move {
            if let Ok(mut live) = session.live().await {
                let answer = answered_within(
                    session.timeout,
                    session.dialect.dequeue(live.conn(), &token),
                )
                .await;
                if live.done(answer).is_err() && session.is_usable() {
                    session.end();
                }
            }
        });
    }
}

/// The entry whose leaving may admit `mode`, among the live entries
/// ahead (oldest first), and how long to block on it at most.
fn watched(mode: Mode, ahead: &[(QueueEntry, Mode)]) -> Option<(&QueueEntry, Option<Duration>)> {
    match mode {
        Mode::Read => ahead
            .iter()
            .rev()
            .find(|(_, m)| *m != Mode::Read)
            .map(|(e, _)| (e, None)),
        Mode::Permits { .. } => ahead.first().map(|(e, _)| (e, Some(PERMIT_RECHECK))),
        _ => ahead.last().map(|(e, _)| (e, None)),
    }
}

/// A statement's failure on `session`: a [`Failed::SessionEnded`] if the
/// session ended.
fn failed<D: Dialect>(session: &Session<D>, e: sqlx::Error) -> Failed {
    if crate::is_busy(&e) {
        return Failed::Busy;
    }
    let error = backend_error::<D>(e);
    if session.is_usable() {
        Failed::Other(error)
    } else {
        Failed::SessionEnded(error)
    }
}

/// Runs one dialect statement on a holder session to its end (see
/// `Session::run`): `on_holder!(session, |dialect, conn| call, captured,
/// values)` moves the captured values into the statement, and gives when
/// it was sent and its answer, or the failure.
macro_rules! on_holder {
    ($session:expr, |$d:ident, $c:ident| $call:expr $(, $moved:ident)*) => {{
        let session: &Arc<Session<D>> = &$session;
        $(let $moved = $moved.to_owned();)*
        session
            .run(move |$d, $c| Box::pin(async move { $call.await }))
            .await
            .map_err(|e| failed(session, e))
    }};
}

impl<D: Dialect> SqlBackend<D> {
    /// Acquires a queued mode: tries again on a new session, within the
    /// wait limit, when the holder session ends under it.
    pub(super) async fn acquire_queued(
        &self,
        req: &AcquireRequest<'_>,
    ) -> Result<Option<Acquired>> {
        let id = self.inner.dialect.lock_id(req.key, req.mode);
        let mut retry = Retry::new(req.wait, self.inner.dialect.settings().connect_timeout());
        // The first entry is named for the lock's token; a retry's for a
        // new one. An entry of an ended session may outlive it in the
        // table, and with its name taken again by the new session, it
        // would read as live, ahead of the retry's own entry: the wait
        // would wait for itself, and the key be wedged for everyone.
        let mut entry = *req.token;
        loop {
            match self.queue_once(req, &id, entry).await {
                Ok(outcome) => return Ok(outcome),
                Err(Failed::SessionEnded(error)) => match retry.after(error).await {
                    Ok(()) => entry = Token::generate(),
                    // No time left for a new session: not granted within
                    // the limit (core asks the servers whether that is a
                    // timeout or their error).
                    Err(_) if matches!(req.wait, Wait::Until(_)) => return Ok(None),
                    Err(error) => return Err(error),
                },
                Err(Failed::Other(error)) => return Err(error),
                // Only an enqueue answers it, and that one is retried.
                Err(Failed::Busy) => {
                    return Err(backend_error::<D>(std::io::Error::other(
                        "a statement that is never busy said it was",
                    )))
                }
            }
        }
    }

    /// One try: enqueues the entry named for `token` on the key's holder
    /// session, and waits until it is admitted.
    async fn queue_once(
        &self,
        req: &AcquireRequest<'_>,
        id: &D::Id,
        token: Token,
    ) -> std::result::Result<Option<Acquired>, Failed> {
        let holder = self.holder(id).await.map_err(Failed::SessionEnded)?;
        let mut entry = DequeueOnDrop {
            session: Some(holder.clone()),
            token,
        };
        let mode = req.mode;
        let deadline = req.wait.deadline();
        // Within the limit: the key's other enqueues may hold it up.
        let (sent, (number, entries)) = loop {
            match on_holder!(holder, |d, c| d.enqueue(c, &id, mode, &token), id, token) {
                Err(Failed::Busy) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    // Not enqueued in time (`entry` gives back its lock).
                    return Ok(None);
                }
                Err(Failed::Busy) => tokio::time::sleep(ENQUEUE_AGAIN_AFTER).await,
                enqueued => break enqueued?,
            }
        };
        // The enqueue read the entries ahead: the first check needs no
        // statement of its own.
        let mut enqueued = Some((sent, (entries, true)));
        loop {
            // Whether this read counted every entry as live (see
            // `Dialect::enqueue_counts_all_as_live`).
            let all_live = enqueued.is_some() && self.inner.dialect.enqueue_counts_all_as_live();
            let (sent, (entries, mine)) = match enqueued.take() {
                Some(read) => read,
                None => on_holder!(holder, |d, c| d.ahead(c, &id, number), id)?,
            };
            if !mine {
                // Deleted as dead: the holder session ended under it (or
                // someone deleted it: then `entry` gives back its lock).
                if !holder.is_usable() {
                    entry.session = None;
                }
                return Err(Failed::SessionEnded(backend_error::<D>(
                    std::io::Error::other("the entry's session ended while it waited"),
                )));
            }
            let dead: Vec<i64> = entries
                .iter()
                .filter(|e| !e.live)
                .map(|e| e.number)
                .collect();
            if !dead.is_empty() {
                on_holder!(holder, |d, c| d.remove(c, &dead), dead)?;
            }
            // An entry this version cannot read blocks everything behind.
            let ahead: Vec<(QueueEntry, Mode)> = entries
                .into_iter()
                .filter(|e| e.live)
                .map(|e| {
                    let m = Mode::from_tag(&e.tag).unwrap_or(Mode::Exclusive);
                    (e, m)
                })
                .collect();
            if let Mode::Permits { limit, .. } = mode {
                let theirs = ahead.iter().find_map(|(_, m)| match m {
                    Mode::Permits { limit: theirs, .. } if *theirs != limit => Some(*theirs),
                    _ => None,
                });
                if let Some(theirs) = theirs {
                    return Err(Failed::Other(LockError::permit_limit_mismatch(
                        req.key, theirs, limit,
                    )));
                }
            }
            if admitted(mode, ahead.iter().map(|(_, m)| *m)) {
                entry.session = None;
                return self
                    .granted(
                        req,
                        holder.clone(),
                        id.clone(),
                        None,
                        false,
                        sent,
                        number,
                        token,
                    )
                    .map_err(Failed::Other);
            }
            if all_live {
                // Refused counting every entry as live: some may be dead.
                // Read them again, with their liveness, before waiting.
                continue;
            }
            let Some((target, most)) = watched(mode, &ahead) else {
                // Admitted behind nothing: cannot happen; check again.
                continue;
            };
            let now = Instant::now();
            let limit = match (deadline, most) {
                (Some(d), _) if d <= now => {
                    // Out of the queue before answering, so that the key is
                    // free of us when the caller hears (and by `entry`, if
                    // this is dropped first).
                    on_holder!(holder, |d, c| d.dequeue(c, &token), token)?;
                    entry.session = None;
                    return Ok(None);
                }
                (Some(d), most) => Some(most.map_or(d - now, |m| m.min(d - now))),
                (None, most) => most,
            };
            let owner = target.owner.clone();
            self.watch_entry(&owner, limit, req.wait).await?;
        }
    }

    /// Blocks on a waiter session until the entry lock `owner` is free or
    /// `limit` passes.
    async fn watch_entry(
        &self,
        owner: &str,
        limit: Option<Duration>,
        wait: Wait,
    ) -> std::result::Result<(), Failed> {
        let slot = self.inner.waiters.clone();
        let slot = match wait.deadline() {
            Some(d) => match tokio::time::timeout_at(d, slot.acquire_owned()).await {
                Ok(slot) => slot,
                Err(_) => return Ok(()),
            },
            None => slot.acquire_owned().await,
        }
        .map_err(|e| Failed::Other(backend_error::<D>(e)))?;
        let session = self.waiter_session().await.map_err(Failed::SessionEnded)?;
        // A watch dropped mid-wait could take the entry lock after the
        // caller left, and hold up everyone who watches it: end it.
        let mut abandon = EndOnDrop {
            backend: self.clone(),
            session: Some(session.clone()),
        };
        // Not `run`: a watch dropped mid-wait ends its session (above).
        let watched = match session.live().await {
            Ok(mut live) => {
                let within = limit.map_or(Duration::MAX, |l| l.saturating_add(session.timeout));
                let answer =
                    answered_within(within, session.dialect.watch(live.conn(), owner, limit)).await;
                live.done(answer).map_err(|e| failed(&session, e))
            }
            Err(e) => Err(failed(&session, e)),
        };
        abandon.session = None;
        drop(slot);
        match watched {
            Ok(_) => {
                self.put_idle(session);
                Ok(())
            }
            Err(Failed::SessionEnded(_)) => Ok(()),
            Err(failed) => {
                session.end();
                Err(failed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(number: i64, mode: Mode) -> (QueueEntry, Mode) {
        (
            QueueEntry {
                number,
                tag: mode.tag(),
                owner: number.to_string(),
                live: true,
            },
            mode,
        )
    }

    #[test]
    fn each_mode_watches_the_entry_whose_leaving_may_admit_it() {
        let permits = Mode::Permits { count: 1, limit: 2 };
        let ahead = [
            entry(1, Mode::Read),
            entry(2, Mode::Write),
            entry(3, Mode::Read),
            entry(4, Mode::Write),
            entry(5, Mode::Read),
        ];
        let number = |m| watched(m, &ahead).map(|(e, limit)| (e.number, limit));
        assert_eq!(number(Mode::Read), Some((4, None)), "the last writer ahead");
        assert_eq!(number(Mode::Write), Some((5, None)), "the last entry ahead");
        assert_eq!(
            watched(permits, &[entry(7, permits), entry(8, permits)])
                .map(|(e, limit)| (e.number, limit)),
            Some((7, Some(PERMIT_RECHECK))),
            "the oldest, and not for long"
        );
        assert!(watched(Mode::Read, &[entry(1, Mode::Read)]).is_none());
    }
}
