//! `EtcdBackend`: etcd's lock recipe, fixed where it is known to be weak.
//!
//! - **One session per backend** (per TTL): one lease, kept alive by one
//!   task, holds every lock taken under the watchdog. If it cannot be kept
//!   alive for a TTL, or etcd says it expired, every guard on it reports
//!   lost and later acquisitions start a new session.
//! - **The queue**: each acquisition puts its own key,
//!   `{prefix}/{escaped key}/{lease hex}-{token}`, so two tasks on one
//!   session are two owners (etcd issue #11360), in one transaction with
//!   the read of the queue. The key with the lowest create revision holds
//!   the lock; that revision is the fencing token.
//! - **Waiting** ([`queue`], driven by core's wait engine) watches only the
//!   entry that keeps us waiting, for its deletion (no herd), from the
//!   current revision, then reads it again, so that a wake-up is served at
//!   once rather than by etcd's catch-up loop. Each look checks that our
//!   key still exists (a session that expired is an error, not a grant).
//! - **Read-write locks and semaphores** queue the same way at
//!   `{prefix}/{key}%rw/` and `{prefix}/{key}%sem/`, each entry's value
//!   saying what it takes (`r`, `w`, `p{count}/{limit}`). A reader watches
//!   the last writer ahead, a writer its predecessor, permits every entry
//!   ahead; a client naming another limit than the entries there gets a
//!   typed error and leaves no entry.
//! - **Release and cancel** delete our own key, which only we can name. A
//!   delete that fails is sent again by core until a lease has passed;
//!   then the session's keepalive stops and its lease is revoked, so the
//!   key goes within one TTL. A key deleted behind a holder's back is
//!   noticed at the next keepalive and reported lost.
//! - **`layout=etcdctl`** (see the crate's README): one acquisition of a
//!   key per session at a time ([`turn`]), and a key left under the name
//!   on another lease is waited out, never taken over.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use dlock_core::{
    backend::{
        wait, AcquireRequest, Acquired, Backend, Capabilities, Holder, ListPage, ListRequest,
        LocalTurn, LocalTurns, Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
    },
    LockError, LockKey, Result, Token,
};
use etcd_client::{
    Client, Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget,
    WatchOptions,
};
use tokio::time::Instant;

use crate::session::Session;

mod list;
mod queue;
mod release;
mod requests;
mod session;
mod turn;

use requests::{delete_if, put_if_created, retried, watched};
use turn::KeptTurn;

const NAME: &str = "etcd";

fn backend_error(e: etcd_client::Error) -> LockError {
    LockError::backend(NAME, e)
}

fn vanished() -> LockError {
    LockError::backend(
        NAME,
        std::io::Error::other("our queue key vanished while waiting: the session expired"),
    )
}

/// An etcd v3 lock server, with read-write locks, semaphores and fencing
/// tokens: how it locks is in the [crate docs](crate), what it guarantees
/// in [dlock's guide](https://docs.rs/dlock/latest/dlock/guide/backends/index.html).
///
/// Locks under the watchdog live on one session lease per backend (per
/// TTL), kept alive by one task: its TTL is how long a crashed holder
/// keeps its locks. A fixed lease gets an etcd lease of its own (whole
/// seconds, rounded up; the guard still reports lost at the lease asked
/// for).
///
/// [`Locker::state`](dlock_core::Locker::state) follows the session
/// leases: `Suspended` when a keepalive goes unanswered, `Lost` when a
/// lease with guards on it expires, `Reconnected` at the next answered
/// keepalive or a new lease.
///
/// # Examples
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_etcd::EtcdBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = EtcdBackend::connect("etcd://127.0.0.1:2379/locks").await?.into_locker();
/// let guard = locker.lock("report:daily").await?;
/// println!("fence {:?}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    prefix: String,
    sessions: tokio::sync::Mutex<HashMap<u64, Arc<Session>>>,
    /// The etcd key of every acquisition in flight or held, by token.
    owned: Mutex<HashMap<Token, Owned>>,
    /// `layout=etcdctl`: plain locks at `{key}/{lease hex}` (see
    /// `EtcdConfig::etcdctl_layout`).
    etcdctl: bool,
    /// With `etcdctl`, this process's turns at plain locks' keys (see
    /// [`queue::Steps::turn`]).
    turns: LocalTurns<String>,
    /// With `etcdctl`, the entry names a request may still make or delete
    /// a key of (see [`NameGuard`]).
    naming: LocalTurns<String>,
    /// Fed by every session: see [`Locker::state`](dlock_core::Locker::state).
    states: dlock_core::backend::ConnectionStates,
    /// Without a wait limit, how long the cluster may stay unreachable
    /// before a waiting acquire fails with the error.
    unreachable_after: Duration,
}

