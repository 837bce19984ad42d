//! Acquiring: our key in the key's revision queue, and the wait for the
//! entries ahead of it, as the steps core's wait engine runs.

use std::{sync::Arc, time::Duration};

use dlock_core::{
    backend::{
        wait::{Armed, Look, StepError, TurnAt, WaitSteps, Woken},
        AcquireRequest, Acquired, FinishOnDrop, LeaseKind, LocalTurn, Mode, Share,
    },
    LockError, Result,
};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, GetResponse, KeyValue, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchOptions, WatchStream,
};
use tokio::time::Instant;

use super::{delete_if, mode_of, turn::KeptTurn, vanished, watched, EtcdBackend, NameGuard, Owned};
use crate::session::Session;

/// The session TTL for queue keys of fixed-lease acquisitions while they
/// wait.
const WAITING_SESSION_TTL: Duration = Duration::from_secs(10);

/// Our entry in a key's queue.
pub(super) struct Entry {
    session: Arc<Session>,
    queue: String,
    name: String,
    /// Our key's create revision (its place in line and its fence); `None`
    /// while, with `layout=etcdctl`, the name is another lease's key (see
    /// [`EtcdBackend::enter`]): we wait for that key to go.
    revision: Option<i64>,
}

/// A watch armed for the deletion of an entry that keeps us waiting.
pub(super) struct Wake {
    watch: WatchStream,
    /// The keys whose deletion may admit us.
    ahead: Vec<Vec<u8>>,
}

/// etcd's wait steps: a key with its create revision in the key's queue,
/// and a watch on the entry that keeps us waiting (etcd's own
/// `concurrency.Mutex`), which [`dlock_core::backend::wait::drive`] runs.
pub(super) struct Steps<'a>(pub(super) &'a EtcdBackend);

/// Whether the entry created at `mine` in `mode` holds its key, given the
/// queue sorted by creation: first come, first served. A reader holds when
/// no writer is ahead of it, a writer when it is first, permits when the
/// permits ahead (held or waited for) and its own fit the limit.
fn admitted(queue: &[KeyValue], mine: i64, mode: Mode) -> bool {
    if mode == Mode::Exclusive {
        // A plain lock's read has only the queue's first entry.
        return queue.first().map(KeyValue::create_revision) == Some(mine);
    }
    let ahead = queue
        .iter()
        .filter(|kv| kv.create_revision() < mine)
        .map(|kv| mode_of(kv.value()).unwrap_or(Mode::Exclusive));
    dlock_core::backend::admitted(mode, ahead)
}

/// A look's answer: the grant, or a refusal that keeps `entry`.
fn judged(granted: Option<Acquired>, entry: Option<Entry>) -> Look<Entry> {
    match granted {
        Some(acquired) => Look::Granted(acquired),
        None => Look::Refused { entry, again: None },
    }
}

fn get_responses(response: &TxnResponse) -> Vec<GetResponse> {
    response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        })
        .collect()
}

