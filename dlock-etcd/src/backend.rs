//! `EtcdBackend`: etcd's lock recipe (a revision queue under the key's
//! prefix), with the handoff served at once and every waiter an owner.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use dlock_core::{
    backend::{
        AcquireRequest, Acquired, Backend, Backoff, Capabilities, Holder, Mode, ReleaseOutcome,
        RenewOutcome, RenewRequest,
    },
    LockError, LockKey, Result, Token,
};
use etcd_client::{Client, GetOptions, KeyValue, SortOrder, SortTarget};

use crate::session::Session;

mod election;
mod enter;
mod queue;
mod release;
mod session;
mod turn;

use turn::{Turn, TurnUntil};

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

/// An etcd v3 lock server.
///
/// # How it locks
///
/// etcd's own `concurrency` recipe, fixed where it is known to be weak:
///
/// - **One session per backend**: one lease, kept alive by one task, holds
///   every lock taken under the watchdog; its TTL is how long a crashed
///   holder keeps its locks. If it cannot be kept alive for a TTL, or etcd
///   says it expired, every guard on it reports lost and later acquisitions
///   start a new session.
/// - **The queue**: each acquisition puts its own key,
///   `{prefix}/{escaped key}/{lease hex}-{token}`, so two tasks on one
///   session are two owners (etcd issue #11360). The key with the lowest
///   create revision holds the lock; that revision is the fencing token.
/// - **Acquire** is one transaction: put our key if absent, and read the
///   first key of the queue.
/// - **Waiting** watches only the key just ahead of ours, for its deletion
///   (no herd). The watch starts at the current revision and the
///   predecessor is checked afterwards, so the wake-up is served at once
///   rather than by etcd's catch-up loop for old revisions (100 ms).
/// - **When woken**, one transaction checks that our key still exists (our
///   session may have expired meanwhile: an error, not a grant) and whether
///   it is first now.
/// - **Release and cancel** delete our own key, which only we can name. A
///   delete that fails is sent again by core until a lease has passed; then
///   the session's keepalive stops and its lease is revoked, so the key goes
///   within one TTL (every other guard on that session reports lost, and
///   later acquisitions start a new session). A delete sent again after
///   its answer was lost, which finds the key gone, says released while
///   the key's lease lives (the key was deleted, by the first send or
///   after it was sent), and not held once that lease ended. etcd does
///   not say who deleted a key: one deleted by `force_release` or by hand
///   just before such a release also reads as released.
/// - A key deleted behind a holder's back is noticed at the next keepalive
///   and reported lost.
/// - **Read-write locks and semaphores** use the same queue, at
///   `{prefix}/{key}%rw/` and `{prefix}/{key}%sem/`, each entry's value
///   saying what it takes (`r`, `w`, `p{count}/{limit}`). An entry holds
///   when everything ahead of it allows it: a reader when no writer is
///   ahead (a waiting writer keeps later readers out), a writer when it is
///   first, permits when those ahead and its own fit the limit. A reader
///   watches the last writer ahead, a writer its predecessor, and permits
///   every entry ahead; a client naming another limit than the entries
///   there gets a typed error and leaves no entry.
///
/// With a fixed lease, the lock gets a lease of its own (etcd counts leases
/// in whole seconds, rounded up; the guard still reports lost at the lease
/// asked for).
///
/// # Connection state
///
/// [`Locker::state`](dlock_core::Locker::state) follows the session
/// leases: `Suspended` when a keepalive goes unanswered (the guards on
/// the lease say they are unsure), `Lost` when a lease with guards on it
/// expires (the cluster says so, or a whole TTL passed without an
/// answer), `Reconnected` at the next answered keepalive, or when a new
/// lease is granted after a lost one.
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
    /// With `etcdctl`, one acquisition of an entry name (a key on one
    /// session's lease) at a time in this backend: two on one session
    /// would name one etcd key. By name, not by key: a guard lost with
    /// its session, but not yet dropped, keeps only its old name's turn;
    /// one whose fixed lease ended keeps none (see [`TurnUntil`]).
    turns: dlock_core::backend::LocalTurns<String>,
    /// Fed by every session: see "Connection state" above.
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
    /// With `layout=etcdctl`, this backend's turn at the entry name, given back
    /// when the entry is gone and no request that may create it is in
    /// flight (the enqueueing task keeps a share).
    turn: Option<Turn>,
    /// With `layout=etcdctl`, a fixed-lease grant's turn, from `turn`,
    /// given back when its lease ends even if the guard lives on.
    turn_until: Option<TurnUntil>,
}

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

/// A transaction that puts `value` at `name` with `options` only while the
/// key is the one created at `revision` (ours, granted then): a key lost
/// meanwhile is never recreated, nor another's written.
fn put_if_created(
    name: &str,
    revision: i64,
    value: impl Into<Vec<u8>>,
    options: etcd_client::PutOptions,
) -> etcd_client::Txn {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    Txn::new()
        .when([Compare::create_revision(name, CompareOp::Equal, revision)])
        .and_then([TxnOp::put(name, value, Some(options))])
}

/// gRPC's `UNAVAILABLE`: the request reached no live member.
const GRPC_UNAVAILABLE: i32 = 14;

/// Whether `e` says the request reached no live member (a member just died
/// or is being balanced away from): worth sending again, to another one.
fn is_unavailable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => i32::from(status.code()) == GRPC_UNAVAILABLE,
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// Runs an idempotent request, sending it again a few times while no live
/// member was reached.
async fn retried<T, F, Fut>(mut request: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(300));
    for _ in 0..4 {
        match request().await {
            Err(e) if is_unavailable(&e) => {
                tokio::time::sleep(backoff.next_delay()).await;
            }
            other => return other.map_err(backend_error),
        }
    }
    request().await.map_err(backend_error)
}

