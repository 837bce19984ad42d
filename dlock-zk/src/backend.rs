//! `ZkBackend`: Curator's lock recipe (ephemeral sequential nodes under a
//! container parent, each watching its predecessor), fixed where it is weak.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use dlock_core::{
    backend::{
        AcquireRequest, Acquired, Backend, Backoff, BoxFuture, Capabilities, Holder, LeaseKind,
        LeaseTimers, Mode, ReleaseOutcome, RenewOutcome, RenewRequest, Wait,
    },
    LockError, LockKey, Result, Token,
};
use tokio::time::Instant;
use zookeeper_client::{
    Acls, Client, Connector, CreateMode, Error as ZkError, EventType, MultiWriteError,
    MultiWriteResult,
};

use crate::{config::ZkConfig, session::Session};

const NAME: &str = "zookeeper";

/// Create attempts before an acquire gives up on repeated failures.
const ENQUEUE_ATTEMPTS: usize = 5;

fn backend_error(e: ZkError) -> LockError {
    LockError::backend(NAME, e)
}

/// Opens a session, trying again while the servers refuse one (down, or
/// electing a leader: the client gives up on an attempt after a session
/// timeout) until the connect timeout has passed.
async fn open_session(config: &ZkConfig, connector: Option<&Connector>) -> Result<Arc<Session>> {
    let deadline = Instant::now() + config.connect_timeout();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    let servers = config.connect_string();
    loop {
        let attempt = Session::start(connector, &servers, config.session_timeout());
        let error = match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(session)) => return Ok(session),
            Ok(Err(e @ (ZkError::Timeout | ZkError::ConnectionLoss | ZkError::NoHosts))) => e,
            Ok(Err(e)) => return Err(backend_error(e)),
            Err(_) => {
                return Err(LockError::backend(
                    NAME,
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no session established within the connect timeout ({:?})",
                            config.connect_timeout()
                        ),
                    ),
                ))
            }
        };
        let delay = backoff.next_delay();
        if Instant::now() + delay >= deadline {
            return Err(backend_error(error));
        }
        tracing::debug!(%error, ?delay, "no ZooKeeper session yet; trying again");
        tokio::time::sleep(delay).await;
    }
}

fn vanished() -> LockError {
    LockError::backend(
        NAME,
        std::io::Error::other("our lock node vanished while waiting: the session expired"),
    )
}

/// A ZooKeeper lock server.
///
/// # How it locks
///
/// - **Nodes**: each key has a CONTAINER parent (the server removes it once
///   empty); each acquisition creates an EPHEMERAL_SEQUENTIAL child named
///   `lock-{token}-` plus the sequence ("protected" mode: after a connection
///   loss during the create, the node is found by its token rather than
///   created twice).
/// - **Acquire**: the create and the read of the children are sent back to
///   back; ZooKeeper runs a session's requests in order, so an uncontended
///   lock costs about one round trip. The lowest sequence holds the lock.
/// - Read-write locks and semaphores queue the same way under
///   `{path}/{key}%rw` and `{path}/{key}%sem`, each node's name saying what
///   it takes (`lock-{token}-r-{seq}`, `-w-`, `-p{count}_{limit}-`): a
///   reader holds when no writer is ahead (a waiting writer keeps later
///   readers out), a writer when first, permits when those ahead and its
///   own fit the limit. A reader watches the last writer ahead, a writer
///   its predecessor, and permits the queue's children; a client naming
///   another limit than the nodes there gets a typed error and leaves no
///   node. Curator's lease nodes, with an owner and a session each: a
///   crashed holder's permits go with its session.
/// - **Waiting** watches only the predecessor (no herd), and reads the
///   children again when it goes. A node of ours that is gone by then means
///   the session expired: an error, not a grant.
/// - **Fencing token**: the node's czxid, which keeps growing even when a
///   reaped container parent restarts the sequence numbers.
/// - **Release and cancel** delete our node; a create still in flight is
///   found by its token and deleted after it (same session, same order).
///   A delete that fails is sent again by core until a session timeout has
///   passed; then the session is closed (or left to expire), and its other
///   guards report lost.
/// - **Stray nodes**: a create whose answer was lost may have made a node
///   that the search for it missed; the next create then makes a second
///   one. Every node carrying our token but the one kept is deleted before
///   waiting and on release, and never waited on.
/// - **Parents** are created in one transaction with the first child, so no
///   attempt cut off in between leaves a parent that never had a child
///   (the server reaps a container only once it had one).
/// - **Session**: one per backend, confirmed every third of its timeout by
///   a `sync` (which goes through the leader, so a follower cut off from it
///   cannot vouch for the session). A grant's lease counts from the last
///   `sync` or from our create (a write the leader applied), never from the
///   listing that found us first. While disconnected, guards stay held
///   but say so: [`LockGuard::state`](dlock_core::LockGuard::state) is
///   [`HoldState::Unsure`](dlock_core::HoldState::Unsure). They are lost
///   when the server says the session expired, or once a whole timeout
///   passed without a confirmation. Later acquisitions open a new session.
/// - **A node deleted behind the holder's back** (an operator's `delete`,
///   a forced unlock) loses its guard: a lock held longer than 100 ms
///   watches its own node, and one held less finds its node gone when it
///   sets the watch.
/// - **Fixed leases** (ZooKeeper has no per-node TTL for ephemeral nodes):
///   the node is deleted when the lease ends, by this process; if the
///   process dies first, the session's expiry removes it. The guard ends at
///   the lease's end or the session's, whichever comes first.
///
/// Keys are escaped (`%XX` for every byte but ASCII letters, digits, `-`,
/// `_` and `:`), so `/`, `.`, `..`, unicode and control characters are safe.
///
/// # Examples
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_zk::ZkBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = ZkBackend::connect("zk://127.0.0.1:2181/locks").await?.into_locker();
/// let guard = locker.lock("report:daily").await?;
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ZkBackend {
    inner: Arc<Inner>,
}

