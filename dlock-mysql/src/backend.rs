//! `MySqlBackend`: the `Backend` trait over MySQL's and MariaDB's named
//! locks (`GET_LOCK`), as a dialect of `dlock-sql`.

use std::time::Duration;

use dlock_core::{Result, Token};
use dlock_sql::{sqlx, SqlBackend};
use sqlx::mysql::MySqlConnection;

use crate::config::MySqlConfig;

mod acquire;
mod dialect;
mod version;

/// `GET_LOCK`'s timeout for a wait of `limit`, in seconds; without limit,
/// a year, after which the wait starts again (MariaDB answers a negative
/// timeout at once).
fn lock_timeout(limit: Option<Duration>) -> String {
    match limit {
        Some(limit) => format!("{:.6}", limit.as_secs_f64()),
        None => (365 * 24 * 3600).to_string(),
    }
}

/// The server's error number of `e`, if it is the server's.
fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(e) => e
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

/// A MySQL or MariaDB lock server: `GET_LOCK` named locks, through
/// [`MySqlDialect`]. How it locks (names, holder and waiter sessions,
/// fencing counter rows, the queue table of read-write locks and
/// semaphores) is in the crate docs and
/// [dlock's guide](https://docs.rs/dlock/latest/dlock/guide/backends/index.html#mysql-and-mariadb).
///
/// Build it with [`MySqlBackend::connect`](SqlBackend::connect) (or
/// [`from_pool`](SqlBackend::from_pool)) and turn it into a
/// [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker).
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

    /// A named lock for `token` in the space `tag` names (`e` a queue
    /// entry's, `h` a proclaimed hold's, `s` a session's marker), under
    /// the first 26 characters of the prefix, within the server's 64.
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
}

/// Runs `expr`, an integer of one parameter, `arg`, only on `conn`'s own
/// server session, checked in the same statement: its value.
async fn on_own_session(
    conn: &mut MySqlSession,
    expr: &str,
    arg: &str,
) -> Result<Option<i64>, sqlx::Error> {
    let statement =
        format!("SELECT IF(CONNECTION_ID() = ?, {expr}, -1), CAST(CONNECTION_ID() AS SIGNED)");
    let (value, session): (Option<i64>, i64) = sqlx::query_as(&statement)
        .bind(conn.id)
        .bind(arg)
        .fetch_one(&mut conn.conn)
        .await?;
    conn.check(session)?;
    Ok(value)
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