struct Owned {
    name: String,
    /// The session the key waited on (and, under the watchdog, lives on).
    session: Arc<Session>,
    /// A fixed lease of this acquisition's own, revoked on release.
    own_lease: Option<i64>,
    /// Whether the key was moved onto `own_lease`, off the session.
    on_own_lease: bool,
    /// The key's create revision, once known: with `layout=etcdctl`, a
    /// release deletes only the key created then.
    created: Option<i64>,
    /// Whether the entry's name carries this acquisition's token (dlock's
    /// layout), so that no other request ever makes a key of that name:
    /// a plain delete of the name then removes only this key.
    own_name: bool,
    /// The key's create revision, once granted: its place and fence.
    granted: Option<i64>,
    /// Whether a release was sent whose outcome is unknown (it failed):
    /// if it ran, the key is gone when the release is sent again.
    release_sent: bool,
    /// With `layout=etcdctl`, the entry name's guard, until granted.
    guard: Option<NameGuard>,
    /// With `layout=etcdctl`, the grant's turn at its key.
    turn: Option<KeptTurn>,
    /// The note stored in the entry's value, kept there by a proclaim.
    note: Box<str>,
}

/// With `layout=etcdctl`, an acquisition's hold on its entry's name from
/// before its enqueue until it is granted or its entry is gone: a request
/// cancelled mid-enqueue runs on, and with core's release after it, may
/// still make or delete a key of the name (on the session's lease, like
/// the next acquisition's). Shared by the enqueue and the entry.
type NameGuard = Arc<LocalTurn<String>>;

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

/// `%`-escapes the characters that would make a key ambiguous as a prefix
/// (`/`) or unreadable (`%`, controls), one-to-one.
fn escape(key: &LockKey) -> String {
    key.escaped(|c| c == '/' || c.is_control())
}

/// Separates a queue entry's mode tag from its holder's note.
const NOTE: u8 = 0x1f;

/// A queue entry's value: what it takes (its mode's tag), then `0x1F`
/// and the holder's note (without NULs), then a NUL and the proclaimed
/// value, if any (see `proclaim`).
fn entry_value(mode: Mode, note: &str, proclaimed: Option<&[u8]>) -> Vec<u8> {
    let mut entry = mode.tag().into_bytes();
    if !note.is_empty() {
        entry.push(NOTE);
        entry.extend(note.bytes().filter(|&b| b != 0));
    }
    if let Some(value) = proclaimed {
        entry.push(0);
        entry.extend_from_slice(value);
    }
    entry
}

/// A queue entry's value's head (before the first NUL): its tag, and the
/// note after it.
fn head_of(value: &[u8]) -> (&[u8], Option<&[u8]>) {
    let head = value.split(|&b| b == 0).next().unwrap_or_default();
    match head.iter().position(|&b| b == NOTE) {
        Some(at) => (&head[..at], Some(&head[at + 1..])),
        None => (head, None),
    }
}

/// What a queue entry's value says it takes.
fn mode_of(value: &[u8]) -> Option<Mode> {
    Mode::from_tag(std::str::from_utf8(head_of(value).0).ok()?)
}

/// The holder a queue entry names: its fence (create revision), mode,
/// note and proclaimed value.
fn holder_of(kv: &KeyValue) -> Holder {
    let fence = u64::try_from(kv.create_revision()).unwrap_or(0);
    let value = kv.value();
    let proclaimed = value
        .iter()
        .position(|&b| b == 0)
        .map(|at| value[at + 1..].to_vec());
    let mut holder = Holder::new(Some(fence), proclaimed);
    if let Some(mode) = mode_of(value) {
        holder = holder.with_mode(mode);
    }
    match head_of(value).1 {
        Some(note) => holder.with_note(String::from_utf8_lossy(note)),
        None => holder,
    }
}