struct Inner {
    config: ZkConfig,
    /// The application's connector, if it gave one, for every session.
    connector: Option<Connector>,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    owned: Mutex<HashMap<Token, Owned>>,
    /// Ends fixed leases (ephemeral nodes have no TTL): one task for all.
    lease_ends: LeaseTimers,
}

struct Owned {
    parent: String,
    /// Known once the create answered.
    path: Option<String>,
    /// A create whose answer was lost may have left another node with our
    /// token ("stray"): release then deletes every child carrying it.
    strays: bool,
    session: Arc<Session>,
    /// Whether the node holds the lock (it was first when granted, and
    /// no node is created before it since).
    granted: bool,
}

/// The data of a node whose holder proclaimed `value`: a marker byte,
/// then the value (a node starts with no data: nothing proclaimed).
fn with_proclaimed(value: &[u8]) -> Vec<u8> {
    let mut data = Vec::with_capacity(value.len() + 1);
    data.push(PROCLAIMED);
    data.extend_from_slice(value);
    data
}

/// What a node's holder proclaimed, if it has.
fn proclaimed(data: &[u8]) -> Option<Vec<u8>> {
    match data.split_first() {
        Some((&PROCLAIMED, value)) => Some(value.to_vec()),
        _ => None,
    }
}

/// The child of a plain lock's parent that holds it: the first by
/// sequence, as acquisition orders them (an unreadable name last).
fn holding(children: Vec<String>) -> Option<String> {
    children
        .into_iter()
        .filter(|c| mode_of(c) == Some(Mode::Exclusive))
        .min_by_key(|c| sequence(c).unwrap_or(i64::MAX))
}

/// Brings the server this session reads from up to date with the leader
/// (`sync`): a follower serves reads from its own copy, which may lag, so
/// without it a holder released through another server could still be
/// read as holding.
async fn synced(client: &Client, path: &str) -> Result<()> {
    match client.sync(path).await {
        Ok(()) | Err(ZkError::NoNode) => Ok(()),
        Err(e) => Err(backend_error(e)),
    }
}

/// The first byte of a proclaimed node's data.
const PROCLAIMED: u8 = 1;

/// Our node in the queue, as the create (or the search for it) found it.
struct Enqueued {
    /// When the create that made the node was sent: the leader applied it
    /// later, so the session was alive then.
    sent: Instant,
    stat: zookeeper_client::Stat,
    name: String,
    /// The children of the parent, read after the create.
    children: Vec<String>,
    /// Whether an earlier create's answer was lost (see [`Owned::strays`]).
    strays: bool,
}

impl fmt::Debug for ZkBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkBackend")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// `%`-escapes every byte but ASCII letters, digits, `-`, `_` and `:`,
/// one-to-one: a node name never holds `/`, and is never `.` or `..`.
fn escape(key: &LockKey) -> String {
    key.escaped(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':')))
}

fn sequence(name: &str) -> Option<i64> {
    name.rsplit('-').next()?.parse().ok()
}

/// The parent of `key`'s nodes in `mode`: a plain lock's at
/// `{path}/{key}`, a read-write lock's at `{path}/{key}%rw` and a
/// semaphore's at `{path}/{key}%sem` (an escaped key has `%` only before
/// two hex digits, so the three never meet, nor another key's).
fn parent_of(path: &str, key: &LockKey, mode: Mode) -> String {
    let kind = match mode {
        Mode::Read | Mode::Write => "%rw",
        Mode::Permits { .. } => "%sem",
        _ => "",
    };
    format!("{path}/{}{kind}", escape(key))
}

/// What a node takes, in its name between our token and the sequence:
/// nothing for a plain lock (`lock-{token}-{seq}`), `r-`, `w-` or
/// `p{count}_{limit}-`.
fn mode_tag(mode: Mode) -> String {
    match mode {
        Mode::Read => "r-".to_owned(),
        Mode::Write => "w-".to_owned(),
        Mode::Permits { count, limit } => format!("p{count}_{limit}-"),
        _ => String::new(),
    }
}

