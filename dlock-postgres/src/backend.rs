//! `PgBackend`: the `Backend` trait over PostgreSQL's session-level
//! advisory locks, as a dialect of `dlock-sql`.

use dlock_core::{backend::Mode, Result, Token};
use dlock_sql::{sqlx, SqlBackend};
use sqlx::{
    postgres::{PgArguments, PgConnection, PgRow},
    query::QueryAs,
    Postgres,
};

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
/// `expr`'s value, or [`Refusal::SessionMoved`](dlock_sql::Refusal::SessionMoved) if it ran on another session.
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

/// The statement of `mode` among `statements` (plain, read, write), with
/// lock `id` bound: one 64-bit key, or a read-write lock's two 32-bit keys
/// (the two-key space); the statement's other parameters follow.
pub(super) fn lock_query<'q, O>(
    statements: &'q [String; 3],
    id: i64,
    mode: Mode,
) -> QueryAs<'q, Postgres, O, PgArguments>
where
    O: for<'r> sqlx::FromRow<'r, PgRow>,
{
    let (hi, lo) = split(id);
    match mode {
        Mode::Read => sqlx::query_as(&statements[1]).bind(hi).bind(lo),
        Mode::Write => sqlx::query_as(&statements[2]).bind(hi).bind(lo),
        _ => sqlx::query_as(&statements[0]).bind(id),
    }
}

/// The wait for `lock` on a waiter session, as one prepared statement. A
/// `CASE` runs its branches in order, each only if the one before ran
/// (the server folds ahead of time only immutable calls, which none of
/// these is): on the session's own process only (parameter `pid`),
/// `lock_timeout` set to `limit` (milliseconds as text, `0` for none);
/// the wait; once granted, the limit lifted, so that no later statement
/// times out; the token from `sequence`. Nothing runs between the grant
/// and the answer but the token, and a wait that times out fails its
/// statement, which undoes its `set_config`.
///
/// Answers the process id it ran on, the token (`NULL` on another
/// process), and the server's time since it received the statement (µs),
/// taken outside the subquery (`OFFSET 0` keeps it apart, so its row is
/// made first).
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

/// The oid of the session's database, for `pg_locks`.
pub(super) const THIS_DATABASE: &str =
    "(SELECT oid FROM pg_database WHERE datname = current_database())";

/// The entries of `id` in `queue` numbered up to `number` (SQL
/// expressions), oldest first, as `QueueEntry::read_rows` reads them: each
/// live while the session that added it holds its entry lock (`pg_locks`),
/// or with `all_live` every one counted live, with no `pg_locks` scan (see
/// `Dialect::enqueue_counts_all_as_live`).
pub(super) fn ahead(queue: &str, id: &str, number: &str, all_live: bool) -> String {
    let live = if all_live {
        "1::bigint".to_owned()
    } else {
        format!(
            "(EXISTS (SELECT 1 FROM pg_locks l WHERE {} AND l.pid = q.pid \
             AND l.database = {THIS_DATABASE}))::int::bigint",
            one_key_lock("l", "q.owner")
        )
    };
    format!(
        "SELECT q.n, q.mode, q.owner::text, {live} FROM {queue} q \
         WHERE q.lock_id = {id} AND q.n <= {number} ORDER BY q.n"
    )
}

/// SQLSTATE `lock_not_available`: a wait that ran into `lock_timeout`.
pub(super) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// A PostgreSQL lock server: session-level advisory locks, through
/// [`PgDialect`]. How it locks (identifiers, holder and waiter sessions,
/// fencing, poolers, the queue table of semaphores) is in
/// [dlock's guide](https://docs.rs/dlock/latest/dlock/guide/backends/index.html#postgresql).
///
/// [`Locker::list`](dlock_core::Locker::list) shows the held locks by
/// their advisory lock ids (the server keeps only a hash of each key), a
/// page at a time on a session that holds no lock. Each page reads the
/// server's whole lock table (`pg_locks`), so list many held locks with
/// the largest page
/// ([`MAX_LIST_PAGE`](dlock_core::backend::MAX_LIST_PAGE)).
///
/// Build it with [`PgBackend::connect`](SqlBackend::connect) (or
/// [`from_pool`](SqlBackend::from_pool)) and turn it into a
/// [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker).
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
    /// the tables live in (`current_schema()`, read at setup), as advisory
    /// locks span the database and the tables are per schema.
    scope: std::sync::OnceLock<String>,
    /// The fencing sequence by its schema's name, as `regclass` text, for
    /// statements on the caller's connections (see [`caller`]).
    caller_fence: std::sync::OnceLock<String>,
    /// Each per mode, as [`lock_query`] takes them: the uncontended
    /// attempt and its fence; the wait on a waiter session (see
    /// [`wait_statement`]); the unlock.
    try_lock: [String; 3],
    wait: [String; 3],
    unlock: [String; 3],
    /// A read attempt refused while a writer waits.
    try_read_behind_writers: String,
    /// Creates the fencing sequence and the tables, unless `created` finds
    /// them all (its `CREATE INDEX IF NOT EXISTS` takes the table's owner
    /// even when the index exists, and other roles may share the tables).
    create: String,
    created: String,
    /// `{prefix}_queue`, and its statements (see `Dialect`'s methods of
    /// the same names); `reap` deletes every dead entry.
    queue: String,
    ahead: String,
    dequeue: String,
    remove: String,
    reap: String,
    /// The holders' table's statements (see `Dialect`'s methods).
    proclaim: String,
    disclaim: String,
    holder: String,
    end_holder: String,
    /// A page of the held advisory locks (see `Dialect::list`).
    list: String,
}

/// A dlock session's connection, and the process id of the server
/// session it opened: every lock statement checks it is still there.
pub type PgSession = dlock_sql::SessionConn<PgConnection, i32>;

#[cfg(test)]
mod tests;