impl WaitSteps for Steps<'_> {
    type TurnKey = String;
    type Entry = Entry;
    type Wake = Wake;

    /// The first look puts our key (even for one try: etcd's recipe asks
    /// by standing in line), or with `layout=etcdctl` finds its name
    /// another lease's; each later one checks that our key is still there
    /// and reads the queue again, in one transaction.
    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut Entry>,
        _join: bool,
    ) -> std::result::Result<Look<Entry>, StepError> {
        let backend = self.0;
        let Some(entry) = entry.filter(|e| e.revision.is_some()) else {
            let sent = Instant::now();
            let Some((entry, queue)) = backend.enter(req).await.map_err(StepError::Fatal)? else {
                // This session's name is still settling: look again.
                return Ok(Look::Refused {
                    entry: None,
                    again: Some(Duration::ZERO),
                });
            };
            let granted = backend.judge(req, &entry, &queue, sent).await?;
            return Ok(judged(granted, Some(entry)));
        };
        let checked = Instant::now();
        let check = Txn::new().and_then([
            TxnOp::get(
                entry.name.as_str(),
                Some(GetOptions::new().with_count_only()),
            ),
            TxnOp::get(entry.queue.as_str(), Some(backend.queue_read(req.mode))),
        ]);
        let answer = tokio::select! {
            answer = backend.txn(check) => answer.map_err(StepError::Retry)?,
            // Given up (or expired): our key goes with its lease.
            () = entry.session.holders.expired() => return Err(StepError::Fatal(vanished())),
        };
        let mut gets = get_responses(&answer);
        if gets.first().is_none_or(|g| g.count() == 0) {
            return Err(StepError::Fatal(vanished()));
        }
        let kvs = gets.pop().map(|mut g| g.take_kvs()).unwrap_or_default();
        let queue = backend.direct(&entry.queue, req.mode, kvs);
        Ok(judged(
            backend.judge(req, entry, &queue, checked).await?,
            None,
        ))
    }

    /// Watches the entry that keeps us waiting (a writer's predecessor,
    /// a reader's last writer ahead; for permits, the whole queue, for the
    /// deletion of any entry ahead), then reads again what keeps us
    /// waiting: a watch from the current revision is served at once, where
    /// one from the revision first read could wait for etcd's catch-up.
    async fn arm(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Entry,
        wake: &mut Option<Wake>,
    ) -> std::result::Result<Armed, StepError> {
        let backend = self.0;
        let ahead = backend.blocking(req.mode, entry).await?;
        let Some(first) = ahead.first() else {
            return Ok(Armed::LookAgain);
        };
        // Names sort by lease, not by age: no narrower range holds exactly
        // the entries ahead of a permit waiter.
        let (watched, range) = if matches!(req.mode, Mode::Permits { .. }) {
            (
                entry.queue.as_bytes().to_vec(),
                Some(WatchOptions::new().with_prefix()),
            )
        } else {
            (first.clone(), None)
        };
        let watch = backend.watch_from_now(watched, range).await;
        let watch = watch.map_err(StepError::Retry)?;
        // The entries ahead only go (newcomers queue behind us).
        let still = backend.blocking(req.mode, entry).await?;
        if ahead.iter().any(|key| !still.contains(key)) {
            return Ok(Armed::LookAgain);
        }
        *wake = Some(Wake { watch, ahead });
        Ok(Armed::Wait)
    }

    async fn changed(
        &self,
        _req: &AcquireRequest<'_>,
        entry: &mut Entry,
        wake: &mut Option<Wake>,
        until: Instant,
    ) -> std::result::Result<Woken, StepError> {
        let Some(Wake { mut watch, ahead }) = wake.take() else {
            return Ok(Woken::LookAgain);
        };
        let deleted = watched(&mut watch, |r| {
            r.events().iter().any(|e| {
                e.event_type() == EventType::Delete
                    && e.kv().is_some_and(|kv| ahead.iter().any(|k| k == kv.key()))
            })
        });
        tokio::select! {
            deleted = deleted => deleted.map(|()| Woken::LookAgain).map_err(StepError::Retry),
            () = tokio::time::sleep_until(until) => Ok(Woken::LookAgain),
            // In line: our key goes with the session's lease. Waiting for
            // the name: the next look enters on a new session.
            () = entry.session.holders.expired() => match entry.revision {
                Some(_) => Err(StepError::Fatal(vanished())),
                None => Ok(Woken::LookAgain),
            },
        }
    }

    /// Takes our key away: we answer for ourselves here, so core does not
    /// release.
    async fn withdraw(
        &self,
        req: &AcquireRequest<'_>,
        _entry: Entry,
    ) -> std::result::Result<(), StepError> {
        self.0
            .delete_owned(req.token)
            .await
            .map(drop)
            .map_err(StepError::Fatal)
    }

    fn unreachable_after(&self) -> Duration {
        self.0.inner.unreachable_after
    }

    /// With `layout=etcdctl`, a plain lock's entry is named by its
    /// session's lease alone: one acquisition of the key per process
    /// stands in line at a time.
    fn turn(&self, req: &AcquireRequest<'_>) -> Option<TurnAt<'_, String>> {
        self.0.go_layout(req.mode).then(|| TurnAt {
            turns: &self.0.inner.turns,
            key: req.key.as_str().to_owned(),
            share: Share::Alone,
            first: true,
        })
    }

    /// Kept with the hold, until its session or its fixed lease ends (see
    /// [`KeptTurn`]).
    fn keep_turn(&self, req: &AcquireRequest<'_>, turn: LocalTurn<String>) {
        self.0.update(req.token, |owned| {
            owned.turn = Some(match req.lease_kind {
                LeaseKind::Watchdog => KeptTurn::start(turn, Some(owned.session.clone()), None),
                LeaseKind::Fixed => KeptTurn::start(turn, None, Some(Instant::now() + req.lease)),
            });
        });
    }
}