impl EtcdBackend {
    fn owned(&self) -> MutexGuard<'_, HashMap<Token, Owned>> {
        self.inner.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the record of `token`'s acquisition, if there is one.
    fn update(&self, token: &Token, change: impl FnOnce(&mut Owned)) {
        if let Some(owned) = self.owned().get_mut(token) {
            change(owned);
        }
    }

    /// Whether `mode`'s entries take Go's layout: plain locks with
    /// `layout=etcdctl`.
    fn go_layout(&self, mode: Mode) -> bool {
        self.inner.etcdctl && mode == Mode::Exclusive
    }

    /// The entries of `mode`'s `queue` among `kvs`, in the order read.
    /// With `layout=etcdctl`, only those directly in it: lock `a`'s read
    /// of `a/` also returns lock `a/b`'s entries, which are not its own.
    /// In dlock's layout every entry read counts, nested or not (another
    /// prefix may nest under this one: waiting on its entries is
    /// cautious, and a read limited to one entry must not drop it).
    fn direct(&self, queue: &str, mode: Mode, mut kvs: Vec<KeyValue>) -> Vec<KeyValue> {
        if self.go_layout(mode) {
            kvs.retain(|kv| {
                kv.key()
                    .get(queue.len()..)
                    .is_some_and(|rest| !rest.contains(&b'/'))
            });
        }
        kvs
    }

    /// How to read a queue of `mode`, oldest first: a plain lock needs
    /// only the first entry, unless queues nest (see [`Self::direct`]); shared
    /// modes need them all.
    fn queue_read(&self, mode: Mode) -> GetOptions {
        let all = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        if mode == Mode::Exclusive && !self.go_layout(mode) {
            all.with_limit(1)
        } else {
            all
        }
    }

    /// `key`'s queue in `mode` (see [`Self::queue`]), read as
    /// [`Self::queue_read`] says.
    async fn read_queue(&self, key: &LockKey, mode: Mode) -> Result<(String, Vec<KeyValue>)> {
        let queue = self.queue(key, mode);
        let mut read = self.get(&queue, self.queue_read(mode)).await?;
        let entries = self.direct(&queue, mode, read.take_kvs());
        Ok((queue, entries))
    }

    /// Where `key`'s entries in `mode` queue: `{prefix}/{key}/`,
    /// `{prefix}/{key}%rw/` or `{prefix}/{key}%sem/` (an escaped key has
    /// `%` only before two hex digits, so these never meet), or for a plain
    /// lock with `layout=etcdctl`, `{key}/` as `etcdctl lock` names it.
    fn queue(&self, key: &LockKey, mode: Mode) -> String {
        let kind = match mode {
            _ if self.go_layout(mode) => return format!("{}/", key.as_str()),
            Mode::Read | Mode::Write => "%rw",
            Mode::Permits { .. } => "%sem",
            _ => "",
        };
        format!("{}/{}{kind}/", self.inner.prefix, escape(key))
    }

    /// The name of our entry in `queue` on `lease`: with the etcdctl
    /// layout, the lease alone in hex, as Go's `concurrency.Mutex` writes
    /// it (one entry per session and key: see [`queue::Steps::turn`]).
    fn entry_name(&self, queue: &str, mode: Mode, lease: i64, token: &Token) -> String {
        if self.go_layout(mode) {
            format!("{queue}{lease:x}")
        } else {
            format!("{queue}{lease:016x}-{token}")
        }
    }
}

