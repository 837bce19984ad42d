//! `MySqlBackend`: the `Backend` trait over MySQL's and MariaDB's named
//! locks (`GET_LOCK`), as a dialect of `dlock-sql`.

use std::time::Duration;

use dlock_core::{
    backend::{BoxFuture, Mode},
    LockKey, Result, Token,
};
use dlock_sql::{session_moved, sqlx, Dialect, Granted, QueueEntry, SqlBackend, SqlSettings};
use sqlx::{
    mysql::{MySqlConnection, MySqlDatabaseError},
    Connection, Executor, Row,
};

use crate::config::{lock_name, object_name, FenceSource, MySqlConfig};

/// How long an enqueue waits at most for the key's other enqueues (each
/// one insert long) before it answers busy (and is tried again, within the
/// wait limit): a third of the session timeout, or this if shorter.
const ENQUEUE_TIMEOUT: Duration = Duration::from_secs(10);

/// `GET_LOCK`'s timeout for a wait without limit: a year, after which the
/// wait starts again (MariaDB answers a negative timeout at once).
const FOREVER_SECS: u64 = 365 * 24 * 3600;

/// A MySQL or MariaDB lock server: `GET_LOCK` named locks.
///
/// Build it with [`MySqlBackend::connect`] and turn it into a
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
///   so a grant that arrives after the caller left cannot outlive it.
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
///   out again after a crash (measured: a sequence answered 1 after 13
///   values and a SIGKILL). `fence=off` skips the write, and the token
///   (see [`FenceSource`]).
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
#[derive(Debug, Clone)]
pub struct MySqlBackend(SqlBackend<MySqlDialect>);

dlock_sql::forward_backend!(MySqlBackend);

impl MySqlBackend {
    /// Connects to the server of a `mysql://` URL (see [`MySqlConfig`]):
    /// opens a holder session and creates the fencing counters if they are
    /// missing.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](dlock_core::LockError::InvalidOptions)
    /// for a malformed URL;
    /// [`LockError::Backend`](dlock_core::LockError::Backend) if no session
    /// opens within the connect timeout, the login is refused, the URL
    /// names no database, or the fencing table cannot be created.
    pub async fn connect(url: &str) -> Result<MySqlBackend> {
        Self::connect_with(MySqlConfig::from_url(url)?).await
    }

    /// Connects with the connect options of the application's own pool:
    /// the same server, login and TLS settings, on sessions of dlock's own,
    /// with the same guarantees as [`MySqlBackend::connect`].
    ///
    /// dlock never borrows the pool's connections: a lock lives exactly as
    /// long as the session that holds it, and a pooled connection is lent
    /// to other code, reset and closed when the pool decides. For dlock's
    /// own settings (session timeout, prefix), build a [`MySqlConfig`] with
    /// [`MySqlConfig::from_options`] from `pool.connect_options()` instead.
    ///
    /// # Errors
    ///
    /// As [`MySqlBackend::connect`].
    ///
    /// # Examples
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
    pub async fn from_pool(pool: &sqlx::MySqlPool) -> Result<MySqlBackend> {
        Self::connect_with(MySqlConfig::from_options((*pool.connect_options()).clone())).await
    }

    /// Connects with a prepared [`MySqlConfig`].
    ///
    /// # Errors
    ///
    /// As [`MySqlBackend::connect`].
    pub async fn connect_with(config: MySqlConfig) -> Result<MySqlBackend> {
        SqlBackend::connect(MySqlDialect::new(config))
            .await
            .map(MySqlBackend)
    }
}

impl MySqlDialect {
    fn new(config: MySqlConfig) -> MySqlDialect {
        MySqlDialect {
            wait_timeout: config.session_timeout().as_secs()
                + u64::from(config.session_timeout().subsec_nanos() > 0),
            table: format!("{}_fence", config.lock_prefix()),
            queue: format!("{}_queue", config.lock_prefix()),
            holders: format!("{}_holder", config.lock_prefix()),
            config,
        }
    }
}