impl EtcdBackend {
    /// Puts our entry into `req`'s queue, on the session's lease, and
    /// reads the queue in the same transaction: `None` if the entry's name
    /// was not free to use in time.
    ///
    /// With `layout=etcdctl`, the name (the session's lease alone) may hold
    /// an earlier acquisition's key on a fixed lease of its own (a release
    /// given up, or a lease ended by the guard's count but not yet by
    /// etcd's whole seconds): not ours to take over (its fence would be
    /// given twice) nor to delete, so the entry waits for it to go. A
    /// request cancelled mid-enqueue may still make or delete a key of the
    /// name: its [`NameGuard`] is waited for.
    async fn enter(&self, req: &AcquireRequest<'_>) -> Result<Option<(Entry, Vec<KeyValue>)>> {
        let mode = req.mode;
        let queue = self.queue(req.key, mode);
        // Every queue key lives on the session while it waits; a fixed
        // lease is attached when the lock is granted, so that waiting does
        // not use it up.
        let ttl = match req.lease_kind {
            LeaseKind::Watchdog => req.lease,
            LeaseKind::Fixed => WAITING_SESSION_TTL,
        };
        let session = self.session(ttl).await?;
        let name = self.entry_name(&queue, mode, session.lease, req.token);
        let guard = match self.go_layout(mode) {
            true => match self.inner.naming.take(&name, Share::Alone, req.wait).await {
                Some(guard) => Some(Arc::new(guard)),
                None => return Ok(None),
            },
            false => None,
        };
        // Given up while we waited: a key under its name may be an
        // abandoned grant's.
        if !session.is_usable() {
            return Ok(None);
        }
        let txn = Txn::new()
            .when([Compare::create_revision(name.as_str(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    name.as_str(),
                    super::entry_value(mode, req.note, None),
                    Some(PutOptions::new().with_lease(session.lease)),
                ),
                TxnOp::get(queue.as_str(), Some(self.queue_read(mode))),
            ])
            .or_else([
                TxnOp::get(name.as_str(), None),
                TxnOp::get(queue.as_str(), Some(self.queue_read(mode))),
            ]);
        self.owned().insert(
            *req.token,
            Owned {
                name: name.clone(),
                session: session.clone(),
                own_lease: None,
                on_own_lease: false,
                created: None,
                own_name: !self.go_layout(mode),
                granted: None,
                release_sent: false,
                guard: guard.clone(),
                turn: None,
                note: req.note.into(),
            },
        );
        let answer = self.enqueue(txn, &name, session.lease, guard).await?;
        let mut gets = get_responses(&answer);
        let mut entry = Entry {
            session,
            queue,
            name,
            revision: None,
        };
        let revision = if answer.succeeded() {
            answer.header().map(|h| h.revision()).unwrap_or_default()
        } else {
            // Ours from an attempt whose answer was lost, or another's.
            let found = gets.first().and_then(|g| g.kvs().first());
            let found = found.ok_or_else(vanished)?;
            if found.lease() != entry.session.lease {
                self.owned().remove(req.token);
                return Ok(Some((entry, Vec::new())));
            }
            found.create_revision()
        };
        self.update(req.token, |owned| owned.created = Some(revision));
        let kvs = gets.pop().map(|mut g| g.take_kvs()).unwrap_or_default();
        let read = self.direct(&entry.queue, mode, kvs);
        if let Mode::Permits { limit, .. } = mode {
            let theirs = read.iter().find_map(|kv| match mode_of(kv.value()) {
                Some(Mode::Permits { limit: theirs, .. }) if theirs != limit => Some(theirs),
                _ => None,
            });
            if let Some(theirs) = theirs {
                self.delete_owned(req.token).await?;
                return Err(LockError::permit_limit_mismatch(req.key, theirs, limit));
            }
        }
        entry.revision = Some(revision);
        Ok(Some((entry, read)))
    }

    /// Runs the enqueueing transaction to its end even if the caller goes
    /// away while it is in flight ([`FinishOnDrop`]): then the key it may
    /// still create on `lease` is deleted once it has. The request keeps
    /// a share of the name's guard until then.
    async fn enqueue(
        &self,
        txn: Txn,
        name: &str,
        lease: i64,
        guard: Option<NameGuard>,
    ) -> Result<TxnResponse> {
        let (backend, name) = (self.clone(), name.to_owned());
        FinishOnDrop::watched(|abandoned| async move {
            let _guard = guard;
            // Idempotent: a retry after a lost reply finds our key, and the
            // else-branch reads its create revision.
            let answer = backend.txn(txn).await;
            if abandoned.get() {
                // Nobody will use the key. Only a key on our lease is ours
                // (see `enter`).
                let ours = Compare::lease(name.as_str(), CompareOp::Equal, lease);
                let _ = backend.txn(delete_if(name, ours)).await;
            }
            answer
        })
        .await
    }

    /// Whether `queue` (the key's entries as read at `at`) admits our entry
    /// (in line): the grant if it does.
    async fn judge(
        &self,
        req: &AcquireRequest<'_>,
        entry: &Entry,
        queue: &[KeyValue],
        at: Instant,
    ) -> std::result::Result<Option<Acquired>, StepError> {
        let Some(mine) = entry
            .revision
            .filter(|&mine| admitted(queue, mine, req.mode))
        else {
            return Ok(None);
        };
        self.granted(req, &entry.session, &entry.name, mine, at)
            .await
            .map(Some)
            .map_err(StepError::Fatal)
    }

    /// The keys whose deletion may admit `entry`: the entry
    /// just ahead for a plain lock or a writer, the last writer ahead for
    /// a reader, every entry ahead for permits; for an entry waiting for
    /// its name, the key there. Empty if nothing keeps it waiting.
    async fn blocking(
        &self,
        mode: Mode,
        entry: &Entry,
    ) -> std::result::Result<Vec<Vec<u8>>, StepError> {
        let keys = |kvs: &[KeyValue]| kvs.iter().map(|kv| kv.key().to_vec()).collect();
        let Some(mine) = entry.revision else {
            let options = GetOptions::new().with_keys_only();
            let read = self.get(&entry.name, options).await;
            return Ok(keys(read.map_err(StepError::Retry)?.kvs()));
        };
        let order = match mode {
            Mode::Permits { .. } => SortOrder::Ascend,
            _ => SortOrder::Descend,
        };
        let ahead = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, order)
            .with_max_create_revision(mine - 1);
        // Readers and permits need the modes ahead (etcd counts a range
        // before its revision filters: the kvs it returns are what
        // count), a writer only its predecessor (with nested queues,
        // every key ahead: see `direct`).
        let ahead = match mode {
            Mode::Read | Mode::Permits { .. } => ahead,
            _ if self.go_layout(mode) => ahead.with_keys_only(),
            _ => ahead.with_limit(1).with_keys_only(),
        };
        let mut read = self
            .get(&entry.queue, ahead)
            .await
            .map_err(StepError::Retry)?;
        let ahead = self.direct(&entry.queue, mode, read.take_kvs());
        // Entries ahead may have gone since the last look: if what is left
        // admits us, nothing keeps us waiting. (A writer's read has no
        // values: its one entry ahead counts as exclusive, which blocks it
        // as it should.)
        let modes = ahead
            .iter()
            .map(|kv| mode_of(kv.value()).unwrap_or(Mode::Exclusive));
        if dlock_core::backend::admitted(mode, modes) {
            return Ok(Vec::new());
        }
        Ok(match mode {
            Mode::Permits { .. } => keys(&ahead),
            Mode::Read => keys(
                ahead
                    .iter()
                    .find(|kv| mode_of(kv.value()) != Some(Mode::Read))
                    .map(std::slice::from_ref)
                    .unwrap_or_default(),
            ),
            _ => keys(ahead.get(..1).unwrap_or_default()),
        })
    }

