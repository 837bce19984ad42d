//! `ZkBackend`: Curator's lock recipe (ephemeral sequential nodes under a
//! container parent, each watching its predecessor), fixed where it is weak.
//!
//! - **Nodes**: each key has a CONTAINER parent (the server removes it once
//!   empty), created in one transaction with the first child (the server
//!   reaps a container only once it had one). Each acquisition creates an
//!   EPHEMERAL_SEQUENTIAL child named `lock-{token}-` and the sequence
//!   ("protected": after a connection loss during the create, the node is
//!   found by its token, not created twice; [`ZkBackend::own_prefix`] for
//!   `layout=curator`), sent back to back with the read of the children (a
//!   session's requests run in order). The lowest sequence holds.
//! - **Read-write locks and semaphores** queue the same way under
//!   `{path}/{key}%rw` and `{path}/{key}%sem`, each node's name saying what
//!   it takes (`r-`, `w-`, `p{count}_{limit}-`). A client naming another
//!   limit than the nodes there gets a typed error and leaves no node.
//! - **Waiting** ([`queue`], driven by core's wait engine) watches the node
//!   that keeps us waiting (a reader the last writer ahead, a writer its
//!   predecessor, permits the children), no herd. A node of ours gone by
//!   then means the session expired: an error, not a grant.
//! - **Fencing token**: the node's czxid, which keeps growing even when a
//!   reaped parent restarts the sequence numbers.
//! - **Release and cancel** delete our node; a create still in flight is
//!   found by its token and deleted after it. A failed delete is sent
//!   again by core until a session timeout passed; then the session is
//!   given up, and its other guards report lost.
//! - **Stray nodes**: a create whose answer was lost may have made a node
//!   the search for it missed; every node with our token but the one kept
//!   is deleted before waiting and on release, and never waited on.
//! - **Session**: confirmed every third of its timeout by a `sync`
//!   (through the leader: a follower cut off from it cannot vouch). A
//!   grant's lease counts from the last `sync` or our create, never from a
//!   listing. A node deleted behind its holder's back loses its guard (see
//!   [`session::watch_our_node`]).
//! - **Fixed leases** (ephemeral nodes have no TTL): this process deletes
//!   the node when the lease ends, the session's expiry if it dies first.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use dlock_core::{
    backend::{
        AcquireRequest, Acquired, Backend, Capabilities, ConnectionStates, Holder, LeaseTimers,
        ListPage, ListRequest, Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
    },
    LockError, LockKey, Result, Token,
};
use tokio::time::Instant;
use zookeeper_client::{Acls, Connector, Error as ZkError};

use crate::{config::ZkConfig, session::Session};

mod election;
mod list;
mod queue;
mod release;
mod session;

const NAME: &str = "zookeeper";

fn backend_error(e: ZkError) -> LockError {
    match e {
        ZkError::NoAuth => LockError::PermissionDenied {
            backend: NAME,
            source: std::sync::Arc::new(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "not authorized: a node's ACL does not admit this session's credentials \
                 (see the `zk://user:password@` URL and `acl=`)",
            )),
        },
        e => LockError::backend(NAME, e),
    }
}

fn vanished() -> LockError {
    LockError::backend(
        NAME,
        std::io::Error::other("our lock node vanished while waiting: the session expired"),
    )
}

/// A ZooKeeper lock server: Curator's lock recipe (ephemeral sequential
/// nodes, each watching the one ahead), with read-write locks, semaphores
/// and fencing tokens (the node's czxid); what it guarantees is on
/// [dlock's guide](https://docs.rs/dlock/latest/dlock/guide/backends/index.html).
///
/// Locks live on one session per backend: its timeout is how long a
/// crashed holder keeps its locks. [`Locker::state`](dlock_core::Locker::state)
/// follows it: `Suspended` when the client is disconnected from every
/// server (its guards are [unsure](dlock_core::HoldState::Unsure)), `Lost`
/// when the session expires with guards on it (told by the servers, or a
/// whole timeout passed unconfirmed), `Reconnected` at the next
/// confirmation, or when a new session opens after a lost one.
///
/// [`Locker::list`](dlock_core::Locker::list) reads the names of every
/// key under the lock path for each page (ZooKeeper lists children whole,
/// never a page): it suits as many keys as their names fit in the
/// server's `jute.maxbuffer` (1 MB by default), and fails past that.
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
    /// Fed by every session: see "Connection state" above.
    states: ConnectionStates,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    owned: Mutex<HashMap<Token, Owned>>,
    /// Ends fixed leases (ephemeral nodes have no TTL): one task for all.
    lease_ends: LeaseTimers,
}