fn mode_of(name: &str) -> Option<Mode> {
    let parts: Vec<&str> = name.split('-').collect();
    match parts.as_slice() {
        [_, _, _] => Some(Mode::Exclusive),
        [_, _, "r", _] => Some(Mode::Read),
        [_, _, "w", _] => Some(Mode::Write),
        [_, _, tag, _] => {
            let (count, limit) = tag.strip_prefix('p')?.split_once('_')?;
            Some(Mode::Permits {
                count: count.parse().ok()?,
                limit: limit.parse().ok()?,
            })
        }
        _ => None,
    }
}

/// Whether the node at `position` of `children` (sorted by sequence) holds
/// its key: first come, first served. A reader holds when no writer is
/// ahead, a writer (or a plain lock) when first, permits when those ahead
/// (held or waited for) and its own fit the limit.
fn admitted(children: &[String], position: usize, mode: Mode) -> bool {
    let ahead = children[..position]
        .iter()
        .map(|c| mode_of(c).unwrap_or(Mode::Exclusive));
    dlock_core::backend::admitted(mode, ahead)
}

/// rustls needs one process-wide crypto provider, and cannot pick one when
/// the build compiles in more than one (another crate may bring aws-lc-rs):
/// ring, unless the application installed its own first.
#[cfg(feature = "tls")]
pub(crate) fn use_ring_unless_chosen() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The TLS settings of a `zks://` URL's files, read now.
#[cfg(feature = "tls")]
fn tls_options(files: &dlock_core::backend::TlsFiles) -> Result<zookeeper_client::TlsOptions> {
    use dlock_core::backend::TlsFiles;
    use_ring_unless_chosen();
    let read = |path: &std::path::PathBuf| {
        TlsFiles::read(path).map(|pem| String::from_utf8_lossy(&pem).into_owned())
    };
    let bad = |e: zookeeper_client::Error| LockError::InvalidOptions {
        reason: format!("bad TLS file: {e}"),
    };
    let mut options = zookeeper_client::TlsOptions::new();
    if let Some(ca) = &files.ca {
        options = options.with_pem_ca(&read(ca)?).map_err(bad)?;
    }
    if let (Some(cert), Some(key)) = (&files.cert, &files.key) {
        options = options
            .with_pem_identity(&read(cert)?, &read(key)?)
            .map_err(bad)?;
    }
    Ok(options)
}

impl ZkBackend {
    /// Connects to the servers of a `zk://` URL (see [`ZkConfig`]).
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a malformed URL;
    /// [`LockError::Backend`] if no session can be established within the
    /// connect timeout (15 s unless the URL says otherwise).
    pub async fn connect(url: &str) -> Result<ZkBackend> {
        Self::connect_with(ZkConfig::from_url(url)?).await
    }

    /// Connects with a prepared [`ZkConfig`].
    ///
    /// # Errors
    ///
    /// As [`connect`](ZkBackend::connect).
    pub async fn connect_with(config: ZkConfig) -> Result<ZkBackend> {
        Self::open(config, None).await
    }

