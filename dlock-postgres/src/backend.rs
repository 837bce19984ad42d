//! `PgBackend`: the `Backend` trait over PostgreSQL's session-level
//! advisory locks, as a dialect of `dlock-sql`.

use dlock_core::{Result, Token};
use dlock_sql::{sqlx, SqlBackend};
use sqlx::postgres::PgConnection;

use crate::config::PgConfig;

mod caller;
mod dialect;

pub use caller::{CallerConnection, ConnLock, TxLock};

/// Flips a read-write lock's identifier away from the plain lock's of the
/// same key, for this process's turns (the server keeps them apart by key
/// space anyway).
pub(super) const READ_WRITE_SALT: i64 = 0x5257;

/// Flips a semaphore's identifier away from the plain lock's and the
/// read-write lock's of the same key.
pub(super) const SEMAPHORE_SALT: i64 = 0x0053_454d;

/// A statement that runs `expr` only on the server session whose process
/// id is parameter `pid`: answers `expr` (`NULL` on another session) and
/// the session's process id.
pub(super) fn on_own_session(pid: &str, expr: &str) -> String {
    format!("SELECT CASE WHEN pg_backend_pid() = {pid} THEN {expr} END, pg_backend_pid()")
}

/// The answer of a statement made by [`on_own_session`] on `session`:
/// `expr`'s value, or [`session_moved`] if it ran on another session.
pub(super) fn own<T>(
    session: &PgSession,
    (value, pid): (Option<T>, i32),
) -> Result<Option<T>, sqlx::Error> {
    session.check(pid)?;
    Ok(value)
}

/// A one-key advisory lock named for `token`, in the space `tag` names.
pub(super) fn token_lock(tag: &str, token: &Token) -> i64 {
    dlock_sql::key_hash(tag, &token.to_string()) as i64
}

/// Matches a granted one-key advisory lock `l` on `key` (an SQL
/// expression); the caller narrows it to a database or a session.
pub(super) fn one_key_lock(l: &str, key: &str) -> String {
    format!(
        "{l}.locktype = 'advisory' AND {l}.granted AND {l}.objsubid = 1 \
         AND {l}.classid::bigint = ({key} >> 32) & 4294967295 \
         AND {l}.objid::bigint = {key} & 4294967295"
    )
}

/// A 64-bit identifier as the two 32-bit keys of the two-key advisory
/// lock functions.
pub(super) fn split(id: i64) -> (i32, i32) {
    ((id >> 32) as i32, id as i32)
}

/// The wait for `lock` on a waiter session, as one prepared statement
/// (the server plans it once per session). A `CASE` runs its branches in
/// order and stops at the first that answers (and the server folds ahead
/// of time only immutable calls, which none of these is), so its steps
/// run one after another, each only if the one before it ran:
/// 1. on the session's own process only (`pid`, the parameter),
///    `lock_timeout` set to `limit` (the parameter, in milliseconds, as
///    text; `0` for none);
/// 2. the wait;
/// 3. once granted, the limit lifted, so that no later statement on the
///    session (the token's `nextval` first) times out;
/// 4. the token from `sequence`.
///
/// Then, outside the subquery that holds the `CASE` (`OFFSET 0` keeps it
/// apart, so its row is made first), how long the server took since it
/// received the statement (µs).
///
/// Nothing is left to run between the grant and the answer but the token.
/// A wait that times out fails its statement, which undoes its
/// `set_config`.
///
/// Answers the process id it ran on, the token (`NULL` if it ran on
/// another process), and the server's time.
pub(super) fn wait_statement(lock: &str, limit: &str, pid: &str, sequence: &str) -> String {
    format!(
        "SELECT g.pid, g.fence, \
         (extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000000)::bigint \
         FROM (SELECT pg_backend_pid() AS pid, CASE WHEN pg_backend_pid() IS DISTINCT FROM {pid} THEN NULL \
         WHEN set_config('lock_timeout', {limit}, false) IS NULL THEN NULL \
         WHEN {lock}::text IS NULL THEN NULL \
         WHEN set_config('lock_timeout', '0', false) IS NULL THEN NULL \
         ELSE nextval('{sequence}') END AS fence OFFSET 0) AS g"
    )
}

