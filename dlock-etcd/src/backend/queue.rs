//! Acquiring: our key in the key's revision queue, and the wait for the
//! entries ahead of it.

use std::{collections::HashSet, sync::Arc, time::Duration};

use dlock_core::{
    backend::{AcquireRequest, Acquired, Backoff, LeaseKind, Mode, Wait},
    LockError, Result,
};
use etcd_client::{
    EventType, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    TxnResponse, WatchOptions,
};
use tokio::time::Instant;

use super::{backend_error, mode_of, mode_value, retried, vanished, EtcdBackend, TurnUntil, NAME};
use crate::session::Session;

/// The longest a waiter trusts its watch alone before it reads the queue
/// again.
pub(super) const RECHECK: Duration = Duration::from_secs(10);

/// How waiting for the predecessor ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waited {
    /// It was deleted, there was none, or the deadline came: check again.
    Changed,
    /// The watch ended without an answer.
    Interrupted,
}

/// Why a wait step ended without a verdict.
enum StepError {
    /// Our queue key is gone: the session expired while we waited.
    Vanished,
    /// A request failed; worth retrying.
    Failed(LockError),
}

use StepError::{Failed, Vanished};

impl From<LockError> for StepError {
    fn from(e: LockError) -> Self {
        Failed(e)
    }
}

/// The session TTL for queue keys of fixed-lease acquisitions while they
/// wait.
const WAITING_SESSION_TTL: Duration = Duration::from_secs(10);

/// Whether the entry created at `mine` in `mode` holds its key, given the
/// queue sorted by creation: first come, first served. A reader holds when
/// no writer is ahead of it, a writer when it is first, permits when the
/// permits ahead (held or waited for) and its own fit the limit.
fn admitted(queue: &[&KeyValue], mine: i64, mode: Mode) -> bool {
    if mode == Mode::Exclusive {
        // A plain lock's read has only the queue's first entry.
        return queue.first().map(|kv| kv.create_revision()) == Some(mine);
    }
    let ahead = queue
        .iter()
        .filter(|kv| kv.create_revision() < mine)
        .map(|kv| mode_of(kv.value()).unwrap_or(Mode::Exclusive));
    dlock_core::backend::admitted(mode, ahead)
}

/// A permit limit in `queue` other than `limit`, if any.
fn other_limit(queue: &[&KeyValue], limit: u32) -> Option<u32> {
    queue.iter().find_map(|kv| match mode_of(kv.value()) {
        Some(Mode::Permits { limit: theirs, .. }) if theirs != limit => Some(theirs),
        _ => None,
    })
}

pub(super) fn get_responses(response: &TxnResponse) -> Vec<etcd_client::GetResponse> {
    response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        })
        .collect()
}

