//! Queued modes: read-write locks and semaphores kept in a queue table,
//! for the modes a server has no lock for (see [`Dialect::queues`]),
//! driven by core's wait engine.
//!
//! An acquisition takes its entry lock on the key's holder session and
//! adds its entry; it holds once admitted, first come, first served,
//! behind the live entries ahead of it. A waiter blocks, on a waiter
//! session, on the entry lock of the entry whose leaving may admit it:
//! the last writer ahead for a reader, the last entry ahead for a writer,
//! and for permits the oldest entry ahead (any holder's leaving may admit
//! a permit, so a permit waiter also looks again after
//! [`PERMIT_RECHECK`], a bounded fallback).

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_core::{
    backend::{
        admitted,
        wait::{Armed, Look, StepError, WaitSteps, Woken},
        AcquireRequest, Acquired, Mode, Wait,
    },
    LockError, Token,
};
use tokio::time::Instant;

use super::{backend_error, step_error, Answer, Session, SqlBackend};
use crate::{Dialect, QueueEntry, Refusal};

/// How long a permit waiter blocks on the oldest entry ahead before it
/// checks the queue again: another holder may have left first.
const PERMIT_RECHECK: Duration = Duration::from_millis(100);

/// How long an enqueue that found the key's other enqueues holding it up
/// waits before it tries again (the dialect already waited on the server).
const ENQUEUE_AGAIN_AFTER: Duration = Duration::from_millis(20);

/// Takes a token's entry out of the queue if the acquisition is dropped
/// or fails before it answers: after the enqueue in flight, on the same
/// session (which runs one statement at a time, in order).
struct DequeueOnDrop<D: Dialect> {
    session: Option<Arc<Session<D>>>,
    token: Token,
}

impl<D: Dialect> Drop for DequeueOnDrop<D> {
    fn drop(&mut self) {
        let token = self.token;
        if let Some(session) = self.session.take() {
            session.undo_later(move |d, c| Box::pin(async move { d.dequeue(c, &token).await }));
        }
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
            .map_err(|e| step_error(session, e))
    }};
}

/// The wait steps of a queued mode.
pub(super) struct QueueWait<'b, D: Dialect> {
    pub(super) backend: &'b SqlBackend<D>,
    pub(super) id: D::Id,
    /// Whether an entry was enqueued (or tried) already: the first is
    /// named for the lock's token, any later one for a new one. An entry
    /// of an ended session may outlive it in the table, and with its name
    /// taken again by the new session, it would read as live, ahead of the
    /// new entry: the wait would wait for itself, and the key be wedged
    /// for everyone.
    pub(super) enqueued: AtomicBool,
}

/// A queued acquisition's entry in the queue table.
pub(super) struct Entry<D: Dialect> {
    /// The key's holder session, which holds the entry lock.
    holder: Arc<Session<D>>,
    /// The entry's number: its place, and its fencing token.
    number: i64,
    /// Takes the entry out of the queue if it is dropped.
    undo: DequeueOnDrop<D>,
    /// The entry lock to block on, and how long at most.
    watched: Option<(String, Option<Duration>)>,
    /// Deleted from the table (its session ended): enqueued again at the
    /// next look.
    gone: bool,
}

impl<D: Dialect> WaitSteps for QueueWait<'_, D> {
    type TurnKey = ();
    type Entry = Entry<D>;
    type Wake = ();

    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut Entry<D>>,
        _join: bool,
    ) -> Answer<Look<Entry<D>>> {
        match self.look_in_queue(req, entry).await {
            // No time left for a new session: not granted within the limit
            // (core asks the servers whether that is a timeout or their
            // error).
            Err(StepError::Retry(_)) if matches!(req.wait, Wait::Until(d) if Instant::now() >= d) => {
                Ok(Look::Refused {
                    entry: None,
                    again: None,
                })
            }
            answer => answer,
        }
    }

    async fn arm(
        &self,
        _req: &AcquireRequest<'_>,
        entry: &mut Entry<D>,
        _wake: &mut Option<()>,
    ) -> Answer<Armed> {
        // A watch on an entry lock that is free already returns at once.
        Ok(if entry.gone {
            Armed::LookAgain
        } else {
            Armed::Wait
        })
    }

    async fn changed(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Entry<D>,
        _wake: &mut Option<()>,
        until: Instant,
    ) -> Answer<Woken> {
        let Some((owner, most)) = entry.watched.clone() else {
            return Ok(Woken::LookAgain);
        };
        let limit = (req.wait.deadline().is_some() || most.is_some())
            .then(|| until.saturating_duration_since(Instant::now()));
        // Blocks until the entry lock is free (its owner left) or `limit`.
        let watched = self.backend.on_waiter(req, until, limit, move |d, c| {
            Box::pin(async move { d.watch(c, &owner, limit).await })
        });
        if let Some((session, _, _)) = watched.await? {
            self.backend.put_idle(session);
        }
        Ok(Woken::LookAgain)
    }

    /// Out of the queue before answering, so that the key is free of us
    /// when the caller hears (and by `undo`, if this is dropped first).
    async fn withdraw(&self, _req: &AcquireRequest<'_>, mut entry: Entry<D>) -> Answer<()> {
        if entry.gone {
            // Its session ended, or `undo` gives back its lock.
            return Ok(());
        }
        let token = entry.undo.token;
        match on_holder!(entry.holder, |d, c| d.dequeue(c, &token), token) {
            // An ended session took the entry's lock with it: dead.
            Ok(_) | Err(StepError::Retry(_)) => entry.undo.session = None,
            Err(error) => return Err(error),
        }
        Ok(())
    }

    fn unreachable_after(&self) -> Duration {
        self.backend.inner.dialect.settings().connect_timeout()
    }
}