/// MySQL's statements.
#[derive(Debug)]
struct MySqlDialect {
    config: MySqlConfig,
    /// The server's idle timeout, whole seconds.
    wait_timeout: u64,
    /// `{prefix}_fence`.
    table: String,
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
    /// One request: `GET_LOCK(name, timeout)` (only on the server session
    /// `session`) then, if granted, the token from the name's counter row
    /// (`-1` if the row is missing); answers the lock's state (1 granted,
    /// 0 timed out, `NULL` interrupted, -1 on another session), the
    /// token, and the server's time on it in µs. Names are ASCII letters,
    /// digits and `-_.:/%#` only: safe inside quotes.
    fn get_lock(&self, session: i64, name: &str, timeout: &str) -> String {
        let (take, token) = match self.config.fence() {
            FenceSource::Row => (
                format!(
                    "UPDATE {} SET v = LAST_INSERT_ID(v + 1) WHERE shard = {} AND @dlock_g = 1; ",
                    self.table,
                    self.shard(&name.to_owned()) % FENCE_ROWS
                ),
                "IF(@dlock_g = 1, IF(ROW_COUNT() = 1, CAST(LAST_INSERT_ID() AS SIGNED), -1), NULL)",
            ),
            FenceSource::Off => (String::new(), "0"),
        };
        format!(
            "SET @dlock_t = SYSDATE(6); \
             SET @dlock_g = IF(CONNECTION_ID() = {session}, GET_LOCK('{name}', {timeout}), -1); \
             {take}\
             SELECT @dlock_g, {token}, TIMESTAMPDIFF(MICROSECOND, @dlock_t, SYSDATE(6)), \
             CAST(CONNECTION_ID() AS SIGNED)"
        )
    }

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
    /// The entries of the key named by `id` numbered up to `number` (SQL
    /// expressions), each live while the session that added it (by its
    /// connection id) holds its entry lock, as `QueueEntry::read_rows`
    /// reads them.
    fn ahead_query(&self, id: &str, number: &str) -> String {
        format!(
            "SELECT n, mode, owner, CAST(COALESCE(IS_USED_LOCK(owner) = session, 0) AS SIGNED) \
             FROM {} WHERE lock_id = {id} AND n <= {number} ORDER BY n",
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

    /// A named lock for `token` in the space `tag` names.
    fn token_lock(&self, tag: char, token: &Token) -> String {
        let prefix = self.config.lock_prefix();
        format!("{}%{tag}:{token}", &prefix[..prefix.len().min(26)])
    }
}

/// Whether a server of `version` (as `VERSION()` answers) holds several
/// named locks per session: MySQL 5.7 and later, MariaDB 10.0.2 and later.
/// On older ones a second `GET_LOCK` silently releases the first, so two
/// owners could hold a lock. A version this cannot read passes (forks
/// that report their own numbers).
fn holds_several_locks(version: &str) -> Result<(), String> {
    // MariaDB may report `5.5.5-10.x.y-MariaDB` for old replication.
    let version = version.strip_prefix("5.5.5-").unwrap_or(version);
    let numbers: Vec<u32> = version
        .split(|c: char| !c.is_ascii_digit())
        .take(3)
        .map_while(|n| n.parse().ok())
        .collect();
    let [major, minor, patch] = numbers[..] else {
        return Ok(());
    };
    let (least, server) = if version.contains("MariaDB") {
        ((10, 0, 2), "MariaDB")
    } else {
        ((5, 7, 0), "MySQL")
    };
    if (major, minor, patch) >= least {
        Ok(())
    } else {
        Err(format!(
            "{server} {major}.{minor}.{patch} holds one named lock per session (a second \
             GET_LOCK releases the first), so two owners could hold a lock: dlock needs \
             MySQL 5.7 or later, or MariaDB 10.0.2 or later"
        ))
    }
}

/// A statement that runs `expr` (an integer, its parameters after the
/// first) only on the server session whose connection id is the first
/// parameter: answers `expr` (-1 on another session) and the session's
/// connection id, for [`MySqlSession::check`].
fn on_own_session(expr: &str) -> String {
    format!("SELECT IF(CONNECTION_ID() = ?, {expr}, -1), CAST(CONNECTION_ID() AS SIGNED)")
}

/// A dlock session's connection, and the connection id of the server
/// session it opened: every lock statement checks it is still there.
struct MySqlSession {
    conn: MySqlConnection,
    id: i64,
}

impl MySqlSession {
    /// [`session_moved`] unless `id` is this session's.
    fn check(&self, id: i64) -> Result<(), sqlx::Error> {
        if id == self.id {
            Ok(())
        } else {
            Err(session_moved(self.id as u64, id as u64))
        }
    }
}

impl Dialect for MySqlDialect {
    type Conn = MySqlSession;
    type Id = String;

    const NAME: &'static str = "mysql";

    fn settings(&self) -> &SqlSettings {
        self.config.settings()
    }

    fn fences(&self) -> bool {
        self.config.fence() == FenceSource::Row
    }

    fn lock_id(&self, key: &LockKey, mode: Mode) -> String {
        let prefix = self.config.lock_prefix();
        match mode {
            Mode::Exclusive => lock_name(prefix, key),
            Mode::Permits { .. } => object_name(prefix, "%sem:", key),
            _ => object_name(prefix, "%rw:", key),
        }
    }

    fn supports(&self, _mode: Mode) -> bool {
        true
    }

    /// Read-write locks and semaphores: `GET_LOCK` is exclusive only.
    fn queues(&self, mode: Mode) -> bool {
        mode != Mode::Exclusive
    }

    fn enqueue<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<(i64, Vec<QueueEntry>), sqlx::Error>> {
        Box::pin(async move {
            // The names are escaped (the id) or ours (prefix and hex), and
            // the tag is letters, digits and `/`: safe to write inline.
            // The key's name is held until the insert committed, so entry
            // numbers become visible in order; the entries up to the new
            // one are read in the same round trip. With fencing, the
            // number is taken from the queue's counter row first (a
            // committed write), else it is the table's `AUTO_INCREMENT`.
            let entry = self.entry_lock(token);
            let (take, number) = match self.config.fence() {
                FenceSource::Row => (
                    format!(
                        "UPDATE {table} SET v = LAST_INSERT_ID(v + 1) \
                         WHERE shard = {QUEUE_ROW} AND @dlock_e = 1 AND @dlock_q = 1; \
                         SET @dlock_f = IF(ROW_COUNT() = 1, LAST_INSERT_ID(), NULL); ",
                        table = self.table
                    ),
                    "@dlock_f",
                ),
                FenceSource::Off => ("SET @dlock_f = 0; ".to_owned(), "NULL"),
            };
            let request = format!(
                "SET @dlock_e = IF(CONNECTION_ID() = {session}, \
                 IF(IS_USED_LOCK('{entry}') <=> CONNECTION_ID(), 1, GET_LOCK('{entry}', 0)), -1); \
                 SET @dlock_q = GET_LOCK('{id}', {enqueue_timeout:.3}); {take}\
                 INSERT INTO {queue} (n, lock_id, mode, owner, session) \
                 SELECT {number}, '{id}', '{tag}', '{entry}', CONNECTION_ID() \
                 FROM DUAL WHERE @dlock_e = 1 AND @dlock_q = 1 AND @dlock_f IS NOT NULL; \
                 SET @dlock_n = IF(ROW_COUNT() = 1, CAST(LAST_INSERT_ID() AS SIGNED), NULL); \
                 DO RELEASE_LOCK('{id}'); \
                 SELECT @dlock_n, @dlock_e, @dlock_q, CAST(CONNECTION_ID() AS SIGNED), \
                 CAST(@dlock_f AS SIGNED); {ahead}",
                session = conn.id,
                enqueue_timeout = (self.config.session_timeout() / 3)
                    .min(ENQUEUE_TIMEOUT)
                    .as_secs_f64(),
                queue = self.queue,
                tag = mode.tag(),
                ahead = self.ahead_query(&format!("'{id}'"), "@dlock_n"),
            );
            let rows = match conn.conn.fetch_all(request.as_str()).await {
                Ok(rows) => rows,
                // The request stopped at its error, maybe with the key's
                // enqueue lock taken: given back, or every later enqueue
                // of the key would answer busy.
                Err(e @ sqlx::Error::Database(_)) => {
                    let release = format!("DO RELEASE_LOCK('{id}')");
                    conn.conn.execute(release.as_str()).await?;
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            let status = rows.first().ok_or(sqlx::Error::RowNotFound)?;
            conn.check(status.try_get(3)?)?;
            let (taken, queued) = (
                status.try_get::<Option<i64>, _>(1)?,
                status.try_get::<Option<i64>, _>(2)?,
            );
            if taken == Some(1) && queued == Some(1) {
                // The counter row is missing: the entry was not added.
                self.token(status.try_get(4)?)?;
            }
            if taken == Some(1) && queued == Some(0) {
                // The entry lock stays with the session, for the next try
                // (taken once: held already, it is not taken again).
                return Err(dlock_sql::busy(
                    "the key's other enqueues held it up for a third of the session timeout",
                ));
            }
            let Some(number) = status.try_get::<Option<i64>, _>(0)? else {
                return Err(sqlx::Error::Protocol(format!(
                    "no queue entry: entry lock {taken:?}, the key's enqueue lock {queued:?}"
                )));
            };
            let (entries, mine) = QueueEntry::read_rows(&rows[1..], number)?;
            if !mine {
                return Err(sqlx::Error::RowNotFound);
            }
            Ok((number, entries))
        })
    }

    fn ahead<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
        number: i64,
    ) -> BoxFuture<'a, Result<(Vec<QueueEntry>, bool), sqlx::Error>> {
        Box::pin(async move {
            let query = self.ahead_query("?", "?");
            let rows = sqlx::query(&query)
                .bind(id)
                .bind(number)
                .fetch_all(&mut conn.conn)
                .await?;
            QueueEntry::read_rows(&rows, number)
        })
    }

    fn dequeue<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let entry = self.entry_lock(token);
            let request = format!(
                "DELETE FROM {} WHERE owner = '{entry}'; SET @dlock_d = ROW_COUNT(); \
                 DO IF(CONNECTION_ID() = {}, RELEASE_LOCK('{entry}'), NULL); \
                 SELECT CAST(@dlock_d AS SIGNED), CAST(CONNECTION_ID() AS SIGNED)",
                self.queue, conn.id
            );
            let rows = conn.conn.fetch_all(request.as_str()).await?;
            let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
            conn.check(row.try_get(1)?)?;
            Ok(row.try_get::<Option<i64>, _>(0)?.unwrap_or(0) > 0)
        })
    }

    fn remove<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        numbers: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let list: Vec<String> = numbers.iter().map(i64::to_string).collect();
            let request = format!("DELETE FROM {} WHERE n IN ({})", self.queue, list.join(","));
            conn.conn.execute(request.as_str()).await.map(drop)
        })
    }

    fn watch<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        owner: &'a str,
        limit: Option<Duration>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let timeout = match limit {
                Some(limit) => format!("{:.6}", limit.as_secs_f64()),
                None => FOREVER_SECS.to_string(),
            };
            let (got, session): (Option<i64>, i64) =
                sqlx::query_as(&on_own_session(&format!("GET_LOCK(?, {timeout})")))
                    .bind(conn.id)
                    .bind(owner)
                    .fetch_one(&mut conn.conn)
                    .await?;
            conn.check(session)?;
            if got != Some(1) {
                return Ok(false);
            }
            // Its owner left: give it back at once.
            sqlx::query("DO RELEASE_LOCK(?)")
                .bind(owner)
                .execute(&mut conn.conn)
                .await?;
            Ok(true)
        })
    }

    fn shard(&self, id: &String) -> u64 {
        dlock_sql::key_hash("", id)
    }

    fn open(&self) -> BoxFuture<'_, Result<(MySqlSession, u64), sqlx::Error>> {
        Box::pin(async move {
            let mut conn = MySqlConnection::connect_with(self.config.connect_options()).await?;
            let opened = format!(
                "SET SESSION wait_timeout = {}, autocommit = 1; \
                 SELECT CAST(CONNECTION_ID() AS SIGNED)",
                self.wait_timeout.max(1)
            );
            let rows = conn.fetch_all(opened.as_str()).await?;
            let id: i64 = rows.last().ok_or(sqlx::Error::RowNotFound)?.try_get(0)?;
            Ok((MySqlSession { conn, id }, id as u64))
        })
    }

    fn setup<'a>(&'a self, conn: &'a mut MySqlSession) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let version: String = sqlx::query_scalar("SELECT VERSION()")
                .fetch_one(&mut conn.conn)
                .await?;
            if let Err(why) = holds_several_locks(&version) {
                return Err(dlock_sql::unsafe_deployment(why));
            }
            let queue = format!(
                "CREATE TABLE IF NOT EXISTS {} (n BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 lock_id VARCHAR(64) NOT NULL, mode VARCHAR(32) NOT NULL, \
                 owner VARCHAR(64) NOT NULL, session BIGINT NOT NULL, \
                 KEY (lock_id, n), KEY (owner)) ENGINE = InnoDB",
                self.queue
            );
            conn.conn.execute(queue.as_str()).await?;
            // Entries whose sessions ended are deleted by the next enqueue
            // of their key; those of keys nobody locks again, here.
            let reap = format!(
                "DELETE FROM {} WHERE NOT (IS_USED_LOCK(owner) <=> session)",
                self.queue
            );
            conn.conn.execute(reap.as_str()).await?;
            if self.config.fence() == FenceSource::Off {
                // No fencing tokens, so no holders to record: nothing
                // orders them.
                return Ok(());
            }
            let holders = format!(
                "CREATE TABLE IF NOT EXISTS {} (lock_id VARCHAR(64) PRIMARY KEY, \
                 owner VARCHAR(64) NOT NULL, fence BIGINT NOT NULL, \
                 value MEDIUMBLOB NOT NULL) ENGINE = InnoDB",
                self.holders
            );
            conn.conn.execute(holders.as_str()).await?;
            let rows: Vec<String> = (0..=QUEUE_ROW).map(|s| format!("({s}, 0)")).collect();
            let create = format!(
                "CREATE TABLE IF NOT EXISTS {0} (shard SMALLINT PRIMARY KEY, v BIGINT NOT NULL) \
                 ENGINE = InnoDB; INSERT IGNORE INTO {0} (shard, v) VALUES {1}",
                self.table,
                rows.join(", ")
            );
            conn.conn.execute(create.as_str()).await.map(drop)
        })
    }

    fn try_lock<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
        _mode: Mode,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        Box::pin(async move {
            if self.config.fence() == FenceSource::Off {
                let (granted, session): (Option<i64>, i64) =
                    sqlx::query_as(&on_own_session("GET_LOCK(?, 0)"))
                        .bind(conn.id)
                        .bind(id)
                        .fetch_one(&mut conn.conn)
                        .await?;
                conn.check(session)?;
                return Ok((granted == Some(1)).then_some(0));
            }
            let request = self.get_lock(conn.id, id, "0");
            let rows = conn.conn.fetch_all(request.as_str()).await?;
            let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
            conn.check(row.try_get(3)?)?;
            match row.try_get::<Option<i64>, _>(0)? {
                Some(1) => self.token(row.try_get(1)?).map(Some),
                _ => Ok(None),
            }
        })
    }

    fn wait<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
        _mode: Mode,
        limit: Option<Duration>,
    ) -> BoxFuture<'a, Result<Option<Granted>, sqlx::Error>> {
        Box::pin(async move {
            let timeout = match limit {
                Some(limit) => format!("{:.6}", limit.as_secs_f64()),
                None => FOREVER_SECS.to_string(),
            };
            let request = self.get_lock(conn.id, id, &timeout);
            let rows = conn.conn.fetch_all(request.as_str()).await?;
            let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
            conn.check(row.try_get(3)?)?;
            match row.try_get::<Option<i64>, _>(0)? {
                Some(1) => {
                    let took_us: i64 = row.try_get(2)?;
                    Ok(Some(Granted {
                        fence: self.token(row.try_get(1)?)?,
                        took: Duration::from_micros(u64::try_from(took_us).unwrap_or(0)),
                    }))
                }
                // Not granted within the limit: the session is as it was.
                Some(0) => Ok(None),
                // `NULL`: the wait was interrupted (`KILL QUERY`); treated
                // as the end of the session, which gives up whatever it
                // might hold.
                _ => Err(sqlx::Error::Protocol(
                    "GET_LOCK was interrupted on the server".into(),
                )),
            }
        })
    }

    fn unlock<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
        _mode: Mode,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let (released, session): (Option<i64>, i64) =
                sqlx::query_as(&on_own_session("RELEASE_LOCK(?)"))
                    .bind(conn.id)
                    .bind(id)
                    .fetch_one(&mut conn.conn)
                    .await?;
            conn.check(session)?;
            Ok(released == Some(1))
        })
    }

    fn end_session<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        session: u64,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            match conn
                .conn
                .execute(format!("KILL CONNECTION {session}").as_str())
                .await
            {
                Ok(_) => Ok(()),
                // ER_NO_SUCH_THREAD: it ended already.
                Err(sqlx::Error::Database(e))
                    if e.try_downcast_ref::<MySqlDatabaseError>()
                        .is_some_and(|e| e.number() == 1094) =>
                {
                    Ok(())
                }
                Err(e) => Err(e),
            }
        })
    }

    fn ping<'a>(&'a self, conn: &'a mut MySqlSession) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let session: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
                .fetch_one(&mut conn.conn)
                .await?;
            conn.check(session)
        })
    }

    fn records_holders(&self) -> bool {
        true
    }

    fn proclaim<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
        token: &'a Token,
        fence: i64,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let owner = self.holder_lock(token);
            // Taken once: a second GET_LOCK of a name this session holds
            // would stack, and the release gives it back once.
            let (taken, session): (Option<i64>, i64) = sqlx::query_as(
                "SELECT IF(CONNECTION_ID() <> ?, -1, \
                 IF(IS_USED_LOCK(?) <=> CONNECTION_ID(), 1, GET_LOCK(?, 0))), \
                 CAST(CONNECTION_ID() AS SIGNED)",
            )
            .bind(conn.id)
            .bind(&owner)
            .bind(&owner)
            .fetch_one(&mut conn.conn)
            .await?;
            conn.check(session)?;
            if taken != Some(1) {
                // Another session holds the entry lock: never, short of a
                // name reused.
                return Err(sqlx::Error::RowNotFound);
            }
            let upsert = format!(
                "INSERT INTO {} (lock_id, owner, fence, value) VALUES (?, ?, ?, ?) \
                 ON DUPLICATE KEY UPDATE owner = VALUES(owner), fence = VALUES(fence), \
                 value = VALUES(value)",
                self.holders
            );
            sqlx::query(upsert.as_str())
                .bind(id)
                .bind(&owner)
                .bind(fence)
                .bind(value)
                .execute(&mut conn.conn)
                .await
                .map(drop)
        })
    }

    fn disclaim<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let owner = self.holder_lock(token);
            let delete = format!(
                "DELETE FROM {} WHERE lock_id = ? AND owner = ?",
                self.holders
            );
            sqlx::query(delete.as_str())
                .bind(id)
                .bind(&owner)
                .execute(&mut conn.conn)
                .await?;
            let (_, session): (Option<i64>, i64) =
                sqlx::query_as(&on_own_session("RELEASE_LOCK(?)"))
                    .bind(conn.id)
                    .bind(&owner)
                    .fetch_one(&mut conn.conn)
                    .await?;
            conn.check(session)
        })
    }

    fn holder<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
    ) -> BoxFuture<'a, Result<Option<(Option<i64>, Option<Vec<u8>>)>, sqlx::Error>> {
        Box::pin(async move {
            let read = format!(
                "SELECT CAST(IS_USED_LOCK(?) AS SIGNED), h.fence, h.value, \
                 CAST(IS_USED_LOCK(h.owner) AS SIGNED) \
                 FROM (SELECT 1) x LEFT JOIN {} h ON h.lock_id = ?",
                self.holders
            );
            let row = sqlx::query(read.as_str())
                .bind(id)
                .bind(id)
                .fetch_one(&mut conn.conn)
                .await?;
            let Some(session) = row.try_get::<Option<i64>, _>(0)? else {
                return Ok(None);
            };
            let recorder: Option<i64> = row.try_get(3)?;
            if recorder != Some(session) {
                return Ok(Some((None, None)));
            }
            Ok(Some((row.try_get(1)?, row.try_get(2)?)))
        })
    }

    /// The connection failed, or the server ended the session: SQLSTATE
    /// class 08, `70100` (killed), or errors 1053 (shutdown), 1927
    /// (connection killed) and 4031 (idle timeout, MySQL 8).
    fn ends_the_session(&self, e: &sqlx::Error) -> bool {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(e) => {
                e.code()
                    .is_some_and(|code| code.starts_with("08") || code == "70100")
                    || e.try_downcast_ref::<MySqlDatabaseError>()
                        .is_some_and(|e| matches!(e.number(), 1053 | 1927 | 4031))
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_testkit::fixture::MariaDbServer;

    #[test]
    fn servers_that_hold_one_lock_per_session_are_refused() {
        for ok in [
            "5.7.0",
            "8.0.36",
            "8.4.0-log",
            "10.0.2-MariaDB",
            "10.11.6-MariaDB-0+deb12u1",
            "5.5.5-10.6.16-MariaDB",
            "unknown",
        ] {
            assert_eq!(holds_several_locks(ok), Ok(()), "{ok}");
        }
        for refused in [
            "5.6.51",
            "5.5.62-log",
            "10.0.1-MariaDB",
            "5.5.5-10.0.1-MariaDB",
        ] {
            let why = holds_several_locks(refused).unwrap_err();
            assert!(
                why.contains("one named lock per session"),
                "{refused}: {why}"
            );
        }
    }

    /// With the session's recorded connection id changed, as if a proxy
    /// had moved the connection to another server session, the ping and
    /// every statement that takes or gives back a lock answer
    /// `SessionMoved`, and take nothing: no named lock, no queue entry, no
    /// fencing token, no holder record.
    #[tokio::test]
    async fn statements_off_their_session_take_nothing() {
        let server = MariaDbServer::start().expect("start MariaDB");
        let dialect = MySqlDialect::new(MySqlConfig::from_url(&server.url()).unwrap());
        let (mut session, _) = dialect.open().await.expect("open a session");
        dialect.setup(&mut session).await.expect("set up");
        let key = LockKey::new("moved").unwrap();
        let (plain, queued) = (
            dialect.lock_id(&key, Mode::Exclusive),
            dialect.lock_id(&key, Mode::Write),
        );
        let token = Token::generate();
        session.id += 1;
        let moved = |what: &str, e: sqlx::Error| {
            assert!(dlock_sql::is_session_moved(&e), "{what}: {e}");
        };
        moved("ping", dialect.ping(&mut session).await.unwrap_err());
        let e = dialect
            .try_lock(&mut session, &plain, Mode::Exclusive)
            .await;
        moved("try_lock", e.unwrap_err());
        let limit = Some(Duration::from_millis(10));
        let e = dialect
            .wait(&mut session, &plain, Mode::Exclusive, limit)
            .await;
        moved("wait", e.unwrap_err());
        let e = dialect
            .enqueue(&mut session, &queued, Mode::Write, &token)
            .await;
        moved("enqueue", e.unwrap_err());
        let e = dialect
            .proclaim(&mut session, &plain, &token, 1, b"v")
            .await;
        moved("proclaim", e.unwrap_err());
        let e = dialect.unlock(&mut session, &plain, Mode::Exclusive).await;
        moved("unlock", e.unwrap_err());
        let e = dialect.dequeue(&mut session, &token).await;
        moved("dequeue", e.unwrap_err());
        let e = dialect.disclaim(&mut session, &plain, &token).await;
        moved("disclaim", e.unwrap_err());
        let (used, entries, fences, records): (Option<i64>, i64, i64, i64) =
            sqlx::query_as(&format!(
                "SELECT CAST(IS_USED_LOCK(?) AS SIGNED), (SELECT COUNT(*) FROM {}), \
             (SELECT CAST(SUM(v) AS SIGNED) FROM {}), (SELECT COUNT(*) FROM {})",
                dialect.queue, dialect.table, dialect.holders
            ))
            .bind(&plain)
            .fetch_one(&mut session.conn)
            .await
            .unwrap();
        assert_eq!((used, entries, fences, records), (None, 0, 0, 0));
    }
}
