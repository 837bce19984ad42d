//! `PgBackend`: the `Backend` trait over PostgreSQL's session-level
//! advisory locks, as a dialect of `dlock-sql`.

use dlock_core::{Result, Token};
use dlock_sql::{session_moved, sqlx, SqlBackend};
use sqlx::postgres::PgConnection;

use crate::config::PgConfig;

mod caller;
mod dialect;

pub use caller::{CallerConnection, ConnLock, TxLock};

/// Flips a read-write lock's identifier away from the plain lock's of the
/// same key, for this process's turns (the server keeps them apart by key
/// space anyway).
const READ_WRITE_SALT: i64 = 0x5257;

/// Flips a semaphore's identifier away from the plain lock's and the
/// read-write lock's of the same key.
const SEMAPHORE_SALT: i64 = 0x0053_454d;

/// A statement that runs `expr` only on the server session whose process
/// id is parameter `pid`: answers `expr` (`NULL` on another session) and
/// the session's process id.
fn on_own_session(pid: &str, expr: &str) -> String {
    format!("SELECT CASE WHEN pg_backend_pid() = {pid} THEN {expr} END, pg_backend_pid()")
}

/// The answer of a statement made by [`on_own_session`] on `session`:
/// `expr`'s value, or [`session_moved`] if it ran on another session.
fn own<T>(session: &PgSession, (value, pid): (Option<T>, i32)) -> Result<Option<T>, sqlx::Error> {
    session.check(pid)?;
    Ok(value)
}

/// A one-key advisory lock named for `token`, in the space `tag` names.
fn token_lock(tag: &str, token: &Token) -> i64 {
    dlock_sql::key_hash(tag, &token.to_string()) as i64
}

/// Matches a granted one-key advisory lock `l` on `key` (an SQL
/// expression); the caller narrows it to a database or a session.
fn one_key_lock(l: &str, key: &str) -> String {
    format!(
        "{l}.locktype = 'advisory' AND {l}.granted AND {l}.objsubid = 1 \
         AND {l}.classid::bigint = ({key} >> 32) & 4294967295 \
         AND {l}.objid::bigint = {key} & 4294967295"
    )
}

