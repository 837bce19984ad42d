//! Acquiring: our node in the key's queue, and the wait for the nodes
//! ahead of it.

use std::{sync::Arc, time::Duration};

use dlock_core::{
    backend::{
        wait::{Armed, Look, StepError, WaitSteps, Woken},
        AcquireRequest, Acquired, LeaseKind, Mode,
    },
    LockError, Result,
};
use tokio::time::Instant;
use zookeeper_client::{Client, CreateMode, Error as ZkError, MultiWriteError, MultiWriteResult};

use super::{
    admitted, backend_error, mixed_layouts, mode_of, mode_tag, parent_of, release::delete_strays,
    sequence, session::watch_our_node, vanished, Owned, ZkBackend,
};
use crate::session::Session;

/// What a lock node of ours holds until its holder proclaims: in Curator's
/// layout, it tells our nodes from Curator's (whose data is the client's
/// address by default), which a forced release must not remove.
pub(super) const OURS: &[u8] = b"dlock";

/// Create attempts before an acquire gives up on repeated failures.
const ENQUEUE_ATTEMPTS: usize = 5;

/// Our node in the queue, as the create (or the search for it) found it,
/// and the line as last listed.
struct Enqueued {
    /// When the create that made the node was sent: the leader applied it
    /// later, so the session was alive then.
    sent: Instant,
    stat: zookeeper_client::Stat,
    name: String,
    /// The children of the parent, read after the create, then at each
    /// look.
    children: Vec<String>,
    /// Whether an earlier create's answer was lost (see [`Owned::strays`]).
    strays: bool,
}

/// Our node in the key's line, and what we last read of the line.
pub(super) struct Entry {
    session: Arc<Session>,
    client: Client,
    parent: String,
    mine: String,
    path: String,
    node: Enqueued,
    /// When the last listing was asked for: the grant, where a fixed
    /// lease starts (our create, for a lock free at once).
    listed_at: Instant,
}

/// ZooKeeper's wait steps: a sequential node in the key's line, and a
/// watch on the node that keeps us waiting (Curator's and ZooKeeper's own
/// recipe), which [`dlock_core::backend::wait::drive`] runs.
pub(super) struct Steps<'a>(pub(super) &'a ZkBackend);

/// A ZooKeeper error as a step's: an expired session takes our node with
/// it (nothing to wait for any more); anything else may pass.
fn step_error(e: ZkError) -> StepError {
    match e {
        ZkError::SessionExpired => StepError::Fatal(vanished()),
        e => StepError::Retry(backend_error(e)),
    }
}

/// A look's answer: the grant, or a refusal that keeps `entry`.
fn judged(granted: Option<Acquired>, entry: Option<Entry>) -> Look<Entry> {
    match granted {
        Some(acquired) => Look::Granted(acquired),
        None => Look::Refused { entry, again: None },
    }
}