    /// Connects with the application's own [`Connector`]: every session
    /// dlock opens (the first, and a new one after a session expired)
    /// comes from a clone of it, with its TLS, authentication and other
    /// settings, and the servers and lock path of `config`; the same
    /// guarantees as [`ZkBackend::connect`].
    ///
    /// Not a `Client`: a lock lives exactly as long as the session that
    /// holds it, and after that session expires dlock must open a new
    /// one, which a client of an ended session cannot. dlock sets the
    /// connector's session and connection timeouts to `config`'s session
    /// timeout. A connector that resumes a session (`with_session`) is not
    /// for dlock: two backends would share one session's locks.
    ///
    /// # Errors
    ///
    /// As [`ZkBackend::connect`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use dlock_core::BackendExt;
    /// use dlock_zk::{zookeeper_client::Client, ZkBackend, ZkConfig};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let connector = Client::connector().with_auth("digest", b"app:secret");
    /// let config = ZkConfig::from_url("zk://127.0.0.1:2181/app/locks")?;
    /// let locker = ZkBackend::from_connector(connector, config)
    ///     .await?
    ///     .into_locker();
    /// drop(locker.lock("report:daily").await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_connector(connector: Connector, config: ZkConfig) -> Result<ZkBackend> {
        Self::open(config, Some(connector)).await
    }

    async fn open(config: ZkConfig, connector: Option<Connector>) -> Result<ZkBackend> {
        #[cfg(feature = "tls")]
        let connector = match config.tls() {
            Some(files) => Some(
                connector
                    .unwrap_or_else(Client::connector)
                    .with_tls(tls_options(files)?),
            ),
            None => connector,
        };
        let backend = ZkBackend {
            inner: Arc::new_cyclic(|inner: &std::sync::Weak<Inner>| {
                let inner = inner.clone();
                Inner {
                    config,
                    connector,
                    session: tokio::sync::Mutex::default(),
                    owned: Mutex::default(),
                    lease_ends: LeaseTimers::new(move |token| {
                        // A lease ended: delete the node if it is still
                        // ours (a release may have raced the timer).
                        if let Some(inner) = inner.upgrade() {
                            let backend = ZkBackend { inner };
                            tokio::spawn(async move {
                                if backend.owned().contains_key(&token) {
                                    let _ = backend.delete_owned(&token).await;
                                }
                            });
                        }
                    }),
                }
            }),
        };
        let session = backend.session().await?;
        // The lock path's own components are ordinary nodes.
        let mut path = String::new();
        for component in backend.inner.config.path().split('/').skip(1) {
            path.push('/');
            path.push_str(component);
            let options = CreateMode::Persistent.with_acls(Acls::anyone_all());
            let client = session.client().map_err(backend_error)?;
            match client.create(&path, b"", &options).await {
                Ok(_) | Err(ZkError::NodeExists) => {}
                Err(e) => return Err(backend_error(e)),
            }
        }
        Ok(backend)
    }

    /// The id of the current ZooKeeper session, as the servers know it
    /// (`cons`, logs); `None` while a new session is being opened.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), dlock_core::LockError> {
    /// let backend = dlock_zk::ZkBackend::connect("zk://127.0.0.1:2181").await?;
    /// println!("session {:#x}", backend.session_id().unwrap_or_default());
    /// # Ok(())
    /// # }
    /// ```
    pub fn session_id(&self) -> Option<i64> {
        let session = self.inner.session.try_lock().ok()?;
        session.as_ref().map(|s| s.id)
    }

    fn owned(&self) -> MutexGuard<'_, HashMap<Token, Owned>> {
        self.inner.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live session, opened anew after the last one expired.
    async fn session(&self) -> Result<Arc<Session>> {
        let mut current = self.inner.session.lock().await;
        if let Some(session) = current.as_ref().filter(|s| s.is_usable()) {
            return Ok(session.clone());
        }
        let session = open_session(&self.inner.config, self.inner.connector.as_ref()).await?;
        *current = Some(session.clone());
        Ok(session)
    }

    async fn acquire_inner(&self, req: &AcquireRequest<'_>) -> Result<Option<Acquired>> {
        let token = *req.token;
        let session = self.session().await?;
        let client = session.client().map_err(backend_error)?;
        let mode = req.mode;
        let parent = parent_of(self.inner.config.path(), req.key, mode);
        let mine = format!("lock-{token}-");
        let tag = mode_tag(mode);
        self.owned().insert(
            token,
            Owned {
                parent: parent.clone(),
                path: None,
                strays: false,
                session: session.clone(),
                granted: false,
            },
        );
        let enqueued = self.enqueue(&client, &parent, &token, &tag).await;
        if let Some(owned) = self.owned().get_mut(&token) {
            owned.strays = enqueued.as_ref().map_or(true, |e| e.strays);
        }
        let Enqueued {
            sent,
            stat,
            name,
            mut children,
            strays,
        } = enqueued?;
        let path = format!("{parent}/{name}");
        if let Some(owned) = self.owned().get_mut(&token) {
            owned.path = Some(path.clone());
        }
        sequence(&name).ok_or_else(vanished)?;
        if let Mode::Permits { limit, .. } = mode {
            let theirs = children.iter().find_map(|c| match mode_of(c) {
                Some(Mode::Permits { limit: theirs, .. }) if theirs != limit => Some(theirs),
                _ => None,
            });
            if let Some(theirs) = theirs {
                self.delete_owned(&token).await?;
                return Err(LockError::permit_limit_mismatch(req.key, theirs, limit));
            }
        }
        let fence = u64::try_from(stat.czxid).unwrap_or(0);
        let deadline = req.wait.deadline();
        let mut failing_since: Option<Instant> = None;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        // When the listing that admits us was asked for: the grant, where
        // a fixed lease starts (our create, for a lock free at once).
        let mut listed_at = sent;
        loop {
            if strays {
                // Our own older nodes must not make us (or anyone) wait:
                // delete them, and leave them out of the queue we read.
                delete_strays(&client, &parent, &mine, &name, &children).await;
                children.retain(|c| *c == name || !c.starts_with(&mine));
            }
            children.sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
            let position = children
                .iter()
                .position(|c| *c == name)
                .ok_or_else(vanished)?;
            if admitted(&children, position, mode) {
                return self.granted(req, &session, &path, sent, listed_at, fence);
            }
            if req.wait == Wait::No || deadline.is_some_and(|d| Instant::now() >= d) {
                // We answer for ourselves here, so core will not release:
                // take our node away (an error lets core try again).
                self.delete_owned(&token).await?;
                return Ok(None);
            }
            // The node that keeps us waiting: a reader's is the last writer
            // ahead, a writer's its predecessor; permits watch the whole
            // queue (any node ahead may free some).
            let blocking = match mode {
                Mode::Read => children[..position]
                    .iter()
                    .rev()
                    .find(|c| mode_of(c) != Some(Mode::Read)),
                Mode::Permits { .. } => None,
                _ => Some(&children[position - 1]),
            }
            .map(|c| format!("{parent}/{c}"));
            let step = async {
                let watcher = match &blocking {
                    Some(blocking) => {
                        let (stat, watcher) = client.check_and_watch_stat(blocking).await?;
                        stat.is_some().then_some(watcher)
                    }
                    None => {
                        // Wait only if nothing changed since our listing.
                        let (mut listed, watcher) = client.list_and_watch_children(&parent).await?;
                        listed.sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
                        (listed == children).then_some(watcher)
                    }
                };
                if let Some(watcher) = watcher {
                    let gone = watcher.changed();
                    match deadline {
                        Some(d) => {
                            let _ = tokio::time::timeout_at(d, gone).await;
                        }
                        None => {
                            gone.await;
                        }
                    }
                }
                let asked = Instant::now();
                client.list_children(&parent).await.map(|l| (asked, l))
            };
            let step = async {
                tokio::select! {
                    listed = step => listed,
                    // Given up: the wait ends with the session.
                    () = session.ended() => Err(ZkError::SessionExpired),
                }
            };
            match step.await {
                Ok((asked, listed)) => {
                    listed_at = asked;
                    children = listed;
                    failing_since = None;
                }
                Err(ZkError::SessionExpired) => return Err(vanished()),
                Err(error) => {
                    // A disconnect mid-wait: the session may move to another
                    // server. Retry until the wait limit, or a whole session
                    // timeout without one.
                    let now = Instant::now();
                    let since = *failing_since.get_or_insert(now);
                    let give_up = deadline.unwrap_or(since + session.timeout);
                    let delay = backoff.next_delay();
                    if now + delay >= give_up {
                        return Err(backend_error(error));
                    }
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Creates our node and lists the queue, in one round trip; after a
    /// failure that may have created it anyway, finds it by our token
    /// instead of creating a second one.
    async fn enqueue(
        &self,
        client: &Client,
        parent: &str,
        token: &Token,
        tag: &str,
    ) -> Result<Enqueued> {
        let protected = format!("{parent}/lock-{token}-{tag}");
        let mine = format!("lock-{token}-");
        let ephemeral = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        let mut strays = false;
        let mut last_error = None;
        for _ in 0..ENQUEUE_ATTEMPTS {
            let sent = Instant::now();
            // Sent back to back: the session runs them in order.
            let create = client.create(&protected, b"", &ephemeral);
            let listing = client.list_children(parent);
            let (created, listed) = (create.await, listing.await);
            #[cfg(test)]
            let created = faults::lose_reply(created);
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
                    let container = CreateMode::Container.with_acls(Acls::anyone_all());
                    both.add_create(parent, b"", &container)
                        .and_then(|()| both.add_create(&protected, b"", &ephemeral))
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
                        Err(e) => {
                            // Perhaps applied, with the answer lost.
                            strays = true;
                            last_error = Some(e.into());
                        }
                    }
                }
                Err(ZkError::SessionExpired) => return Err(vanished()),
                Err(e) => {
                    // The create may have happened: a node of ours may now
                    // exist whether or not we find it.
                    strays = true;
                    // `sync` first, so the listing sees every write the
                    // leader took.
                    let found = async {
                        #[cfg(test)]
                        faults::fail_lookup()?;
                        client.sync(parent).await?;
                        let listed = client.list_children(parent).await?;
                        match listed.iter().find(|c| c.starts_with(&mine)).cloned() {
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

    fn granted(
        &self,
        req: &AcquireRequest<'_>,
        session: &Arc<Session>,
        path: &str,
        sent: Instant,
        granted_at: Instant,
        fence: u64,
    ) -> Result<Option<Acquired>> {
        let acquired = Acquired::new(sent).with_fence(fence);
        if let Some(owned) = self.owned().get_mut(req.token) {
            owned.granted = true;
        }
        // A fixed lease counts from the grant, as on every backend: a lock
        // won after a long wait gets its whole lease.
        let fixed_end = (req.lease_kind == LeaseKind::Fixed).then(|| granted_at + req.lease);
        // Registered with the session either way: its expiry ends the lock
        // whatever the lease.
        let confirmed_at = session
            .hold(*req.token, req.loss.clone(), fixed_end)
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

    /// Deletes our node, and every stray one of ours if there may be some.
    /// The entry is forgotten only once that worked (or the session that
    /// held them is gone), so a failed or dropped release can be sent again
    /// instead of leaving a node that blocks the key for as long as the
    /// session lives.
    async fn delete_owned(&self, token: &Token) -> Result<ReleaseOutcome> {
        let (parent, path, session) = {
            let owned = self.owned();
            let Some(owned) = owned.get(token) else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            (
                owned.parent.clone(),
                owned.path.clone().filter(|_| !owned.strays),
                owned.session.clone(),
            )
        };
        session.forget(token);
        let outcome = match session.client() {
            Ok(client) => delete_ours(&client, &parent, path, token).await,
            Err(e) => Err(e),
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            // The session is gone, and its ephemeral nodes with it.
            Err(ZkError::SessionExpired) => ReleaseOutcome::NotHeld,
            Err(e) => return Err(backend_error(e)),
        };
        self.owned().remove(token);
        self.inner.lease_ends.cancel(*token);
        Ok(outcome)
    }
}

/// How long a lock is held before its node is watched: a lock released
/// sooner costs no watch (the common lock-and-release stays at three
/// packets), and a node deleted behind its holder's back meanwhile is
/// found gone when the watch is set.
const WATCH_AFTER: Duration = Duration::from_millis(100);

/// Tells the guard of `token` its lock is lost once its node at `path` is
/// deleted by anyone but us (an operator's `delete`, a forced unlock):
/// another client may hold the key from then on. Within [`WATCH_AFTER`]
/// and a round trip of the delete. Our own deletes (release, a fixed
/// lease's end) stop tracking the lock first, which ends this. Ends with
/// the node, or with the session.
fn watch_our_node(session: &Arc<Session>, token: Token, path: String) {
    let session = Arc::downgrade(session);
    tokio::spawn(async move {
        tokio::time::sleep(WATCH_AFTER).await;
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            let Some(client) = session
                .upgrade()
                .filter(|s| s.holds(&token))
                .and_then(|s| s.client().ok())
            else {
                return;
            };
            let watched = client.check_and_watch_stat(&path).await;
            drop(client);
            let watcher = match watched {
                Ok((Some(_), watcher)) => watcher,
                Ok((None, _)) => break,
                // The session ended, and the lock with it: its guards
                // were told.
                Err(ZkError::SessionExpired | ZkError::SessionMoved | ZkError::ClientClosed) => {
                    return
                }
                // Cut off for now: the session's own clock loses the lock
                // if it stays so; look again.
                Err(_) => {
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            backoff.reset();
            match watcher.changed().await.event_type {
                EventType::NodeDeleted => break,
                // A terminal session state: the session's monitor tells.
                EventType::Session => return,
                // A proclaim set the data: watch again.
                _ => {}
            }
        }
        if let Some(session) = session.upgrade() {
            session.forget(&token);
        }
    });
}

/// Deletes `path`, or without it (the create unanswered, or strays
/// possible) every child of `parent` carrying `token`. Once: a failure is
/// sent again by core, with backoff (see `Backend::abandon`).
async fn delete_ours(
    client: &Client,
    parent: &str,
    path: Option<String>,
    token: &Token,
) -> Result<ReleaseOutcome, ZkError> {
    let paths = match path {
        Some(path) => vec![path],
        // The create may still be in flight: this listing runs after it on
        // the same session. Synced first: after a reconnect the session may
        // read from another server, which may not have applied every write
        // of ours yet.
        None => {
            match client.sync(parent).await {
                Ok(()) | Err(ZkError::NoNode) => {}
                Err(e) => return Err(e),
            }
            let mine = format!("lock-{token}-");
            match client.list_children(parent).await {
                Ok(children) => children
                    .into_iter()
                    .filter(|c| c.starts_with(&mine))
                    .map(|c| format!("{parent}/{c}"))
                    .collect(),
                Err(ZkError::NoNode) => Vec::new(),
                Err(e) => return Err(e),
            }
        }
    };
    let mut outcome = ReleaseOutcome::NotHeld;
    for path in paths {
        match client.delete(&path, None).await {
            Ok(()) => outcome = ReleaseOutcome::Released,
            Err(ZkError::NoNode) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(outcome)
}

/// Deletes our nodes other than `name` among `children` (best effort: what
/// is left is deleted on release, which then lists every node of ours).
async fn delete_strays(client: &Client, parent: &str, mine: &str, name: &str, children: &[String]) {
    for stray in children
        .iter()
        .filter(|c| c.starts_with(mine) && *c != name)
    {
        match client.delete(&format!("{parent}/{stray}"), None).await {
            Ok(()) => tracing::debug!(stray, "dlock zookeeper deleted a stray node of ours"),
            Err(ZkError::NoNode) => {}
            Err(error) => {
                tracing::debug!(%error, stray, "dlock zookeeper stray node not deleted yet")
            }
        }
    }
}

/// Faults injected by unit tests: answers lost on the way back, which a
/// real server cannot be made to lose on demand.
#[cfg(test)]
mod faults {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use zookeeper_client::Error as ZkError;

    /// Successful creates whose answer is turned into a connection loss.
    pub(super) static LOST_REPLIES: AtomicUsize = AtomicUsize::new(0);
    /// Searches for our node after a failed create that fail too.
    pub(super) static FAILED_LOOKUPS: AtomicUsize = AtomicUsize::new(0);

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
        if take(&FAILED_LOOKUPS) {
            return Err(ZkError::ConnectionLoss);
        }
        Ok(())
    }
}

impl Backend for ZkBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// The session (opening one if it ended) and a read through it.
    fn check_servers(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let session = self.session().await?;
            session
                .client()
                .map_err(backend_error)?
                .check_stat("/")
                .await
                .map(drop)
                .map_err(backend_error)
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .fencing(true)
            .fifo(true)
            .session_leases(true)
            .read_write(true)
            .semaphores(true)
    }

    fn acquire<'a>(&'a self, req: AcquireRequest<'a>) -> BoxFuture<'a, Result<Option<Acquired>>> {
        Box::pin(async move { self.acquire_inner(&req).await })
    }

    fn release<'a>(
        &'a self,
        _key: &'a LockKey,
        _mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move { self.delete_owned(token).await })
    }

    /// Gives the token's session up: its client is dropped, which closes
    /// the session if a server answers (its nodes go at once) and otherwise
    /// lets it expire within its timeout. Every guard on it is lost, and
    /// later acquisitions open a new session.
    fn abandon<'a>(
        &'a self,
        _key: &'a LockKey,
        _mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Some(owned) = self.owned().remove(token) {
                self.inner.lease_ends.cancel(*token);
                owned.session.abandon();
            }
        })
    }

    fn renew<'a>(&'a self, locks: &'a [RenewRequest]) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        // Nodes live on the session; renewing one means confirming it exists.
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(locks.len());
            for lock in locks {
                let found = self
                    .owned()
                    .get(&lock.token)
                    .and_then(|o| Some((o.path.clone()?, o.session.clone())));
                let outcome = match found {
                    Some((path, session)) => {
                        let checked = match session.client() {
                            Ok(client) => client.check_stat(&path).await,
                            Err(e) => Err(e),
                        };
                        match checked {
                            Ok(Some(_)) => RenewOutcome::Renewed,
                            Ok(None) | Err(ZkError::SessionExpired) => RenewOutcome::NotHeld,
                            Err(e) => return Err(backend_error(e)),
                        }
                    }
                    None => RenewOutcome::NotHeld,
                };
                outcomes.push(outcome);
            }
            Ok(outcomes)
        })
    }

    /// Sets our node's data, if it holds: only the client that took the
    /// lock knows its node, and the node goes with the hold.
    fn proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
            let held = self
                .owned()
                .get(token)
                .filter(|o| o.granted && o.parent == parent)
                .and_then(|o| Some((o.path.clone()?, o.session.clone())));
            let Some((path, session)) = held else {
                return Ok(false);
            };
            let client = match session.client() {
                Ok(client) => client,
                Err(ZkError::SessionExpired) => return Ok(false),
                Err(e) => return Err(backend_error(e)),
            };
            match client.set_data(&path, &with_proclaimed(value), None).await {
                Ok(_) => Ok(true),
                Err(ZkError::NoNode | ZkError::SessionExpired) => Ok(false),
                Err(e) => Err(backend_error(e)),
            }
        })
    }

    /// The first child of the key's parent, and its data: its czxid is
    /// the holder's fence. A child deleted between the listing and the
    /// read is read past (a few times, then the server's error).
    fn holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>> {
        Box::pin(async move {
            let session = self.session().await?;
            let client = session.client().map_err(backend_error)?;
            let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
            synced(&client, &parent).await?;
            let mut last = ZkError::NoNode;
            for _ in 0..5 {
                let children = match client.list_children(&parent).await {
                    Ok(children) => children,
                    Err(ZkError::NoNode) => return Ok(None),
                    Err(e) => return Err(backend_error(e)),
                };
                let Some(first) = holding(children) else {
                    return Ok(None);
                };
                match client.get_data(&format!("{parent}/{first}")).await {
                    Ok((data, stat)) => {
                        let fence = u64::try_from(stat.czxid).unwrap_or(0);
                        return Ok(Some(Holder::new(Some(fence), proclaimed(&data))));
                    }
                    Err(e @ ZkError::NoNode) => last = e,
                    Err(e) => return Err(backend_error(e)),
                }
            }
            Err(backend_error(last))
        })
    }

    /// Watches armed by the reads that compare: the parent's children (a
    /// grant after a release, a node gone with its session; a waiter
    /// joining wakes it for nothing), the first child's data (a proclaim,
    /// its deletion), or the parent's creation when there is none.
    fn holder_changed<'a>(
        &'a self,
        key: &'a LockKey,
        seen: Option<&'a Holder>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let session = self.session().await?;
            let client = session.client().map_err(backend_error)?;
            let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
            synced(&client, &parent).await?;
            // A first child deleted between the listing and its read is
            // read past a few times; then the caller reads again.
            for _ in 0..5 {
                let (children, children_changed) =
                    match client.list_and_watch_children(&parent).await {
                        Ok(listed) => listed,
                        Err(ZkError::NoNode) => {
                            let (stat, created) = client
                                .check_and_watch_stat(&parent)
                                .await
                                .map_err(backend_error)?;
                            if stat.is_some() {
                                continue;
                            }
                            if seen.is_some() {
                                return Ok(());
                            }
                            created.changed().await;
                            return Ok(());
                        }
                        Err(e) => return Err(backend_error(e)),
                    };
                let Some(first) = holding(children) else {
                    if seen.is_some() {
                        return Ok(());
                    }
                    children_changed.changed().await;
                    return Ok(());
                };
                let read = client
                    .get_and_watch_data(&format!("{parent}/{first}"))
                    .await;
                let (data, stat, data_changed) = match read {
                    Ok(read) => read,
                    Err(ZkError::NoNode) => continue,
                    Err(e) => return Err(backend_error(e)),
                };
                let current = Holder::new(
                    Some(u64::try_from(stat.czxid).unwrap_or(0)),
                    proclaimed(&data),
                );
                if Some(&current) != seen {
                    return Ok(());
                }
                tokio::select! {
                    _ = children_changed.changed() => {}
                    _ = data_changed.changed() => {}
                }
                return Ok(());
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node names keys had before the codec moved into core: a key's
    /// name on the server must never change.
    #[test]
    fn node_names_are_byte_for_byte_the_same_as_before() {
        for (key, name) in [
            ("order:42", "order:42"),
            ("a/b", "a%2Fb"),
            ("a%b", "a%25b"),
            ("{x}", "%7Bx%7D"),
            ("ключ", "%D0%BA%D0%BB%D1%8E%D1%87"),
            ("tab\there", "tab%09here"),
            ("nul\0", "nul%00"),
            ("\u{85}", "%C2%85"),
            ("..", "%2E%2E"),
            ("a b", "a%20b"),
            ("🔒", "%F0%9F%94%92"),
        ] {
            assert_eq!(escape(&LockKey::new(key).unwrap()), name, "{key:?}");
        }
    }

    #[test]
    fn escaping_makes_any_key_one_safe_node_name() {
        let names: Vec<String> = [".", "..", "a/b", "a%2Fb", "ключ", "🔒", "nul\0", "x y"]
            .iter()
            .map(|k| escape(&LockKey::new(k).unwrap()))
            .collect();
        for n in &names {
            assert!(
                n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_:%".contains(&b)),
                "{n}"
            );
            assert!(n != "." && n != "..");
        }
        let distinct: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(distinct.len(), names.len());
    }

    /// Two connection losses in a row during the create: its answer is
    /// lost, and so is the search for the node it made. The second create
    /// makes a second node; the first one, ahead of it, is ours too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_left_by_a_lost_create_answer_is_neither_waited_on_nor_left_behind() {
        use dlock_core::{BackendExt, LockOptions};
        use std::sync::atomic::Ordering;

        let server = dlock_testkit::fixture::ZooKeeperServer::start().expect("start ZooKeeper");
        let url = format!("zk://{}/strays", server.endpoint());
        let backend = ZkBackend::connect(&url).await.unwrap();
        let locker = backend.clone().into_locker();
        let rival = ZkBackend::connect(&url).await.unwrap().into_locker();
        let raw = zookeeper_client::Client::connect(&server.endpoint())
            .await
            .unwrap();
        let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
        raw.create("/strays/k", b"", &persistent).await.unwrap();

        faults::LOST_REPLIES.store(1, Ordering::SeqCst);
        faults::FAILED_LOOKUPS.store(1, Ordering::SeqCst);
        let wait = LockOptions::new().wait(Duration::from_secs(3));
        let guard = locker
            .lock_with("k", wait)
            .await
            .expect("the lock waited on a node of its own");
        assert_eq!(faults::LOST_REPLIES.load(Ordering::SeqCst), 0);
        assert_eq!(faults::FAILED_LOOKUPS.load(Ordering::SeqCst), 0);
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
        faults::LOST_REPLIES.store(1, Ordering::SeqCst);
        faults::FAILED_LOOKUPS.store(1, Ordering::SeqCst);
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

    #[test]
    fn node_names_say_what_they_take() {
        let token = "00ab";
        for mode in [
            Mode::Exclusive,
            Mode::Read,
            Mode::Write,
            Mode::Permits { count: 2, limit: 5 },
        ] {
            let name = format!("lock-{token}-{}0000000012", mode_tag(mode));
            assert_eq!(mode_of(&name), Some(mode), "{name}");
            assert_eq!(sequence(&name), Some(12), "{name}");
        }
        assert_eq!(
            mode_tag(Mode::Exclusive),
            "",
            "a plain lock's names stay as before"
        );
    }

    #[test]
    fn sequences_sort_lock_nodes() {
        assert_eq!(sequence("lock-00ab-0000000012"), Some(12));
        assert_eq!(sequence("junk"), None);
    }
}