struct Owned {
    parent: String,
    /// How our node's name starts: see [`ZkBackend::own_prefix`].
    mine: String,
    /// Known once the create answered.
    path: Option<String>,
    /// A create whose answer was lost may have left another node with our
    /// token ("stray"): release then deletes every child carrying it.
    strays: bool,
    session: Arc<Session>,
    /// Whether the node holds the lock (it was first when granted, and
    /// no node is created before it since).
    granted: bool,
    /// Whether a release was sent whose outcome is unknown (it failed):
    /// if it ran, the node is gone when the release is sent again.
    release_sent: bool,
    /// The note in our node's data, kept there by a proclaim.
    note: Box<str>,
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

/// Whether `name` is a Curator mutex's node (`_c_{uuid}-lock-{seq}`).
fn is_curator(name: &str) -> bool {
    name.starts_with("_c_") && name.contains("-lock-")
}

/// A plain lock's queue with nodes of both layouts, dlock's own
/// (`lock-{token}-{seq}`) and Curator's: Curator orders dlock's own nodes
/// by the text after their last `lock-` (the token), so a Curator client
/// and a dlock client could both hold. Refused, with what to change.
fn mixed_layouts(children: &[String]) -> Option<LockError> {
    let curator = children.iter().any(|c| is_curator(c));
    let ours = children.iter().any(|c| c.starts_with("lock-"));
    (curator && ours).then(|| {
        dlock_core::InvalidReason::Other(
            "this lock's queue holds nodes of dlock's own layout beside Curator's, which \
             orders them wrongly: give every dlock client of a path that Curator shares \
             `layout=curator`"
                .to_owned(),
        )
        .into()
    })
}

fn mode_of(name: &str) -> Option<Mode> {
    // A Curator mutex's node (`_c_{uuid}-lock-{seq}`), in either layout:
    // counted as a plain lock, the safe reading.
    if is_curator(name) {
        return Some(Mode::Exclusive);
    }
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

impl ZkBackend {
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

    /// How the name of `token`'s node in `mode`'s queue starts, before its
    /// mode tag and sequence: `lock-{token}-`, or with `layout=curator`, a
    /// plain lock's as Curator's `InterProcessMutex` creates it
    /// ("protected"): `_c_{token as a UUID}-lock-` (see
    /// [`ZkConfig::curator_layout`]). A lost create's node is found by it.
    fn own_prefix(&self, token: &Token, mode: Mode) -> String {
        if !self.inner.config.curator_layout() || mode != Mode::Exclusive {
            return format!("lock-{token}-");
        }
        let hex = token.to_string();
        let (a, b, c, d) = (&hex[..8], &hex[8..12], &hex[12..16], &hex[16..20]);
        format!("_c_{a}-{b}-{c}-{d}-{}-lock-", &hex[20..])
    }

    /// The ACL of every node dlock creates: only its authenticated
    /// creator, or anyone (see [`ZkConfig`]'s "Credentials and ACLs").
    fn acls(&self) -> Acls<'static> {
        if self.inner.config.creator_acls() {
            Acls::creator_all()
        } else {
            Acls::anyone_all()
        }
    }

    fn owned(&self) -> MutexGuard<'_, HashMap<Token, Owned>> {
        self.inner.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the record of `token`'s acquisition, if there is one.
    fn update(&self, token: &Token, change: impl FnOnce(&mut Owned)) {
        if let Some(owned) = self.owned().get_mut(token) {
            change(owned);
        }
    }

    /// The live session's client, its view of `path` brought up to date
    /// with the leader's (see [`election::synced`]).
    async fn synced_client(&self, path: &str) -> Result<zookeeper_client::Client> {
        let client = self.session().await?.client().map_err(backend_error)?;
        election::synced(&client, path).await?;
        Ok(client)
    }
}

impl Backend for ZkBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// The session (opening one if it ended) and a read through it.
    async fn check_servers(&self) -> Result<()> {
        let session = self.session().await?;
        session
            .client()
            .map_err(backend_error)?
            .check_stat("/")
            .await
            .map(drop)
            .map_err(backend_error)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .forced_release(true)
            .fencing(true)
            .fifo(true)
            .session_leases(true)
            .read_write(true)
            .semaphores(true)
    }

    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        dlock_core::backend::wait::drive(&queue::Steps(self), &req).await
    }

    async fn release(&self, _key: &LockKey, _mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        self.delete_owned(token, true).await
    }

    /// Gives the token's session up: its client is dropped, which closes
    /// the session if a server answers (its nodes go at once) and otherwise
    /// lets it expire within its timeout. Every guard on it is lost, and
    /// later acquisitions open a new session.
    async fn abandon(&self, _key: &LockKey, _mode: Mode, token: &Token) {
        if let Some(owned) = self.owned().remove(token) {
            self.inner.lease_ends.cancel(*token);
            owned.session.abandon();
        }
    }

    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        // Nodes live on the session; renewing one means confirming it exists.
        let mut outcomes = Vec::with_capacity(locks.len());
        for lock in locks {
            let found = self
                .owned()
                .get(&lock.token)
                .and_then(|o| Some((o.path.clone()?, o.session.clone())));
            let outcome = match found {
                Some((path, session)) => {
                    match async { session.client()?.check_stat(&path).await }.await {
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
    }

    /// Sets our node's data, if it holds: only the client that took the
    /// lock knows its node, and the node goes with the hold.
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        let held = self
            .owned()
            .get(token)
            .filter(|o| o.granted && o.parent == parent)
            .and_then(|o| Some((o.path.clone()?, o.session.clone(), o.note.clone())));
        let Some((path, session, note)) = held else {
            return Ok(false);
        };
        let data = election::with_proclaimed(&note, value);
        match async { session.client()?.set_data(&path, &data, None).await }.await {
            Ok(_) => Ok(true),
            Err(ZkError::NoNode | ZkError::SessionExpired) => Ok(false),
            Err(e) => Err(backend_error(e)),
        }
    }

    /// The first child of the key's parent, and its data: its czxid is
    /// the holder's fence. A child deleted between the listing and the
    /// read is read past (a few times, then the server's error).
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        let client = self.synced_client(&parent).await?;
        for _ in 0..5 {
            let children = election::children(&client, &parent).await?;
            let Some(first) = children.and_then(election::holding) else {
                return Ok(None);
            };
            match client.get_data(&format!("{parent}/{first}")).await {
                Ok((data, stat)) => {
                    let holder = election::holder_of(&data, &stat).with_mode(Mode::Exclusive);
                    return Ok(Some(holder));
                }
                Err(ZkError::NoNode) => {}
                Err(e) => return Err(backend_error(e)),
            }
        }
        Err(backend_error(ZkError::NoNode))
    }

    /// The held plain locks, read-write locks and semaphores under the
    /// lock path, a page of keys at a time in the order of their names:
    /// each page reads the path's child names whole (ZooKeeper has no
    /// paged listing), then the page's keys' nodes and their holders'
    /// data, several keys at once. So every page costs in proportion to
    /// all the keys under the path, and the names must fit in one answer
    /// of the server's `jute.maxbuffer` (1 MB by default: some tens of
    /// thousands of keys; past it the listing fails). Holders' notes,
    /// fences and ages (from their nodes' creation time); no lease left (a
    /// lock lives as long as its session).
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        list::page(self, &req).await
    }

    /// Watches armed by the reads that compare: the parent's children (a
    /// grant after a release, a node gone with its session; a waiter
    /// joining wakes it for nothing), the first child's data (a proclaim,
    /// its deletion), or the parent's creation when there is none.
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        let client = self.synced_client(&parent).await?;
        // A first child deleted between the listing and its read is
        // read past a few times; then the caller reads again.
        for _ in 0..5 {
            let (children, children_changed) = match client.list_and_watch_children(&parent).await {
                Ok(listed) => listed,
                Err(ZkError::NoNode) => {
                    let (stat, created) = client
                        .check_and_watch_stat(&parent)
                        .await
                        .map_err(backend_error)?;
                    if stat.is_some() {
                        continue;
                    }
                    if seen.is_none() {
                        created.changed().await;
                    }
                    return Ok(());
                }
                Err(e) => return Err(backend_error(e)),
            };
            let Some(first) = election::holding(children) else {
                if seen.is_none() {
                    children_changed.changed().await;
                }
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
            let holder = election::holder_of(&data, &stat).with_mode(Mode::Exclusive);
            if Some(&holder) == seen {
                tokio::select! {
                    _ = children_changed.changed() => {}
                    _ = data_changed.changed() => {}
                }
            }
            return Ok(());
        }
        Ok(())
    }

    fn connection_state(&self) -> tokio::sync::watch::Receiver<dlock_core::ConnectionState> {
        self.inner.states.subscribe()
    }

    /// Moves the end this backend keeps for a fixed lease (ephemeral
    /// nodes have no TTL), for a lock whose node the leader still has
    /// (read after a `sync`: another client may have deleted it before
    /// our watch told us), on a session not expired.
    async fn extend(
        &self,
        _key: &LockKey,
        _mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(Instant, Duration)>> {
        let held = match self.owned().get(token) {
            Some(owned) if owned.granted => owned.path.clone().map(|p| (p, owned.session.clone())),
            _ => None,
        };
        let Some((path, session)) = held else {
            return Ok(None);
        };
        let client = session.client().map_err(backend_error)?;
        election::synced(&client, &path).await?;
        match client.check_stat(&path).await {
            Ok(Some(_)) => Ok(session.holders.extend_fixed(
                token,
                lease,
                session.timeout,
                &self.inner.lease_ends,
            )),
            Ok(None) => Ok(None),
            Err(e) => Err(backend_error(e)),
        }
    }

    /// The admitted nodes of the semaphore's queue, after a `sync` (a
    /// node is there while its session lives).
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        let mode = Mode::Permits { count: 1, limit };
        let parent = parent_of(self.inner.config.path(), key, mode);
        let client = self.synced_client(&parent).await?;
        let mut children = election::children(&client, &parent)
            .await?
            .unwrap_or_default();
        children.sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
        let modes = children
            .iter()
            .map(|c| mode_of(c).unwrap_or(Mode::Exclusive));
        Ok(dlock_core::backend::permits_taken(modes))
    }

    /// Deletes the holder's node: its own-node watch tells its guard at
    /// once (a lock held under 100 ms finds out when it sets the watch),
    /// and the next node's watcher takes the lock.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        let client = self.synced_client(&parent).await?;
        let children = election::children(&client, &parent).await?;
        let Some(first) = children.and_then(election::holding) else {
            return Ok(false);
        };
        let path = format!("{parent}/{first}");
        if is_curator(&first) {
            let data = match client.get_data(&path).await {
                Ok((data, _)) => data,
                Err(ZkError::NoNode) => return Ok(false),
                Err(e) => return Err(backend_error(e)),
            };
            if !election::written_by_dlock(&data) {
                // Curator's holder does not watch its own node: it would
                // never learn, and hold beside the next one.
                return Err(LockError::Unsupported {
                    backend: NAME,
                    what: "forcing the lock of a Curator holder, which would never learn of it",
                });
            }
        }
        match client.delete(&path, None).await {
            Ok(()) => Ok(true),
            // Gone meanwhile (released, expired): the holder asked about
            // left; the next one is not ours to remove.
            Err(ZkError::NoNode) => Ok(false),
            Err(e) => Err(backend_error(e)),
        }
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
        assert_eq!(sequence("junk"), None);
        assert_eq!(
            mode_tag(Mode::Exclusive),
            "",
            "a plain lock's names stay as before"
        );
    }
}
