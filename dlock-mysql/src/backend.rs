//! `MySqlBackend`: the `Backend` trait over MySQL's and MariaDB's named
//! locks (`GET_LOCK`), as a dialect of `dlock-sql`.

use dlock_core::{Result, Token};
use dlock_sql::{sqlx, SqlBackend};
use sqlx::mysql::MySqlConnection;

use crate::config::MySqlConfig;

mod acquire;
mod dialect;
mod version;

/// `GET_LOCK`'s timeout for a wait without limit: a year, after which the
/// wait starts again (MariaDB answers a negative timeout at once).
const FOREVER_SECS: u64 = 365 * 24 * 3600;

/// A MySQL or MariaDB lock server: `GET_LOCK` named locks.
///
/// Build it with [`MySqlBackend::connect`](SqlBackend::connect) (or
/// [`from_pool`](SqlBackend::from_pool)) and turn it into a
/// [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker).
///
/// # How it locks
///
/// - **Names.** A key's lock is named `{lock_prefix}:` and the key,
///   escaped to lowercase-safe ASCII (names are compared without case);
///   a name over MySQL's 64 characters ends in a 64-bit hash of the key
///   instead (a collision costs a wait, never exclusion).
/// - **A few sessions hold every uncontended lock** (`holder_sessions`, 4
///   by default, each key always on the same one). An acquire is one round
///   trip: `GET_LOCK(name, 0)` and, in the same request, the fencing token
///   when it is granted. Release is `RELEASE_LOCK` on the session that
///   holds the lock. One session holds any number of locks (MySQL 5.7 and
///   MariaDB 10.0.2 and later).
/// - **Waiting is done by the server, first come, first served.** A
///   refused attempt takes a waiter session (at most `max_waiters`, reused)
///   and blocks in `GET_LOCK` with the wait limit as its timeout; nothing
///   polls. A wait that is dropped ends its session (`KILL CONNECTION`),
///   so a grant that arrives after the caller left cannot outlive it. Each
///   session holds a named lock of its own, a marker (`{lock_prefix}%s:…`),
///   and a session is ended only where its marker is held by that
///   connection id: a kill that reaches another server (a failover, a
///   virtual IP), where ids start from 1 too, ends nothing there.
/// - **Within one process**, tasks that lock the same key queue locally
///   first: a session's named locks are reentrant on the server.
/// - **Crashes and pauses.** A killed holder's connection closes and its
///   locks go at once. A paused one's sessions are ended by the server
///   after `session_timeout` idle (`wait_timeout`, rounded up to whole
///   seconds); dlock keeps every session busy with one ping per third of
///   it, and counts each guard's lease from the last statement its session
///   answered, so a guard reports lost before the server can grant its
///   lock to another client.
/// - **Fencing tokens** come from 64 counter rows in `{lock_prefix}_fence`
///   (created at connect if missing), a key's always from the same one:
///   the grant's request also runs `UPDATE … SET v = LAST_INSERT_ID(v +
///   1)`, so tokens increase per key, and survive a server crash as every
///   committed write does. Not a sequence: MariaDB's sequences give values
///   out again after a crash (seen: a sequence answered 1 after 13
///   values and a SIGKILL). `fence=off` skips the write, and the token
///   (see [`FenceSource`](crate::FenceSource)).
/// - **One prepared statement per attempt.** An attempt that does not
///   wait calls the stored function `{lock_prefix}_take_v1` (made at
///   connect if missing), which runs `GET_LOCK` and the counter's `UPDATE`
///   on the server: one prepared `SELECT` where the text request is three
///   statements (what that saves is in BENCHMARKS.md, "Figures the code's
///   docs cite"). A login that may not make it (`CREATE ROUTINE`;
///   with a binary log, `log_bin_trust_function_creators = 1` too, which
///   MySQL 8 has on by default) or run it (`EXECUTE`), a binary log in
///   `STATEMENT` or `MIXED` format (a replica would replay the call), or a
///   function dropped later, falls back to the text request, with the same
///   counter rows: such clients lock the same keys with the same tokens.
/// - **One server session per connection.** Every statement that takes or
///   gives back a lock, and every ping, runs only on the server session
///   the connection opened (`CONNECTION_ID()`, checked in the same round
///   trip); on another one it takes nothing, and the session's guards are
///   lost. `connect` refuses a pooler that moves statements between
///   sessions
///   ([`LockError::UnsafeDeployment`](dlock_core::LockError::UnsafeDeployment)):
///   connect directly, or through a proxy that keeps each client on
///   one server session.
/// - **Fixed leases**: the lock is released when the lease ends, by this
///   process; if the process dies first, its connection closes.
/// - **Read-write locks and semaphores** live in the queue table
///   `{lock_prefix}_queue` (created at connect if missing), since
///   `GET_LOCK` is exclusive only: each entry is live while its owner's
///   session holds the entry's named lock (`IS_USED_LOCK`), admitted first
///   come, first served, and numbered by `AUTO_INCREMENT`, which is its
///   fencing token. A waiter blocks in `GET_LOCK` on the lock of the last
///   writer ahead (a reader) or the last entry ahead (a writer); a permit
///   waiter on the oldest entry ahead, reading the queue again at least
///   every 100 ms (see the README's "The queue table").
///
/// # Examples
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_mysql::MySqlBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = MySqlBackend::connect("mysql://app:secret@127.0.0.1:3306/app")
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
/// use dlock_mysql::{sqlx::MySqlPool, MySqlBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = MySqlPool::connect("mysql://app@127.0.0.1:3306/app").await?;
/// let locker = MySqlBackend::from_pool(&pool).await?.into_locker();
/// drop(locker.lock("report:daily").await?);
/// # Ok(())
/// # }
/// ```
pub type MySqlBackend = SqlBackend<MySqlDialect>;