/// The entries of semaphore `id` in `queue` numbered up to `number` (SQL
/// expressions), each live while the session that added it (by its
/// process id) holds its entry lock (`pg_locks`), as
/// `QueueEntry::read_rows` reads them.
/// As [`ahead`], with every entry counted as live: no `pg_locks` scan
/// (see `Dialect::enqueue_counts_all_as_live`).
pub(super) fn ahead_all_live(queue: &str, id: &str, number: &str) -> String {
    format!(
        "SELECT q.n, q.mode, q.owner::text, 1::bigint FROM {queue} q \
         WHERE q.lock_id = {id} AND q.n <= {number} ORDER BY q.n"
    )
}

pub(super) fn ahead(queue: &str, id: &str, number: &str) -> String {
    format!(
        "SELECT q.n, q.mode, q.owner::text, (EXISTS (SELECT 1 FROM pg_locks l \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
         AND l.database = d.oid AND l.pid = q.pid \
         AND l.classid::bigint = (q.owner >> 32) & 4294967295 \
         AND l.objid::bigint = q.owner & 4294967295))::int::bigint \
         FROM {queue} q, (SELECT oid FROM pg_database \
         WHERE datname = current_database()) d \
         WHERE q.lock_id = {id} AND q.n <= {number} ORDER BY q.n"
    )
}