impl EtcdBackend {
    pub(super) async fn acquire_inner(&self, req: &AcquireRequest<'_>) -> Result<Option<Acquired>> {
        let token = *req.token;
        let mode = req.mode;
        let queue = self.queue(req.key, mode);
        // Every queue key lives on the session while it waits; a fixed
        // lease is attached when the lock is granted, so that waiting does
        // not use it up.
        let session_ttl = match req.lease_kind {
            LeaseKind::Watchdog => req.lease,
            LeaseKind::Fixed => WAITING_SESSION_TTL,
        };
        // The turn is at the entry's name: a guard lost with its session
        // keeps its own name's, not the next session's. A session that
        // ends while we wait for its name's turn, or is no longer usable
        // when we get it, is never used: a key found under its name could
        // be an abandoned grant's. The next round asks for a live one.
        let mut rounds = 0;
        let (session, name, turn) = loop {
            rounds += 1;
            if rounds > 10 {
                return Err(LockError::backend(
                    NAME,
                    std::io::Error::other("the session kept ending while this waited its turn"),
                ));
            }
            let session = self.session(session_ttl).await?;
            let name = self.entry_name(&queue, mode, session.lease, &token);
            let turn = tokio::select! {
                turn = self.turn(&name, mode, req.wait) => turn,
                () = session.ended() => continue,
            };
            let Some(turn) = turn else {
                return Ok(None);
            };
            if session.is_usable() {
                break (session, name, turn);
            }
        };
        let sent = Instant::now();
        let Some((answer, mine)) = self.enter(req, &queue, &session, &name, turn).await? else {
            return Ok(None);
        };
        let gets = get_responses(&answer);
        let entries = self.direct(
            &queue,
            mode,
            gets.last().map(|g| g.kvs()).unwrap_or_default(),
        );
        if let Mode::Permits { limit, .. } = mode {
            if let Some(theirs) = other_limit(&entries, limit) {
                self.delete_owned(&token).await?;
                return Err(LockError::permit_limit_mismatch(req.key, theirs, limit));
            }
        }
        if admitted(&entries, mine, mode) {
            return self.granted(req, &session, &name, mine, sent).await;
        }
        if req.wait == Wait::No {
            // Leave no queue entry behind a failed try.
            self.delete_owned(&token).await?;
            return Ok(None);
        }
        let deadline = req.wait.deadline();
        // A member lost mid-wait (a leader change, a dead endpoint) is
        // retried with backoff until the wait limit, or without one, until
        // the cluster stayed unreachable for `unreachable_after`.
        let mut failing_since: Option<Instant> = None;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        loop {
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                // We answer for ourselves here, so core will not release:
                // take our queue key away (an error lets core try again).
                self.delete_owned(&token).await?;
                return Ok(None);
            }
            let step = async {
                if self
                    .wait_for_predecessor(&queue, mine, mode, deadline)
                    .await?
                    == Waited::Interrupted
                {
                    // The watch ended without news (a member went away):
                    // check again after a pause, not in a tight loop.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let checked = Instant::now();
                let check = Txn::new().and_then([
                    TxnOp::get(name.as_str(), Some(GetOptions::new().with_count_only())),
                    TxnOp::get(queue.as_str(), Some(self.queue_read(mode))),
                ]);
                let answer = retried(|| {
                    let (mut client, check) = (self.client(), check.clone());
                    async move { client.txn(check).await }
                })
                .await?;
                let gets = get_responses(&answer);
                if gets.first().is_none_or(|g| g.count() == 0) {
                    return Err(Vanished);
                }
                let entries = self.direct(
                    &queue,
                    mode,
                    gets.last().map(|g| g.kvs()).unwrap_or_default(),
                );
                Ok(admitted(&entries, mine, mode).then_some(checked))
            };
            let step = async {
                tokio::select! {
                    checked = step => checked,
                    // Given up (or expired): our key goes with its lease.
                    () = session.ended() => Err(Vanished),
                }
            };
            match step.await {
                Ok(Some(checked)) => {
                    return self.granted(req, &session, &name, mine, checked).await
                }
                Ok(None) => failing_since = None,
                Err(Vanished) => return Err(vanished()),
                Err(Failed(error)) => {
                    tracing::debug!(%error, "dlock etcd wait step failed; retrying");
                    let since = *failing_since.get_or_insert(now);
                    let give_up = deadline.unwrap_or(since + self.inner.unreachable_after);
                    let delay = backoff.next_delay();
                    if now + delay >= give_up {
                        return Err(error);
                    }
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Waits until the entry ahead of `mine` that keeps it waiting is
    /// deleted (or there is none, or the deadline passes): the one just
    /// ahead for a plain lock or a writer, the last writer ahead for a
    /// reader, and the first entry ahead for permits (whichever entry ahead
    /// goes first, the check after the wait counts again).
    async fn wait_for_predecessor(
        &self,
        queue: &str,
        mine: i64,
        mode: Mode,
        deadline: Option<Instant>,
    ) -> Result<Waited> {
        let mut client = self.client();
        let ahead = GetOptions::new()
            .with_prefix()
            .with_sort(
                SortTarget::Create,
                if matches!(mode, Mode::Permits { .. }) {
                    SortOrder::Ascend
                } else {
                    SortOrder::Descend
                },
            )
            .with_max_create_revision(mine - 1);
        // Readers and permits need the modes ahead (etcd counts a range
        // before its revision filters: the kvs it returns are what
        // count), a writer only its predecessor.
        // (With nested queues, a writer reads every key ahead: see
        // [`direct`].)
        let ahead = match mode {
            Mode::Read | Mode::Permits { .. } => ahead,
            _ if self.go_layout(mode) => ahead.with_keys_only(),
            _ => ahead.with_limit(1).with_keys_only(),
        };
        let read = retried(|| {
            let (mut client, ahead) = (self.client(), ahead.clone());
            async move { client.get(queue, Some(ahead)).await }
        })
        .await?;
        let predecessors = self.direct(queue, mode, read.kvs());
        // Entries ahead may have gone since the last check (between our
        // enqueue and this read, say): if what is left admits us, there
        // is nothing to wait for. A permit waiter that waited here for
        // one more release would sleep beside a free permit.
        // (A writer's read has no values: its one entry ahead counts as
        // exclusive, which blocks it as it should.)
        let modes_ahead = predecessors
            .iter()
            .map(|kv| mode_of(kv.value()).unwrap_or(Mode::Exclusive));
        if dlock_core::backend::admitted(mode, modes_ahead) {
            return Ok(Waited::Changed);
        }
        let blocking = if mode == Mode::Read {
            predecessors
                .iter()
                .find(|kv| mode_of(kv.value()) != Some(Mode::Read))
        } else {
            predecessors.first()
        };
        let Some(key) = blocking.map(|kv| kv.key().to_vec()) else {
            return Ok(Waited::Changed);
        };
        // Permits wait for any entry ahead: watch the whole queue, and
        // count the deletions of the entries ahead only. Names sort by
        // lease, not by age, so no narrower key range holds exactly the
        // entries ahead: one that starts at the oldest entry ahead misses
        // a younger entry whose lease sorts before it.
        let permits = matches!(mode, Mode::Permits { .. });
        let (watched, range) = if permits {
            let mut end = queue.as_bytes().to_vec();
            if let Some(last) = end.last_mut() {
                *last += 1; // `/` + 1: just past every key under the queue
            }
            (
                queue.as_bytes().to_vec(),
                Some(WatchOptions::new().with_range(end)),
            )
        } else {
            (key.clone(), None)
        };
        let ahead_names: HashSet<&[u8]> = predecessors.iter().map(|kv| kv.key()).collect();
        // Watch from now, then check the predecessor still exists: a watch
        // from an older revision would be served by etcd's slow catch-up.
        let mut watch = client.watch(watched, range).await.map_err(backend_error)?;
        loop {
            match watch.message().await.map_err(backend_error)? {
                Some(response) if response.created() && !response.canceled() => break,
                Some(response) if response.created() => return Ok(Waited::Interrupted),
                Some(_) => continue,
                None => return Ok(Waited::Interrupted),
            }
        }
        // For permits, any entry ahead gone meanwhile counts (the entries
        // ahead only fall: newcomers queue behind us).
        let gone = if permits {
            let still = retried(|| {
                let (mut client, ahead) = (self.client(), ahead.clone());
                async move { client.get(queue, Some(ahead)).await }
            })
            .await?;
            self.direct(queue, mode, still.kvs()).len() < predecessors.len()
        } else {
            let still = retried(|| {
                let (mut client, key) = (self.client(), key.clone());
                async move {
                    client
                        .get(key, Some(GetOptions::new().with_count_only()))
                        .await
                }
            })
            .await?;
            still.count() == 0
        };
        if gone {
            return Ok(Waited::Changed);
        }
        let deleted = async {
            loop {
                match watch.message().await {
                    Ok(Some(response)) if response.canceled() => return Waited::Interrupted,
                    Ok(Some(response)) => {
                        if response.events().iter().any(|e| {
                            e.event_type() == EventType::Delete
                                && e.kv().is_some_and(|kv| ahead_names.contains(kv.key()))
                        }) {
                            return Waited::Changed;
                        }
                    }
                    _ => return Waited::Interrupted,
                }
            }
        };
        // Looks again at least every `RECHECK`, whatever the watch says: a
        // wait never rests on one watch alone.
        let recheck = Instant::now() + RECHECK;
        let until = deadline.map_or(recheck, |d| d.min(recheck));
        Ok(tokio::time::timeout_at(until, deleted)
            .await
            .unwrap_or(Waited::Changed))
    }

    /// Our key is first in the queue: the lock is ours.
    async fn granted(
        &self,
        req: &AcquireRequest<'_>,
        session: &Arc<Session>,
        name: &str,
        revision: i64,
        at: Instant,
    ) -> Result<Option<Acquired>> {
        let acquired = Acquired::new(at).with_fence(u64::try_from(revision).unwrap_or(0));
        if let Some(owned) = self.owned().get_mut(req.token) {
            owned.granted = Some(revision);
        }
        match req.lease_kind {
            LeaseKind::Watchdog => {
                // The lease end is read with the guard's registration, so
                // that no keepalive can fall between the two.
                let renewed_at = session
                    .hold(*req.token, name.to_owned(), req.loss.clone())
                    .ok_or_else(vanished)?;
                Ok(Some(
                    acquired
                        .with_lease_from(renewed_at, session.ttl)
                        .kept_alive_by_backend(),
                ))
            }
            LeaseKind::Fixed => {
                // A lease of the lock's own, from now; re-putting the key
                // keeps its create revision (our place and fencing token).
                let from = Instant::now();
                let secs = req.lease.as_secs_f64().ceil().max(1.0) as i64;
                let grant = retried(|| {
                    let mut client = self.client();
                    async move { client.lease_grant(secs, None).await }
                })
                .await?;
                if let Some(owned) = self.owned().get_mut(req.token) {
                    owned.own_lease = Some(grant.id());
                }
                let put = super::put_if_created(
                    name,
                    revision,
                    mode_value(req.mode),
                    PutOptions::new().with_lease(grant.id()),
                );
                let answer = retried(|| {
                    let (mut client, put) = (self.client(), put.clone());
                    async move { client.txn(put).await }
                })
                .await?;
                if !answer.succeeded() {
                    return Err(vanished());
                }
                if let Some(owned) = self.owned().get_mut(req.token) {
                    owned.on_own_lease = true;
                    // Given back when the lease ends, as the guard counts
                    // it, even if the guard is kept.
                    owned.turn_until = owned
                        .turn
                        .take()
                        .map(|turn| TurnUntil::start(turn, from + req.lease));
                }
                Ok(Some(acquired.with_lease_from(from, req.lease)))
            }
        }
    }
}