impl WaitSteps for Steps<'_> {
    type TurnKey = ();
    type Entry = Entry;
    type Wake = zookeeper_client::OneshotWatcher;

    /// The first look makes our node (even for one try: ZooKeeper has no
    /// way to ask without standing in line); each later one lists the line
    /// again.
    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        entry: Option<&mut Entry>,
        _join: bool,
    ) -> std::result::Result<Look<Entry>, StepError> {
        let backend = self.0;
        match entry {
            Some(entry) => {
                let asked = Instant::now();
                let listed = tokio::select! {
                    listed = entry.client.list_children(&entry.parent) => listed,
                    // Given up: the wait ends with the session.
                    () = entry.session.holders.expired() => Err(ZkError::SessionExpired),
                };
                entry.node.children = listed.map_err(step_error)?;
                entry.listed_at = asked;
                Ok(judged(backend.judge(req, entry).await?, None))
            }
            None => {
                let mut entry = backend.enter(req).await.map_err(StepError::Fatal)?;
                Ok(judged(backend.judge(req, &mut entry).await?, Some(entry)))
            }
        }
    }

    /// Watches the node that keeps us waiting, atomically with reading
    /// that it exists: a reader's is the last writer ahead, a writer's its
    /// predecessor; permits watch the whole line (any node ahead may free
    /// some), and wait only if it is as last listed.
    async fn arm(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Entry,
        wake: &mut Option<Self::Wake>,
    ) -> std::result::Result<Armed, StepError> {
        let position = entry
            .node
            .children
            .iter()
            .position(|c| *c == entry.node.name)
            .ok_or_else(|| StepError::Fatal(vanished()))?;
        let blocking = match req.mode {
            Mode::Read => entry.node.children[..position]
                .iter()
                .rev()
                .find(|c| mode_of(c) != Some(Mode::Read)),
            Mode::Permits { .. } => None,
            _ => position
                .checked_sub(1)
                .map(|ahead| &entry.node.children[ahead]),
        }
        .map(|c| format!("{}/{c}", entry.parent));
        let watcher = match &blocking {
            Some(blocking) => {
                let (stat, watcher) = entry
                    .client
                    .check_and_watch_stat(blocking)
                    .await
                    .map_err(step_error)?;
                stat.is_some().then_some(watcher)
            }
            None => {
                let (mut listed, watcher) = entry
                    .client
                    .list_and_watch_children(&entry.parent)
                    .await
                    .map_err(step_error)?;
                if entry.node.strays {
                    // As the line was judged: without our stray nodes, so
                    // that one that cannot be deleted keeps nobody looking.
                    let (mine, name) = (&entry.mine, &entry.node.name);
                    listed.retain(|c| c == name || !c.starts_with(mine.as_str()));
                }
                listed.sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
                (listed == entry.node.children).then_some(watcher)
            }
        };
        *wake = watcher;
        Ok(if wake.is_some() {
            Armed::Wait
        } else {
            Armed::LookAgain
        })
    }

    async fn changed(
        &self,
        _req: &AcquireRequest<'_>,
        entry: &mut Entry,
        wake: &mut Option<Self::Wake>,
        until: Instant,
    ) -> std::result::Result<Woken, StepError> {
        // One-shot: used up whatever happens.
        let Some(watcher) = wake.take() else {
            return Ok(Woken::LookAgain);
        };
        tokio::select! {
            _ = watcher.changed() => Ok(Woken::LookAgain),
            () = tokio::time::sleep_until(until) => Ok(Woken::LookAgain),
            () = entry.session.holders.expired() => Err(StepError::Fatal(vanished())),
        }
    }

    /// Takes our node away: we answer for ourselves here, so core does not
    /// release.
    async fn withdraw(
        &self,
        req: &AcquireRequest<'_>,
        _entry: Entry,
    ) -> std::result::Result<(), StepError> {
        self.0
            .delete_owned(req.token, true)
            .await
            .map(drop)
            .map_err(StepError::Fatal)
    }

    fn unreachable_after(&self) -> Duration {
        // A disconnect mid-wait: the session may move to another server,
        // within its timeout.
        self.0.inner.config.session_timeout()
    }
}

impl ZkBackend {
    /// Makes our node in `req`'s line, and reads the line.
    async fn enter(&self, req: &AcquireRequest<'_>) -> Result<Entry> {
        let token = *req.token;
        let session = self.session().await?;
        let client = session.client().map_err(backend_error)?;
        let mode = req.mode;
        let parent = parent_of(self.inner.config.path(), req.key, mode);
        let mine = self.own_prefix(&token, mode);
        let tag = mode_tag(mode);
        self.owned().insert(
            token,
            Owned {
                parent: parent.clone(),
                mine: mine.clone(),
                path: None,
                strays: false,
                session: session.clone(),
                granted: false,
                release_sent: false,
                note: req.note.into(),
            },
        );
        let data = super::election::created(req.note);
        let enqueued = self.enqueue(&client, &parent, &mine, &tag, &data).await;
        let strays = enqueued.as_ref().map_or(true, |e| e.strays);
        self.update(&token, |owned| owned.strays = strays);
        let node = enqueued?;
        let path = format!("{parent}/{}", node.name);
        self.update(&token, |owned| owned.path = Some(path.clone()));
        sequence(&node.name).ok_or_else(vanished)?;
        if let Mode::Permits { limit, .. } = mode {
            let theirs = node.children.iter().find_map(|c| match mode_of(c) {
                Some(Mode::Permits { limit: theirs, .. }) if theirs != limit => Some(theirs),
                _ => None,
            });
            if let Some(theirs) = theirs {
                self.delete_owned(&token, true).await?;
                return Err(LockError::permit_limit_mismatch(req.key, theirs, limit));
            }
        }
        Ok(Entry {
            session,
            client,
            parent,
            mine,
            path,
            listed_at: node.sent,
            node,
        })
    }

