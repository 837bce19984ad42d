//! Entering a key's queue: our entry put under its name, and with
//! `layout=etcdctl`, the wait for a key left under that name to go.

use std::{sync::Arc, time::Duration};

use dlock_core::{
    backend::{AcquireRequest, Backoff, FinishOnDrop, Wait},
    LockError, Result,
};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnResponse, WatchOptions,
};
use tokio::time::Instant;

use super::{
    mode_value,
    queue::{get_responses, RECHECK},
    retried, vanished, EtcdBackend, Owned, Turn, NAME,
};
use crate::session::Session;

/// How a watch for a taken entry's deletion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watched {
    /// The entry was deleted.
    Deleted,
    /// Its start revision had been compacted away: read and watch again.
    Compacted,
    /// The watch ended without news.
    Ended,
}

/// How many watches a wait for a taken entry's deletion starts before it
/// only waits out the entry's lease.
const GONE_WATCHES: u32 = 20;

impl EtcdBackend {
    /// Puts our entry `name` on the session's lease into `queue`, and
    /// answers with the queue as read then and the entry's create revision
    /// (`None` if the wait ended first).
    ///
    /// With `layout=etcdctl`, an entry's name is the session's lease alone,
    /// so the name may already be taken by an earlier acquisition of this
    /// session on a fixed lease of its own: one whose release failed until
    /// it was given up (see `abandon`), or a kept guard whose lease ended
    /// by its count while etcd's, in whole seconds, still runs (see
    /// [`super::TurnUntil`]). Such a key is not ours to take over (its
    /// fence would be given twice) nor to delete: we wait for it to go,
    /// then enter.
    pub(super) async fn enter(
        &self,
        req: &AcquireRequest<'_>,
        queue: &str,
        session: &Arc<Session>,
        name: &str,
        turn: Option<Turn>,
    ) -> Result<Option<(TxnResponse, i64)>> {
        let lease = session.lease;
        let txn = Txn::new()
            .when([Compare::create_revision(name, CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    name,
                    mode_value(req.mode),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::get(queue, Some(self.queue_read(req.mode))),
            ])
            .or_else([
                TxnOp::get(name, None),
                TxnOp::get(queue, Some(self.queue_read(req.mode))),
            ]);
        // Only abandoned keys take the name, each until its lease ends,
        // and none is made while we hold the turn: a second round finds
        // the name free.
        for _ in 0..3 {
            self.owned().insert(
                *req.token,
                Owned {
                    name: name.to_owned(),
                    session: session.clone(),
                    own_lease: None,
                    on_own_lease: false,
                    created: None,
                    own_name: !self.go_layout(req.mode),
                    granted: None,
                    release_sent: false,
                    turn: turn.clone(),
                    turn_until: None,
                },
            );
            let answer = self.enqueue(txn.clone(), name, lease, turn.clone()).await?;
            let created = if answer.succeeded() {
                answer.header().map(|h| h.revision()).unwrap_or_default()
            } else {
                // Ours from an attempt whose answer was lost, or another's.
                let gets = get_responses(&answer);
                let found = gets.first().and_then(|g| g.kvs().first());
                let found = found.ok_or_else(vanished)?;
                if found.lease() != lease {
                    let (theirs, seen) = (found.lease(), found.mod_revision());
                    self.owned().remove(req.token);
                    if req.wait == Wait::No
                        || !self
                            .until_gone(name, theirs, seen, req.wait.deadline())
                            .await?
                    {
                        return Ok(None);
                    }
                    continue;
                }
                found.create_revision()
            };
            if let Some(owned) = self.owned().get_mut(req.token) {
                owned.created = Some(created);
            }
            return Ok(Some((answer, created)));
        }
        Err(LockError::backend(
            NAME,
            std::io::Error::other(format!("the queue entry {name} stayed taken")),
        ))
    }

    /// Waits until the key `name`, last changed at `seen` on the lease
    /// `lease`, is gone: `false` if `deadline` came first, an error if it
    /// outlived its lease.
    async fn until_gone(
        &self,
        name: &str,
        lease: i64,
        seen: i64,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        let ttl = retried(|| {
            let mut client = self.client();
            async move { client.lease_time_to_live(lease, None).await }
        })
        .await?
        .ttl();
        let ends = Instant::now() + Duration::from_secs(ttl.max(0).unsigned_abs()) + RECHECK;
        let until = deadline.map_or(ends, |d| d.min(ends));
        let deleted = async {
            // Watched from just after the read that saw the key: no
            // deletion can fall between the two.
            let mut from = seen + 1;
            let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
            for round in 0..GONE_WATCHES {
                if round > 0 {
                    // The last watch was cancelled or ended: read the key
                    // again, and watch on from just after that read.
                    let read = retried(|| {
                        let mut client = self.client();
                        async move {
                            client
                                .get(name, Some(GetOptions::new().with_count_only()))
                                .await
                        }
                    })
                    .await;
                    match read {
                        Ok(read) if read.count() == 0 => return,
                        Ok(read) => from = read.header().map_or(from, |h| h.revision() + 1),
                        Err(error) => {
                            tracing::debug!(%error, "dlock etcd read of a taken entry failed");
                            tokio::time::sleep(backoff.next_delay()).await;
                            continue;
                        }
                    }
                }
                if self.watch_for_delete(name, from).await == Watched::Deleted {
                    return;
                }
            }
            // Still no answer: wait out the lease instead.
            std::future::pending::<()>().await;
        };
        let _ = tokio::time::timeout_at(until, deleted).await;
        let still = retried(|| {
            let mut client = self.client();
            async move {
                client
                    .get(name, Some(GetOptions::new().with_count_only()))
                    .await
            }
        })
        .await?;
        if still.count() == 0 {
            return Ok(true);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
        Err(LockError::backend(
            NAME,
            std::io::Error::other(format!("the queue entry {name} outlived its lease")),
        ))
    }

    /// Watches `name` from revision `from` until it is deleted, or the
    /// watch is cancelled (its start compacted away: at once) or ends
    /// without news (after a pause, so that a caller's next round is no
    /// tight loop).
    async fn watch_for_delete(&self, name: &str, from: i64) -> Watched {
        let options = WatchOptions::new().with_start_revision(from);
        if let Ok(mut watch) = self.client().watch(name, Some(options)).await {
            while let Ok(Some(response)) = watch.message().await {
                if response.canceled() {
                    if response.compact_revision() > 0 {
                        return Watched::Compacted;
                    }
                    break;
                }
                if response
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    return Watched::Deleted;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        Watched::Ended
    }

    /// Runs the enqueueing transaction to its end even if the caller goes
    /// away while it is in flight ([`FinishOnDrop`]): then the key it may
    /// still create on `lease` is deleted once it has. The request keeps a
    /// share of the turn until then: no later acquisition can meet the key.
    async fn enqueue(
        &self,
        txn: Txn,
        name: &str,
        lease: i64,
        turn: Option<Turn>,
    ) -> Result<TxnResponse> {
        let (client, name) = (self.client(), name.to_owned());
        FinishOnDrop::watched(|abandoned| async move {
            let _turn = turn;
            // Idempotent: a retry after a lost reply finds our key, and the
            // else-branch reads its create revision.
            let answer = retried(|| {
                let (mut client, txn) = (client.clone(), txn.clone());
                async move { client.txn(txn).await }
            })
            .await;
            if abandoned.get() {
                // Nobody will use the key. Only a key on our lease is ours
                // (see `enter`).
                let delete = Txn::new()
                    .when([Compare::lease(name.as_str(), CompareOp::Equal, lease)])
                    .and_then([TxnOp::delete(name.as_str(), None)]);
                let _ = retried(|| {
                    let (mut client, delete) = (client.clone(), delete.clone());
                    async move { client.txn(delete).await }
                })
                .await;
            }
            answer
        })
        .await
    }
}