/// SQLSTATE `lock_not_available`: a wait that ran into `lock_timeout`.
pub(super) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// A PostgreSQL lock server: session-level advisory locks.
///
/// Build it with [`PgBackend::connect`](SqlBackend::connect) (or
/// [`from_pool`](SqlBackend::from_pool)) and turn it into a
/// [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker).
///
/// # How it locks
///
/// - **Identifiers.** A key maps to a 64-bit advisory lock identifier,
///   truncated SHA-256 of the URL's `lock_prefix` and the key, so dlock's locks never
///   meet an application's own advisory locks by accident. Two keys whose
///   identifiers collide contend as if they were one: a collision costs a
///   wait, never exclusion.
/// - **A few sessions hold every uncontended lock.** Each key belongs to
///   one of `holder_sessions` holder sessions (4 by default), by its
///   identifier, so that tasks on different keys do not wait for one
///   connection. An acquire is one round trip on the key's holder session: `pg_try_advisory_lock`, and in the same
///   statement the next value of the fencing sequence when it is granted.
///   Release is `pg_advisory_unlock` on the session that holds the lock.
///   One session holds any number of locks (the server's shared lock
///   table bounds them: `max_locks_per_transaction × max_connections`).
/// - **Waiting is done by the server, first come, first served.** An
///   attempt that is refused (or any wait for a key refused in the last
///   second, which skips the try) takes a waiter session (at most
///   `max_waiters`, reused) and blocks in `pg_advisory_lock` there, with
///   the wait limit as `lock_timeout`. The server grants waiters in the
///   order they came, and the waiter session then holds the lock until its
///   release; nothing polls. A wait that is dropped ends its session
///   (`pg_terminate_backend`), so a grant that arrives after the caller
///   left cannot outlive it; only if the server's system identifier and
///   the session's start match those read when it opened, in the same
///   statement, so that a kill that reaches another server (a failover,
///   a virtual IP) never ends another client's session of the same
///   process id.
/// - **Within one process**, tasks that lock the same key queue locally
///   first: a session's advisory locks are reentrant on the server, and two
///   scopes must never both hold a key through one session.
/// - **Crashes and pauses.** A killed holder's connection closes and its
///   locks go at once. A paused one's sessions are ended by the server
///   after `session_timeout` idle (`idle_session_timeout`, PostgreSQL 14
///   and later); dlock keeps every session busy with one ping per third of
///   it (any statement counts), and counts each guard's lease from the
///   last statement its session answered, so a guard reports lost before
///   the server can grant its lock to another client.
/// - **Fencing tokens** come from one sequence, `{lock_prefix}_fence`,
///   created at connect if missing: they increase across all keys, so per
///   key too. A waiter's token is taken right after its grant, on the
///   session that holds it.
/// - **One server session per connection.** Every statement that takes or
///   gives back a lock, and every ping, runs only on the server process
///   the session opened (`pg_backend_pid()`, checked in the same round
///   trip); on another one it takes nothing, and the session's guards are
///   lost. `connect` refuses a pooler that moves statements between
///   sessions
///   ([`LockError::UnsafeDeployment`](dlock_core::LockError::UnsafeDeployment)):
///   connect directly, or through PgBouncer in `pool_mode = session`.
/// - **Fixed leases**: the lock is released when the lease ends, by this
///   process; if the process dies first, its connection closes.
/// - **Read-write locks** are shared and exclusive advisory locks in the
///   two-key space. **Semaphores** live in the queue table
///   `{lock_prefix}_queue` (created at connect if missing): each permit
///   entry is live while its owner's session holds the entry's advisory
///   lock (read from `pg_locks`), admitted first come, first served, and
///   numbered by the table's identity, which is its fencing token. A
///   permit waiter blocks on the oldest entry's lock ahead and reads the
///   queue again at least every 100 ms (see the README's "The queue
///   table").
///
/// # Examples
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_postgres::PgBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = PgBackend::connect("postgres://app@127.0.0.1:5432/app")
///     .await?
///     .into_locker();
/// let guard = locker.lock("report:daily").await?;
/// println!("fence {:?}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
///
/// A pool's connect options make one too:
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_postgres::{sqlx::PgPool, PgBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = PgPool::connect("postgres://app@127.0.0.1:5432/app").await?;
/// let locker = PgBackend::from_pool(&pool).await?.into_locker();
/// drop(locker.lock("report:daily").await?);
/// # Ok(())
/// # }
/// ```
pub type PgBackend = SqlBackend<PgDialect>;

/// PostgreSQL's statements, the [`Dialect`](dlock_sql::Dialect) of
/// [`PgBackend`]; its own locks on the caller's transaction and connection
/// ([`lock_in`](PgDialect::lock_in), [`lock_on`](PgDialect::lock_on)) are
/// methods of the backend.
#[derive(Debug)]
pub struct PgDialect {
    config: PgConfig,
    /// What lock identifiers are hashed under: the prefix, and the schema
    /// the tables live in (`current_schema()`, read at setup). Advisory
    /// locks span the database, and the queue and holders' tables are per
    /// schema: two schemas' locks of one key must not meet.
    scope: std::sync::OnceLock<String>,
    /// The fencing sequence by its schema's name, as `regclass` text, for
    /// statements on the caller's connections (see [`caller`]), set at
    /// setup.
    caller_fence: std::sync::OnceLock<String>,
    /// The uncontended acquire: the lock, and the fence when granted.
    try_lock: String,
    /// The same for a reader of a read-write lock (the two-key advisory
    /// lock space, apart from plain locks' one-key space).
    try_read: String,
    /// The same for a reader whose session may hold the lock shared
    /// already: refused while a writer waits.
    try_read_behind_writers: String,
    /// The same for a writer.
    try_write: String,
    /// The wait on a waiter session (see `wait_statement`).
    wait_lock: String,
    /// The same for a reader.
    wait_read: String,
    /// The same for a writer.
    wait_write: String,
    /// Creates the fencing sequence and the semaphores' queue table.
    create: String,
    /// Whether they all exist already: `create` is then skipped, as its
    /// `CREATE INDEX IF NOT EXISTS` takes the table's owner even when
    /// the index exists, and other roles may share the tables.
    created: String,
    /// `{prefix}_queue`.
    queue: String,
    /// The entries of a semaphore up to one, each live while its owner's
    /// session holds its entry lock (`pg_locks`).
    ahead: String,
    /// Deletes a token's entry and releases its entry lock.
    dequeue: String,
    /// Deletes dead entries.
    remove: String,
    /// Deletes every dead entry (its session's entry lock is not held).
    reap: String,
    /// Records a hold and its value, taking its entry lock the first time.
    proclaim: String,
    /// Deletes a hold's record and releases its entry lock.
    disclaim: String,
    /// Whether a plain lock is held, and its holder's record if its
    /// session holds the record's entry lock.
    holder: String,
    /// Ends every other session of this database holding plain lock `$1`.
    end_holder: String,
}

/// A dlock session's connection, and the process id of the server
/// session it opened: every lock statement checks it is still there.
pub type PgSession = dlock_sql::SessionConn<PgConnection, i32>;

#[cfg(test)]
mod tests;