/// MySQL's and MariaDB's statements, the [`Dialect`](dlock_sql::Dialect)
/// of [`MySqlBackend`].
#[derive(Debug)]
pub struct MySqlDialect {
    config: MySqlConfig,
    /// The server's idle timeout, whole seconds.
    wait_timeout: u64,
    /// `{prefix}_fence`.
    table: String,
    /// `{prefix}_take_v1`: the stored function that takes a lock and its
    /// token in one prepared statement (see `acquire::TAKE_BODY`).
    take: String,
    /// The call of `take` for an attempt that does not wait.
    take_call: String,
    /// Whether `take` is there and this login may run it: found (or
    /// made) and tried at connect, given up for the text request if a
    /// call finds it gone.
    take_ready: std::sync::atomic::AtomicBool,
    /// `{prefix}_queue`: the entries of read-write locks and semaphores.
    queue: String,
    /// `{prefix}_holder`: the records of proclaimed holds, each its
    /// holder's while that session holds the record's entry lock.
    holders: String,
}

/// How many counter rows the fencing tokens come from: each name always
/// takes its tokens from the same one, so they increase per key, and
/// grants of different keys mostly update different rows.
const FENCE_ROWS: u64 = 64;

/// The counter row that numbers queue entries (read-write locks and
/// semaphores), after the keys' rows: an entry's number is its fencing
/// token, so it comes from a committed counter, never `AUTO_INCREMENT`,
/// which MySQL 5.7 and MariaDB before 10.2.4 reset to `MAX(n) + 1` at a
/// restart, and every version at a `TRUNCATE`: numbers, and fences, would
/// repeat once old entries are gone.
const QUEUE_ROW: u64 = FENCE_ROWS;

impl MySqlDialect {
    /// The token of a granted request, or the error of one whose counter
    /// row is missing (the lock is held then: the caller undoes it).
    fn token(&self, token: Option<i64>) -> Result<i64, sqlx::Error> {
        match token {
            Some(token) if token >= 0 => Ok(token),
            _ => Err(sqlx::Error::Configuration(
                format!(
                    "the fencing counter row of this key is missing from `{}`: \
                     restore the table's rows (never lower their values) and retry",
                    self.table
                )
                .into(),
            )),
        }
    }
}

impl MySqlDialect {
    /// A named lock for `token` in the space `tag` names.
    fn token_lock(&self, tag: char, token: &Token) -> String {
        let prefix = self.config.lock_prefix();
        format!("{}%{tag}:{token}", &prefix[..prefix.len().min(26)])
    }

    /// The entries of the key named by `id` numbered up to `number` (SQL
    /// expressions), each live while the session that added it (by its
    /// connection id) holds its entry lock, as `QueueEntry::read_rows`
    /// reads them.
    fn ahead_query(&self, id: &str, number: &str) -> String {
        format!(
            "SELECT n, mode, owner, CAST(COALESCE(IS_USED_LOCK({}) = session, 0) AS SIGNED) \
             FROM {} WHERE lock_id = {id} AND n <= {number} ORDER BY n",
            lock_name_in("owner"),
            self.queue
        )
    }

    /// A queue entry's lock: a named lock for its token, under (the first
    /// 26 characters of) the prefix, within the server's 64.
    fn entry_lock(&self, token: &Token) -> String {
        self.token_lock('e', token)
    }

    /// A proclaimed hold's entry lock, named as a queue entry's is.
    fn holder_lock(&self, token: &Token) -> String {
        self.token_lock('h', token)
    }
}

/// A statement that runs `expr` (an integer, its parameters after the
/// first) only on the server session whose connection id is the first
/// parameter: answers `expr` (-1 on another session) and the session's
/// connection id, for [`MySqlSession::check`].
fn on_own_session(expr: &str) -> String {
    format!("SELECT IF(CONNECTION_ID() = ?, {expr}, -1), CAST(CONNECTION_ID() AS SIGNED)")
}

/// A lock name that one of dlock's tables keeps in `column`, as the
/// server's lock functions (`IS_USED_LOCK`) must be given it. They compare
/// names by their bytes, and a column keeps its text in the table's
/// character set: in a UTF-16 database, `IS_USED_LOCK(owner)` finds a held
/// lock free (seen on MariaDB 10.11), so a live queue entry would be
/// reaped and waiters would pass it. dlock's names are ASCII, whose bytes
/// the connection's character set shares.
fn lock_name_in(column: &str) -> String {
    format!("CONVERT({column} USING ascii)")
}

/// A dlock session's connection, and the connection id of the server
/// session it opened: every lock statement checks it is still there.
pub type MySqlSession = dlock_sql::SessionConn<MySqlConnection, i64>;

#[cfg(test)]
mod tests;