    /// Our key is admitted: the lock is ours.
    async fn granted(
        &self,
        req: &AcquireRequest<'_>,
        session: &Arc<Session>,
        name: &str,
        revision: i64,
        at: Instant,
    ) -> Result<Acquired> {
        let acquired = Acquired::new(at).with_fence(u64::try_from(revision).unwrap_or(0));
        self.update(req.token, |owned| owned.granted = Some(revision));
        // Held: the name is this hold's, and with `layout=etcdctl` its
        // turn's (a grant that fails keeps the guard until its release).
        let held = || self.update(req.token, |owned| owned.guard = None);
        if req.lease_kind == LeaseKind::Watchdog {
            // The lease end is read with the guard's registration, so
            // that no keepalive can fall between the two.
            let renewed_at = session
                .holders
                .hold(*req.token, req.loss.clone(), None, name.to_owned())
                .ok_or_else(vanished)?;
            held();
            return Ok(acquired
                .with_lease_from(renewed_at, session.ttl)
                .kept_alive_by_backend());
        }
        // A lease of the lock's own, from now; re-putting the key keeps
        // its create revision (our place and fencing token).
        let from = Instant::now();
        let lease = self.grant_lease(req.lease).await?;
        self.update(req.token, |owned| owned.own_lease = Some(lease));
        let put = super::put_if_created(
            name,
            revision,
            super::entry_value(req.mode, req.note, None),
            PutOptions::new().with_lease(lease),
        );
        if !self.txn(put).await?.succeeded() {
            return Err(vanished());
        }
        self.update(req.token, |owned| owned.on_own_lease = true);
        held();
        Ok(acquired.with_lease_from(from, req.lease))
    }
}