impl Backend for EtcdBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// A linearizable count of the prefix: it needs a leader to answer.
    async fn check_servers(&self) -> Result<()> {
        let options = GetOptions::new().with_count_only();
        let answer = self
            .client()
            .get(self.inner.prefix.as_str(), Some(options))
            .await;
        if answer.is_ok() {
            // The cluster answers (see "Connection state").
            self.inner.states.answered();
        }
        answer.map(drop).map_err(backend_error)
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
        wait::drive(&queue::Steps(self), &req).await
    }

    async fn release(&self, _key: &LockKey, _mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        self.delete_owned(token).await
    }

    /// Gives the token's key up to its lease: a key on the session (under
    /// the watchdog) ends the session's keepalive, so the session's lease
    /// expires within one TTL, every guard on it is lost, and later
    /// acquisitions start a new session; a key on a fixed lease of its own
    /// expires with that lease. Both leases are also revoked if etcd
    /// answers, which removes their keys at once.
    async fn abandon(&self, _key: &LockKey, _mode: Mode, token: &Token) {
        // The session is given up before the entry (and with it the
        // turn at its key) goes: an acquisition that takes the turn
        // must not find this key on a session still in use.
        let owned = {
            let mut all = self.owned();
            if let Some(entry) = all.get(token).filter(|entry| !entry.on_own_lease) {
                entry.session.abandon();
            }
            all.remove(token)
        };
        let Some(owned) = owned else {
            return;
        };
        if let Some(own) = owned.own_lease {
            self.revoke_in_background(own);
        }
        if !owned.on_own_lease {
            self.revoke_in_background(owned.session.lease);
        }
    }

    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        // Locks live on leases etcd keeps (the session's keepalive, or a
        // fixed lease); renewing one means confirming its key still exists.
        let mut outcomes = Vec::with_capacity(locks.len());
        for lock in locks {
            let held = self
                .owned()
                .get(&lock.token)
                .map(|o| (o.name.clone(), o.created));
            let mut ours = false;
            if let Some((name, created)) = held {
                let options = GetOptions::new().with_keys_only();
                let found = self.client().get(name, Some(options)).await;
                let found = found.map_err(backend_error)?.take_kvs();
                // Ours only if created when we made it: with
                // `layout=etcdctl`, a later acquisition may use the name.
                ours = found
                    .first()
                    .is_some_and(|kv| created.is_none_or(|r| kv.create_revision() == r));
            }
            outcomes.push(match ours {
                true => RenewOutcome::Renewed,
                false => RenewOutcome::NotHeld,
            });
        }
        Ok(outcomes)
    }

    /// One transaction: if our key still has the revision it was granted
    /// with (it was first then, and no key can be created before it
    /// since, so it holds), its value becomes its mode tag (empty), a NUL
    /// and `value`, on the lease it has.
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        let held = self
            .owned()
            .get(token)
            .and_then(|owned| Some((owned.name.clone(), owned.granted?, owned.note.clone())));
        let Some((name, revision, note)) = held else {
            return Ok(false);
        };
        if !name.starts_with(&self.queue(key, Mode::Exclusive)) {
            return Ok(false);
        }
        let options = PutOptions::new().with_ignore_lease();
        let entry = entry_value(Mode::Exclusive, &note, Some(value));
        let put = put_if_created(&name, revision, entry, options);
        Ok(self.txn(put).await?.succeeded())
    }

    /// The queue's first entry: its create revision is the holder's
    /// fence; its value says its note; its lease's time to live (a second
    /// read) its lease left. etcd records no time of a grant: no age.
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        let Some(holder) = self.first_holder(key).await? else {
            return Ok(None);
        };
        let (holder, lease) = holder;
        let left = self.leases_left([lease]).await?;
        Ok(Some(match left.get(&lease) {
            Some(&left) => holder.with_lease_left(left),
            None => holder,
        }))
    }

    /// Every held plain lock, read-write lock and semaphore under the
    /// prefix, a page of queues at a time in the order of their names:
    /// one range read (and one more for a queue longer than it), and one
    /// lease read per distinct lease, for the lease left. Refused with
    /// `layout=etcdctl`.
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        list::page(self, &req).await
    }

    /// A watch of the key's queue, armed before the read that compares:
    /// any put or delete under it (a grant, a release, a lease that
    /// expired, a proclaim; a waiter joining wakes it for nothing).
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        let queue = self.queue(key, Mode::Exclusive);
        let range = WatchOptions::new().with_prefix();
        let mut watch = self.watch_from_now(queue, Some(range)).await?;
        let now = self.first_holder(key).await?.map(|(holder, _)| holder);
        if now.as_ref() != seen {
            return Ok(());
        }
        watched(&mut watch, |r| !r.events().is_empty()).await
    }

    fn connection_state(&self) -> tokio::sync::watch::Receiver<dlock_core::ConnectionState> {
        self.inner.states.subscribe()
    }

    /// The admitted entries of the semaphore's queue, in one read (an
    /// entry is there while its lease lives).
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        let (_, entries) = self
            .read_queue(key, Mode::Permits { count: 1, limit })
            .await?;
        let modes = entries
            .iter()
            .map(|kv| mode_of(kv.value()).unwrap_or(Mode::Exclusive));
        Ok(dlock_core::backend::permits_taken(modes))
    }

    /// Moves a granted key with a fixed lease onto a new lease of `lease`
    /// (rounded up to whole seconds, as etcd counts), in one transaction
    /// that checks the key's create revision, so that a key lost meanwhile
    /// is never recreated; then revokes the old lease. The key's value
    /// stays.
    async fn extend(
        &self,
        _key: &LockKey,
        _mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(Instant, Duration)>> {
        let sent = Instant::now();
        let held = self.owned().get(token).and_then(|owned| {
            let revision = owned.granted.filter(|_| owned.on_own_lease)?;
            // With `layout=etcdctl`, a turn given back (the lease ended)
            // is not taken again.
            let ended = owned.turn.as_ref().is_some_and(KeptTurn::given_back);
            (!ended).then(|| (owned.name.clone(), revision))
        });
        let Some((name, revision)) = held else {
            return Ok(None);
        };
        let new = self.grant_lease(lease).await?;
        let options = PutOptions::new().with_lease(new).with_ignore_value();
        // If this fails it may have landed all the same: the key then ends
        // with the new lease, whose end the guard already counts with.
        if !self
            .txn(put_if_created(&name, revision, "", options))
            .await?
            .succeeded()
        {
            self.revoke_in_background(new);
            // Our key is gone: so is any reason to keep its turn.
            if let Some(turn) = self.owned().get(token).and_then(|o| o.turn.as_ref()) {
                turn.move_end(Instant::now());
            }
            return Ok(None);
        }
        // The turn is kept to the new end only now: an extension that did
        // not land keeps no turn past the old one. (One that landed
        // unanswered leaves the key on the new lease: the next
        // acquisition waits until it is gone.)
        let old = self.owned().get_mut(token).and_then(|owned| {
            if let Some(turn) = &owned.turn {
                turn.move_end(sent + lease);
            }
            owned.own_lease.replace(new)
        });
        if let Some(old) = old {
            self.revoke_in_background(old);
        }
        Ok(Some((sent, lease)))
    }

    /// Deletes the holder's key (only the key read, by its create
    /// revision): the next in line, who watches it, takes the lock. A
    /// holder under the watchdog learns at its session's next check,
    /// within a third of the lease's TTL; a holder with a fixed lease
    /// only when that lease ends.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let (_, entries) = self.read_queue(key, Mode::Exclusive).await?;
        let Some(first) = entries.first() else {
            return Ok(false);
        };
        // Only the entry read: if it went meanwhile, a later key of that
        // name (its session's next acquisition) is not the holder asked.
        let name = first.key();
        let created = Compare::create_revision(name, CompareOp::Equal, first.create_revision());
        Ok(self.txn(delete_if(name, created)).await?.succeeded())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key names keys had before the codec moved into core: a key's
    /// name on the server must never change.
    #[test]
    fn key_names_are_byte_for_byte_the_same_as_before() {
        for (key, name) in [
            ("order:42", "order:42"),
            ("a/b", "a%2Fb"),
            ("a%b", "a%25b"),
            ("{x}", "{x}"),
            ("ключ", "ключ"),
            ("tab\there", "tab%09here"),
            ("nul\0", "nul%00"),
            ("\u{85}", "%C2%85"),
            ("..", ".."),
            ("a b", "a b"),
            ("🔒", "🔒"),
        ] {
            assert_eq!(escape(&LockKey::new(key).unwrap()), name, "{key:?}");
        }
    }
}