/// A 64-bit identifier as the two 32-bit keys of the two-key advisory
/// lock functions.
fn split(id: i64) -> (i32, i32) {
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
/// received the statement (µs). One subquery in place of the three this
/// statement had: measured with `pgbench` on one CPU, about 15 µs less
/// per wait.
///
/// Nothing is left to run between the grant and the answer but the token.
/// A wait that times out fails its statement, which undoes its
/// `set_config`.
///
/// Answers the process id it ran on, the token (`NULL` if it ran on
/// another process), and the server's time.
fn wait_statement(lock: &str, limit: &str, pid: &str, sequence: &str) -> String {
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

fn ahead(queue: &str, id: &str, number: &str) -> String {
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
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// A PostgreSQL lock server: session-level advisory locks.
///
/// Build it with [`PgBackend::connect`] and turn it into a
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
#[derive(Debug, Clone)]
pub struct PgBackend(SqlBackend<PgDialect>);

dlock_sql::forward_backend!(PgBackend);

impl PgBackend {
    /// Connects to the server of a `postgres://` URL (see [`PgConfig`]):
    /// opens a holder session and creates the fencing sequence if it is
    /// missing.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](dlock_core::LockError::InvalidOptions)
    /// for a malformed URL;
    /// [`LockError::Backend`](dlock_core::LockError::Backend) if no session
    /// opens within the connect timeout, the login is refused, or the
    /// sequence cannot be created.
    pub async fn connect(url: &str) -> Result<PgBackend> {
        Self::connect_with(PgConfig::from_url(url)?).await
    }

    /// Connects with the connect options of the application's own pool:
    /// the same server, login and TLS settings, on sessions of dlock's own,
    /// with the same guarantees as [`PgBackend::connect`].
    ///
    /// dlock never borrows the pool's connections: a lock lives exactly as
    /// long as the session that holds it, and a pooled connection is lent
    /// to other code, reset and closed when the pool decides. For dlock's
    /// own settings (session timeout, prefix), build a [`PgConfig`] with
    /// [`PgConfig::from_options`] from `pool.connect_options()` instead.
    ///
    /// # Errors
    ///
    /// As [`PgBackend::connect`].
    ///
    /// # Examples
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
    pub async fn from_pool(pool: &sqlx::PgPool) -> Result<PgBackend> {
        Self::connect_with(PgConfig::from_options((*pool.connect_options()).clone())).await
    }

    /// Connects with a prepared [`PgConfig`].
    ///
    /// # Errors
    ///
    /// As [`PgBackend::connect`].
    pub async fn connect_with(config: PgConfig) -> Result<PgBackend> {
        SqlBackend::connect(PgDialect::new(config))
            .await
            .map(PgBackend)
    }
}

impl PgDialect {
    fn new(config: PgConfig) -> PgDialect {
        let sequence = format!("{}_fence", config.lock_prefix());
        let queue = format!("{}_queue", config.lock_prefix());
        let holders = format!("{}_holder", config.lock_prefix());
        PgDialect {
            try_lock: on_own_session(
                "$2",
                &format!("CASE WHEN pg_try_advisory_lock($1) THEN nextval('{sequence}') END"),
            ),
            try_read: on_own_session(
                "$3",
                &format!(
                    "CASE WHEN pg_try_advisory_lock_shared($1, $2) THEN nextval('{sequence}') END"
                ),
            ),
            try_read_behind_writers: on_own_session(
                "$3",
                &format!(
                    "CASE WHEN EXISTS (SELECT 1 FROM pg_locks w \
                     WHERE w.locktype = 'advisory' AND NOT w.granted \
                     AND w.mode = 'ExclusiveLock' AND w.objsubid = 2 \
                     AND w.database = (SELECT oid FROM pg_database \
                     WHERE datname = current_database()) \
                     AND w.classid::bigint = ($1::bigint & 4294967295) \
                     AND w.objid::bigint = ($2::bigint & 4294967295)) THEN NULL \
                     WHEN pg_try_advisory_lock_shared($1, $2) THEN nextval('{sequence}') END"
                ),
            ),
            try_write: on_own_session(
                "$3",
                &format!("CASE WHEN pg_try_advisory_lock($1, $2) THEN nextval('{sequence}') END"),
            ),
            wait_lock: wait_statement("pg_advisory_lock($1)", "$2", "$3", &sequence),
            wait_read: wait_statement("pg_advisory_lock_shared($1, $2)", "$3", "$4", &sequence),
            wait_write: wait_statement("pg_advisory_lock($1, $2)", "$3", "$4", &sequence),
            create: format!(
                "CREATE SEQUENCE IF NOT EXISTS {sequence}; \
                 CREATE TABLE IF NOT EXISTS {queue} (\
                 n BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                 lock_id BIGINT NOT NULL, mode TEXT NOT NULL, owner BIGINT NOT NULL, \
                 pid INT NOT NULL); \
                 CREATE INDEX IF NOT EXISTS {queue}_lock ON {queue} (lock_id, n); \
                 CREATE TABLE IF NOT EXISTS {holders} (\
                 lock_id BIGINT PRIMARY KEY, owner BIGINT NOT NULL, \
                 fence BIGINT NOT NULL, value BYTEA NOT NULL)"
            ),
            // In `current_schema()`, where `create` makes them and the
            // caller's statements name the sequence, whatever else the
            // search path finds first.
            created: format!(
                "SELECT to_regclass(format('%I.%I', current_schema(), '{sequence}')) IS NOT NULL \
                 AND to_regclass(format('%I.%I', current_schema(), '{queue}_lock')) IS NOT NULL \
                 AND to_regclass(format('%I.%I', current_schema(), '{holders}')) IS NOT NULL"
            ),
            proclaim: format!(
                "WITH i AS (INSERT INTO {holders} (lock_id, owner, fence, value) \
                 SELECT $1, $2, $3, $4 \
                 WHERE CASE WHEN pg_backend_pid() <> $5 THEN false \
                 WHEN EXISTS (SELECT 1 FROM pg_locks e WHERE {mine} \
                 AND e.pid = pg_backend_pid()) THEN true \
                 ELSE pg_try_advisory_lock($2) END \
                 ON CONFLICT (lock_id) DO UPDATE SET owner = EXCLUDED.owner, \
                 fence = EXCLUDED.fence, value = EXCLUDED.value RETURNING 1) \
                 SELECT (SELECT count(*) FROM i), pg_backend_pid()",
                mine = one_key_lock("e", "$2"),
            ),
            disclaim: format!(
                "WITH d AS (DELETE FROM {holders} WHERE lock_id = $1 AND owner = $2) \
                 SELECT CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($2) END, \
                 pg_backend_pid()"
            ),
            end_holder: format!(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(l.pid)) FROM pg_locks l \
                 WHERE {held} AND l.pid <> pg_backend_pid() AND l.database = \
                 (SELECT oid FROM pg_database WHERE datname = current_database())",
                held = one_key_lock("l", "$1"),
            ),
            holder: format!(
                "SELECT h.fence, h.value FROM pg_locks l \
                 LEFT JOIN {holders} h ON h.lock_id = $1 AND EXISTS (\
                 SELECT 1 FROM pg_locks e WHERE {entry} \
                 AND e.database = l.database AND e.pid = l.pid) \
                 WHERE {held} AND l.database = \
                 (SELECT oid FROM pg_database WHERE datname = current_database())",
                entry = one_key_lock("e", "h.owner"),
                held = one_key_lock("l", "$1"),
            ),
            ahead: ahead(&queue, "$1", "$2"),
            dequeue: format!(
                "WITH d AS (DELETE FROM {queue} WHERE owner = $1 RETURNING n) \
                 SELECT EXISTS (SELECT 1 FROM d), \
                 CASE WHEN pg_backend_pid() = $2 THEN pg_advisory_unlock($1) END, \
                 pg_backend_pid()"
            ),
            remove: format!("DELETE FROM {queue} WHERE n = ANY($1)"),
            reap: format!(
                "DELETE FROM {queue} q WHERE NOT EXISTS (SELECT 1 FROM pg_locks l \
                 WHERE {held} AND l.pid = q.pid AND l.database = \
                 (SELECT oid FROM pg_database WHERE datname = current_database()))",
                held = one_key_lock("l", "q.owner"),
            ),
            queue,
            config,
            scope: std::sync::OnceLock::new(),
            caller_fence: std::sync::OnceLock::new(),
        }
    }
}

/// PostgreSQL's statements.
#[derive(Debug)]
struct PgDialect {
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
struct PgSession {
    conn: PgConnection,
    pid: i32,
}

impl PgSession {
    /// [`session_moved`] unless `pid` is this session's.
    fn check(&self, pid: i32) -> Result<(), sqlx::Error> {
        if pid == self.pid {
            Ok(())
        } else {
            Err(session_moved(self.pid as u64, pid as u64))
        }
    }
}

#[cfg(test)]
mod tests;