/// The queue of `key` in `mode`: a plain lock's at `{prefix}/{key}/`, a
/// read-write lock's at `{prefix}/{key}%rw/` and a semaphore's at
/// `{prefix}/{key}%sem/` (an escaped key has `%` only before two hex
/// digits, so the three never meet, nor another key's).
fn queue_of(prefix: &str, key: &LockKey, mode: Mode) -> String {
    let kind = match mode {
        Mode::Read | Mode::Write => "%rw",
        Mode::Permits { .. } => "%sem",
        _ => "",
    };
    format!("{prefix}/{}{kind}/", escape(key))
}

/// What a queue entry's value says it takes: empty for a plain lock.
fn mode_value(mode: Mode) -> String {
    mode.tag()
}

/// What a queue entry's value says it takes: the tag before the value's
/// first NUL (see [`proclaimed`]).
fn mode_of(value: &[u8]) -> Option<Mode> {
    let tag = value.split(|&b| b == 0).next().unwrap_or_default();
    Mode::from_tag(std::str::from_utf8(tag).ok()?)
}

impl EtcdBackend {
    fn client(&self) -> Client {
        self.inner.client.clone()
    }

    fn owned(&self) -> MutexGuard<'_, HashMap<Token, Owned>> {
        self.inner.owned.lock().unwrap_or_else(|e| e.into_inner())
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
    fn direct<'k>(&self, queue: &str, mode: Mode, kvs: &'k [KeyValue]) -> Vec<&'k KeyValue> {
        let nested = |kv: &&KeyValue| {
            kv.key()
                .get(queue.len()..)
                .is_none_or(|rest| rest.contains(&b'/'))
        };
        if self.go_layout(mode) {
            kvs.iter().filter(|kv| !nested(kv)).collect()
        } else {
            kvs.iter().collect()
        }
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

    /// Where `key`'s entries in `mode` queue: dlock's layout under the
    /// prefix, or for a plain lock with `layout=etcdctl`, `{key}/` as
    /// `etcdctl lock` names it.
    fn queue(&self, key: &LockKey, mode: Mode) -> String {
        if self.go_layout(mode) {
            format!("{}/", key.as_str())
        } else {
            queue_of(&self.inner.prefix, key, mode)
        }
    }

    /// The name of our entry in `queue` on `lease`: with the etcdctl
    /// layout, the lease alone in hex, as Go's `concurrency.Mutex` writes
    /// it (one entry per session and key: see [`Inner::turns`]).
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
        self.acquire_inner(&req).await
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
        // turn at the name) goes: an acquisition that takes the turn
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
        let lease = if owned.on_own_lease {
            owned.own_lease
        } else {
            if let Some(own) = owned.own_lease {
                self.revoke_in_background(own);
            }
            Some(owned.session.lease)
        };
        if let Some(lease) = lease {
            self.revoke_in_background(lease);
        }
    }

    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        // Locks live on leases etcd keeps (the session's keepalive, or a
        // fixed lease); renewing one means confirming its key still exists.
        let names: Vec<Option<(String, Option<i64>)>> = {
            let owned = self.owned();
            locks
                .iter()
                .map(|r| owned.get(&r.token).map(|o| (o.name.clone(), o.created)))
                .collect()
        };
        let mut outcomes = Vec::with_capacity(locks.len());
        for name in names {
            let Some((name, created)) = name else {
                outcomes.push(RenewOutcome::NotHeld);
                continue;
            };
            let found = self
                .client()
                .get(name, Some(GetOptions::new().with_keys_only()))
                .await
                .map_err(backend_error)?;
            // Ours only if created when we made it: with
            // `layout=etcdctl`, a later acquisition may use the name.
            let ours = found
                .kvs()
                .first()
                .is_some_and(|kv| created.is_none_or(|revision| kv.create_revision() == revision));
            outcomes.push(if ours {
                RenewOutcome::Renewed
            } else {
                RenewOutcome::NotHeld
            });
        }
        Ok(outcomes)
    }

    /// One transaction: if our key still has the revision it was granted
    /// with (it was first then, and no key can be created before it
    /// since, so it holds), its value is rewritten, on the lease it has.
    /// Only the client that took the lock knows its key.
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        self.proclaim_inner(key, token, value).await
    }

    /// The queue's first entry: its create revision is the holder's fence.
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        self.holder_inner(key).await
    }

    /// A watch of the key's queue, armed before the read that compares:
    /// any put or delete under it (a grant, a release, a lease that
    /// expired, a proclaim; a waiter joining wakes it for nothing).
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        self.holder_changed_inner(key, seen).await
    }

    fn connection_state(&self) -> tokio::sync::watch::Receiver<dlock_core::ConnectionState> {
        self.inner.states.subscribe()
    }

    /// The admitted entries of the semaphore's queue, in one read.
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        self.permits_taken_inner(key, limit).await
    }

    /// A new etcd lease for the key, in a transaction that checks the
    /// key's create revision; the old lease is revoked.
    async fn extend(
        &self,
        _key: &LockKey,
        _mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(tokio::time::Instant, Duration)>> {
        self.extend_inner(token, lease).await
    }

    /// Deletes the holder's key (only the key read, by its create
    /// revision): the next in line, who watches it, takes the lock. A
    /// holder under the watchdog learns at its session's next check,
    /// within a third of the lease's TTL; a holder with a fixed lease
    /// only when that lease ends.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.force_release_inner(key).await
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