    /// Whether the line as last listed admits us: the grant if it does.
    async fn judge(
        &self,
        req: &AcquireRequest<'_>,
        entry: &mut Entry,
    ) -> std::result::Result<Option<Acquired>, StepError> {
        let node = &mut entry.node;
        if node.strays {
            // Our own older nodes must not make us (or anyone) wait:
            // delete them, and leave them out of the line we read.
            let (mine, name) = (&entry.mine, &node.name);
            delete_strays(&entry.client, &entry.parent, mine, name, &node.children).await;
            node.children
                .retain(|c| c == name || !c.starts_with(mine.as_str()));
        }
        if req.mode == Mode::Exclusive {
            if let Some(refused) = mixed_layouts(&node.children) {
                self.delete_owned(req.token, true)
                    .await
                    .map_err(StepError::Fatal)?;
                return Err(StepError::Fatal(refused));
            }
        }
        node.children
            .sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
        let position = node
            .children
            .iter()
            .position(|c| *c == node.name)
            .ok_or_else(|| StepError::Fatal(vanished()))?;
        if !admitted(&node.children, position, req.mode) {
            return Ok(None);
        }
        self.granted(req, entry).map_err(StepError::Fatal)
    }

    /// Creates our node and lists the queue, in one round trip; after a
    /// failure that may have created it anyway, finds it by our token
    /// instead of creating a second one.
    async fn enqueue(
        &self,
        client: &Client,
        parent: &str,
        mine: &str,
        tag: &str,
        data: &[u8],
    ) -> Result<Enqueued> {
        let protected = format!("{parent}/{mine}{tag}");
        let ephemeral = CreateMode::EphemeralSequential.with_acls(self.acls());
        let mut strays = false;
        let mut last_error = None;
        for _ in 0..ENQUEUE_ATTEMPTS {
            let sent = Instant::now();
            // Sent back to back: the session runs them in order.
            let create = client.create(&protected, data, &ephemeral);
            let listing = client.list_children(parent);
            let (created, listed) = (create.await, listing.await);
            #[cfg(test)]
            let created = tests::lose_reply(created);
            match created {
                Ok((stat, seq)) => {
                    return Ok(Enqueued {
                        sent,
                        stat,
                        name: format!("{mine}{tag}{seq}"),
                        children: listed.map_err(backend_error)?,
                        strays,
                    })
                }
                Err(ZkError::NoNode) => {
                    // No parent. Create it and our node in one transaction:
                    // an attempt cut off in between would leave a parent
                    // that never had a child, which the server never reaps.
                    let sent = Instant::now();
                    let mut both = client.new_multi_writer();
                    let container = CreateMode::Container.with_acls(self.acls());
                    both.add_create(parent, b"", &container)
                        .and_then(|()| both.add_create(&protected, data, &ephemeral))
                        .map_err(backend_error)?;
                    match both.commit().await {
                        Ok(results) => {
                            let Some(MultiWriteResult::Create { path, stat }) = results.last()
                            else {
                                return Err(vanished());
                            };
                            let name = path.rsplit('/').next().unwrap_or_default().to_owned();
                            // A multi's stat may be invalid (ZOOKEEPER-4026).
                            let stat = match stat.czxid {
                                czxid if czxid > 0 => *stat,
                                _ => client
                                    .check_stat(&format!("{parent}/{name}"))
                                    .await
                                    .map_err(backend_error)?
                                    .ok_or_else(vanished)?,
                            };
                            let children =
                                client.list_children(parent).await.map_err(backend_error)?;
                            return Ok(Enqueued {
                                sent,
                                stat,
                                name,
                                children,
                                strays,
                            });
                        }
                        // Someone else created the parent meanwhile.
                        Err(MultiWriteError::OperationFailed {
                            source: ZkError::NodeExists,
                            ..
                        }) => {}
                        Err(MultiWriteError::OperationFailed {
                            source: ZkError::NoAuth,
                            ..
                        }) => return Err(backend_error(ZkError::NoAuth)),
                        Err(e) => {
                            // Perhaps applied, with the answer lost.
                            strays = true;
                            last_error = Some(e.into());
                        }
                    }
                }
                Err(ZkError::SessionExpired) => return Err(vanished()),
                // Refused by the parent's ACL: nothing was created, and
                // asking again changes nothing.
                Err(ZkError::NoAuth) => return Err(backend_error(ZkError::NoAuth)),
                Err(e) => {
                    // The create may have happened: a node of ours may now
                    // exist whether or not we find it.
                    strays = true;
                    // `sync` first, so the listing sees every write the
                    // leader took.
                    let found = async {
                        #[cfg(test)]
                        tests::fail_lookup()?;
                        client.sync(parent).await?;
                        let listed = client.list_children(parent).await?;
                        match listed.iter().find(|c| c.starts_with(mine)).cloned() {
                            Some(name) => {
                                let stat = client.check_stat(&format!("{parent}/{name}")).await?;
                                Ok(stat.map(|stat| Enqueued {
                                    sent,
                                    stat,
                                    name,
                                    children: listed,
                                    strays: true,
                                }))
                            }
                            None => Ok(None),
                        }
                    };
                    match found.await {
                        Ok(Some(found)) => return Ok(found),
                        Ok(None) | Err(ZkError::NoNode) => last_error = Some(e),
                        Err(again) => last_error = Some(again),
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        Err(last_error.map_or_else(vanished, backend_error))
    }

    /// Records the grant of `entry`'s node.
    fn granted(&self, req: &AcquireRequest<'_>, entry: &Entry) -> Result<Option<Acquired>> {
        let (session, path, sent) = (&entry.session, &entry.path, entry.node.sent);
        let granted_at = entry.listed_at;
        let fence = u64::try_from(entry.node.stat.czxid).unwrap_or(0);
        let acquired = Acquired::new(sent).with_fence(fence);
        self.update(req.token, |owned| owned.granted = true);
        // A fixed lease counts from the grant, as on every backend: a lock
        // won after a long wait gets its whole lease.
        let fixed_end = (req.lease_kind == LeaseKind::Fixed).then(|| granted_at + req.lease);
        // Registered with the session either way: its expiry ends the lock
        // whatever the lease.
        let confirmed_at = session
            .holders
            .hold(*req.token, req.loss.clone(), fixed_end, ())
            .ok_or_else(vanished)?;
        watch_our_node(session, *req.token, path.to_owned());
        // Only what the leader saw proves the session alive: the last
        // `sync`, or our create (a write, applied by the leader after
        // `sent`). A listing does not: a follower cut off from the leader
        // still answers it.
        let alive_at = confirmed_at.max(sent);
        let session_end = alive_at + session.timeout;
        match fixed_end {
            None => Ok(Some(
                acquired
                    .with_lease_from(alive_at, session.timeout)
                    .kept_alive_by_backend(),
            )),
            Some(ends) => {
                // Ephemeral nodes have no TTL: end the lease ourselves, no
                // earlier than the guard reports it lost.
                self.inner.lease_ends.add(*req.token, ends);
                let acquired = if session_end < ends {
                    acquired.with_lease_from(alive_at, session.timeout)
                } else {
                    acquired.with_lease_from(granted_at, req.lease)
                };
                Ok(Some(acquired.kept_alive_by_backend()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    // Faults injected into `enqueue`: answers lost on the way back, which
    // a real server cannot be made to lose on demand.

    /// Successful creates whose answer is turned into a connection loss.
    static LOST_REPLIES: AtomicUsize = AtomicUsize::new(0);
    /// Searches for our node after a failed create that fail too.
    static FAILED_LOOKUPS: AtomicUsize = AtomicUsize::new(0);

    fn take(counter: &AtomicUsize) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    pub(super) fn lose_reply<T>(created: Result<T, ZkError>) -> Result<T, ZkError> {
        match created {
            Ok(_) if take(&LOST_REPLIES) => Err(ZkError::ConnectionLoss),
            other => other,
        }
    }

    pub(super) fn fail_lookup() -> Result<(), ZkError> {
        match take(&FAILED_LOOKUPS) {
            true => Err(ZkError::ConnectionLoss),
            false => Ok(()),
        }
    }

    /// Two connection losses in a row during the create: its answer is
    /// lost, and so is the search for the node it made. The second create
    /// makes a second node; the first one, ahead of it, is ours too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_left_by_a_lost_create_answer_is_neither_waited_on_nor_left_behind() {
        use dlock_core::{BackendExt, LockOptions};

        let server = dlock_testkit::fixture::ZooKeeperServer::start().expect("start ZooKeeper");
        let url = format!("zk://{}/strays", server.endpoint());
        let backend = ZkBackend::connect(&url).await.unwrap();
        let locker = backend.clone().into_locker();
        let rival = ZkBackend::connect(&url).await.unwrap().into_locker();
        let raw = zookeeper_client::Client::connect(&server.endpoint())
            .await
            .unwrap();
        let persistent = CreateMode::Persistent.with_acls(zookeeper_client::Acls::anyone_all());
        raw.create("/strays/k", b"", &persistent).await.unwrap();

        LOST_REPLIES.store(1, Ordering::SeqCst);
        FAILED_LOOKUPS.store(1, Ordering::SeqCst);
        let wait = LockOptions::new().wait(Duration::from_secs(3));
        let guard = locker
            .lock_with("k", wait)
            .await
            .expect("the lock waited on a node of its own");
        assert_eq!(LOST_REPLIES.load(Ordering::SeqCst), 0);
        assert_eq!(FAILED_LOOKUPS.load(Ordering::SeqCst), 0);
        let children = raw.list_children("/strays/k").await.unwrap();
        assert_eq!(children.len(), 1, "a stray node is left: {children:?}");
        guard.release().await.unwrap();
        let left = raw.list_children("/strays/k").await.unwrap();
        assert!(left.is_empty(), "release left nodes: {left:?}");
        rival
            .lock_with("k", wait)
            .await
            .expect("the key stayed blocked")
            .release()
            .await
            .unwrap();

        // The same on a key another owner holds: the waiter must queue
        // behind the holder, not behind its own stray, and leave nothing
        // when it gives up.
        let held = rival.lock("k").await.unwrap();
        LOST_REPLIES.store(1, Ordering::SeqCst);
        FAILED_LOOKUPS.store(1, Ordering::SeqCst);
        let short = LockOptions::new().wait(Duration::from_millis(500));
        assert!(matches!(
            locker.lock_with("k", short).await,
            Err(dlock_core::LockError::Timeout { .. })
        ));
        locker.wait_for_releases().await;
        let left = raw.list_children("/strays/k").await.unwrap();
        assert_eq!(left.len(), 1, "the waiter left nodes behind: {left:?}");
        let waiter = tokio::spawn({
            let locker = locker.clone();
            async move {
                locker
                    .lock_with("k", LockOptions::new().wait(Duration::from_secs(5)))
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        held.release().await.unwrap();
        waiter
            .await
            .unwrap()
            .expect("not handed the lock")
            .release()
            .await
            .unwrap();
    }
}