impl<D: Dialect> QueueWait<'_, D> {
    /// Enqueues (at the first look, or again once the entry is gone) and
    /// reads the entries ahead: granted if admitted.
    async fn look_in_queue(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut Entry<D>>,
    ) -> Answer<Look<Entry<D>>> {
        let mut fresh = None;
        let mut read = None;
        let entry = match entry {
            Some(entry) if !entry.gone => entry,
            old => {
                let Some((new, enqueued)) = self.enqueue(req).await? else {
                    // The key's other enqueues held it up: again soon.
                    return Ok(Look::Refused {
                        entry: None,
                        again: Some(ENQUEUE_AGAIN_AFTER),
                    });
                };
                read = Some(enqueued);
                match old {
                    Some(old) => {
                        *old = new;
                        old
                    }
                    None => fresh.insert(new),
                }
            }
        };
        match self.admitted(req, entry, read).await {
            Ok(Some(acquired)) => {
                entry.undo.session = None;
                return Ok(Look::Granted(acquired));
            }
            Ok(None) => {}
            Err(error) => {
                // The holder session ended, and the entry with it: a new
                // one at the next look.
                entry.gone |= !entry.holder.is_usable();
                return Err(error);
            }
        }
        let again = entry.watched.as_ref().and_then(|(_, most)| *most);
        Ok(Look::Refused {
            entry: fresh,
            again,
        })
    }

    /// Adds an entry on the key's holder session: the entry and what the
    /// enqueue read, or `None` if the key's other enqueues held it up.
    async fn enqueue(
        &self,
        req: &AcquireRequest<'_>,
    ) -> Answer<Option<(Entry<D>, (Instant, Vec<QueueEntry>))>> {
        let holder = self
            .backend
            .holder(&self.id)
            .await
            .map_err(StepError::Retry)?;
        let token = if self.enqueued.swap(true, Ordering::Relaxed) {
            Token::generate()
        } else {
            *req.token
        };
        // Made first: an enqueue dropped or failed takes its entry out.
        let undo = DequeueOnDrop {
            session: Some(holder.clone()),
            token,
        };
        let (id, mode) = (&self.id, req.mode);
        let answer = holder
            .run({
                let id = id.clone();
                move |d, c| Box::pin(async move { d.enqueue(c, &id, mode, &token).await })
            })
            .await;
        let (sent, (number, entries)) = match answer {
            // Not enqueued (`undo` gives back the entry lock).
            Err(e) if matches!(Refusal::of(&e), Some(Refusal::Busy(_))) => return Ok(None),
            answer => answer.map_err(|e| step_error(&holder, e))?,
        };
        let entry = Entry {
            holder,
            number,
            undo,
            watched: None,
            gone: false,
        };
        Ok(Some((entry, (sent, entries))))
    }

    /// Reads the entries ahead of `entry` (unless the enqueue just did),
    /// deletes the dead ones, and books the grant if it is admitted;
    /// otherwise notes the entry to watch.
    async fn admitted(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Entry<D>,
        mut read: Option<(Instant, Vec<QueueEntry>)>,
    ) -> Answer<Option<Acquired>> {
        let (id, number, mode) = (self.id.clone(), entry.number, req.mode);
        let holder = entry.holder.clone();
        // Whether this read counts every entry as live (see
        // `Dialect::enqueue_counts_all_as_live`).
        let mut all_live =
            read.is_some() && self.backend.inner.dialect.enqueue_counts_all_as_live();
        loop {
            let (sent, entries) = match read.take() {
                Some(read) => read,
                None => {
                    let (sent, (entries, mine)) =
                        on_holder!(holder, |d, c| d.ahead(c, &id, number), id)?;
                    if !mine {
                        // Deleted as dead: the holder session ended under
                        // it (or someone deleted it: then `undo` gives back
                        // its lock).
                        if !holder.is_usable() {
                            entry.undo.session = None;
                        }
                        entry.gone = true;
                        return Err(StepError::Retry(backend_error::<D>(std::io::Error::other(
                            "the entry's session ended while it waited",
                        ))));
                    }
                    (sent, entries)
                }
            };
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
                    return Err(StepError::Fatal(LockError::permit_limit_mismatch(
                        req.key, theirs, limit,
                    )));
                }
            }
            if admitted(mode, ahead.iter().map(|(_, m)| *m)) {
                let token = entry.undo.token;
                let acquired = self
                    .backend
                    .granted(req, holder, id, false, sent, number, token)?;
                return Ok(Some(acquired));
            }
            if all_live {
                // Refused counting every entry as live: some may be dead.
                // Read them again, with their liveness.
                all_live = false;
                continue;
            }
            entry.watched = watched(mode, &ahead).map(|(e, most)| (e.owner.clone(), most));
            return Ok(None);
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
