//! MySQL's and MariaDB's statements, as `dlock-sql`'s [`Dialect`]:
//! opening a session and checking the server, the uncontended attempt and
//! the wait on the server, the queue table of read-write locks and
//! semaphores, the holders' records, and ending sessions.

use std::{sync::atomic::Ordering, time::Duration};

use dlock_core::{backend::Mode, LockError, LockKey, Token};
use dlock_sql::{sqlx, Dialect, Granted, QueueEntry, Refusal, ServerSession, SqlSettings};
use sqlx::{
    mysql::{MySqlConnectOptions, MySqlConnection},
    Connection, Executor, Row,
};

use super::{
    acquire::take_did_not_run, error_number, lock_name_in, lock_timeout, on_own_session,
    version::holds_several_locks, MySqlDialect, MySqlSession, QUEUE_ROW,
};
use crate::config::{object_name, FenceSource, MySqlConfig};

/// How long an enqueue waits at most for the key's other enqueues (each
/// one insert long) before it answers busy (and is tried again, within the
/// wait limit): a third of the session timeout, or this if shorter.
const ENQUEUE_TIMEOUT: Duration = Duration::from_secs(10);

impl Dialect for MySqlDialect {
    type Config = MySqlConfig;
    type Database = sqlx::MySql;
    type Conn = MySqlSession;
    type Id = String;

    const NAME: &'static str = "mysql";

    fn parse_url(url: &str) -> Result<MySqlConfig, LockError> {
        MySqlConfig::from_url(url)
    }

    fn pool_config(options: MySqlConnectOptions) -> MySqlConfig {
        MySqlConfig::from_options(options)
    }

    fn new(config: MySqlConfig) -> MySqlDialect {
        MySqlDialect {
            wait_timeout: config.session_timeout().as_secs()
                + u64::from(config.session_timeout().subsec_nanos() > 0),
            table: format!("{}_fence", config.lock_prefix()),
            take: format!("{}_take_v1", config.lock_prefix()),
            take_call: format!(
                "SELECT {}_take_v1(?, ?, 0, ?), CAST(CONNECTION_ID() AS SIGNED)",
                config.lock_prefix()
            ),
            take_ready: std::sync::atomic::AtomicBool::new(false),
            queue: format!("{}_queue", config.lock_prefix()),
            holders: format!("{}_holder", config.lock_prefix()),
            config,
        }
    }

    fn settings(&self) -> &SqlSettings {
        self.config.settings()
    }

    fn fences(&self) -> bool {
        self.config.fence() == FenceSource::Row
    }

    fn lock_id(&self, key: &LockKey, mode: Mode) -> String {
        let prefix = self.config.lock_prefix();
        match mode {
            Mode::Exclusive => object_name(prefix, "", key),
            Mode::Permits { .. } => object_name(prefix, "%sem:", key),
            _ => object_name(prefix, "%rw:", key),
        }
    }

    /// Read-write locks and semaphores: `GET_LOCK` is exclusive only.
    fn queues(&self, mode: Mode) -> bool {
        mode != Mode::Exclusive
    }

    async fn enqueue(
        &self,
        conn: &mut MySqlSession,
        id: &String,
        mode: Mode,
        token: &Token,
    ) -> Result<(i64, Vec<QueueEntry>), sqlx::Error> {
        // The names are escaped (the id) or ours (prefix and hex), and
        // the tag is letters, digits and `/`: safe to write inline.
        // The key's name is held until the insert committed, so entry
        // numbers become visible in order; the entries up to the new
        // one are read in the same round trip. With fencing, the
        // number is taken from the queue's counter row first (a
        // committed write), else it is the table's `AUTO_INCREMENT`.
        let entry = self.token_lock('e', token);
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
            let why = "the key's other enqueues held it up for a third of the session timeout";
            return Err(Refusal::Busy(why.into()).into());
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
    }

    async fn ahead(
        &self,
        conn: &mut MySqlSession,
        id: &String,
        number: i64,
    ) -> Result<(Vec<QueueEntry>, bool), sqlx::Error> {
        let query = self.ahead_query("?", "?");
        let rows = sqlx::query(&query)
            .bind(id)
            .bind(number)
            .fetch_all(&mut conn.conn)
            .await?;
        QueueEntry::read_rows(&rows, number)
    }

    async fn dequeue(&self, conn: &mut MySqlSession, token: &Token) -> Result<bool, sqlx::Error> {
        let entry = self.token_lock('e', token);
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
    }

    async fn remove(&self, conn: &mut MySqlSession, numbers: &[i64]) -> Result<(), sqlx::Error> {
        let list: Vec<String> = numbers.iter().map(i64::to_string).collect();
        let request = format!("DELETE FROM {} WHERE n IN ({})", self.queue, list.join(","));
        conn.conn.execute(request.as_str()).await.map(drop)
    }

    async fn watch(
        &self,
        conn: &mut MySqlSession,
        owner: &str,
        limit: Option<Duration>,
    ) -> Result<bool, sqlx::Error> {
        let get_lock = format!("GET_LOCK(?, {})", lock_timeout(limit));
        if on_own_session(conn, &get_lock, owner).await? != Some(1) {
            return Ok(false);
        }
        // Its owner left: give it back at once.
        sqlx::query("DO RELEASE_LOCK(?)")
            .bind(owner)
            .execute(&mut conn.conn)
            .await?;
        Ok(true)
    }

    fn shard(&self, id: &String) -> u64 {
        dlock_sql::key_hash("", id)
    }

    /// The session takes a named lock of its own, its marker: whoever
    /// holds it (`IS_USED_LOCK`) on a server is this session, as no
    /// connection id can tell (see [`ServerSession`]).
    async fn open(&self) -> Result<(MySqlSession, ServerSession), sqlx::Error> {
        let mut conn = MySqlConnection::connect_with(self.config.connect_options()).await?;
        // The prefix's characters and a token's: nothing to quote.
        let marker = self.token_lock('s', &Token::generate());
        let opened = format!(
            "SET SESSION wait_timeout = {}, autocommit = 1; \
             SELECT CAST(CONNECTION_ID() AS SIGNED), GET_LOCK('{marker}', 0)",
            self.wait_timeout.max(1)
        );
        let rows = conn.fetch_all(opened.as_str()).await?;
        let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
        let id: i64 = row.try_get(0)?;
        if row.try_get::<Option<i64>, _>(1)? != Some(1) {
            // A fresh random name, held by another session: never.
            return Err(sqlx::Error::Protocol(
                "the session's marker lock was refused".into(),
            ));
        }
        let session = ServerSession {
            id: id as u64,
            incarnation: marker,
        };
        Ok((MySqlSession { conn, id }, session))
    }

    async fn setup(&self, conn: &mut MySqlSession) -> Result<(), sqlx::Error> {
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&mut conn.conn)
            .await?;
        if let Err(why) = holds_several_locks(&version) {
            return Err(Refusal::UnsafeDeployment(why).into());
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
            "DELETE FROM {} WHERE NOT (IS_USED_LOCK({}) <=> session)",
            self.queue,
            lock_name_in("owner")
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
        conn.conn.execute(create.as_str()).await?;
        self.prepare_take(conn).await
    }

    async fn try_lock(
        &self,
        conn: &mut MySqlSession,
        id: &String,
        _mode: Mode,
    ) -> Result<Option<i64>, sqlx::Error> {
        if self.config.fence() == FenceSource::Off {
            let granted = on_own_session(conn, "GET_LOCK(?, 0)", id).await?;
            return Ok((granted == Some(1)).then_some(0));
        }
        if self.take_ready.load(Ordering::Relaxed) {
            match self.take(conn, id).await {
                Err(error) if take_did_not_run(&error) => {
                    // Dropped, or its rights taken, since connect.
                    self.take_ready.store(false, Ordering::Relaxed);
                    tracing::warn!(
                        %error,
                        function = %self.take,
                        "dlock mysql's stored function went away; each lock sends a longer text request"
                    );
                }
                answer => return answer,
            }
        }
        let (_, granted) = self.get_lock(conn, id, "0", false).await?;
        Ok(granted.map(|g| g.fence))
    }

    async fn wait(
        &self,
        conn: &mut MySqlSession,
        id: &String,
        _mode: Mode,
        limit: Option<Duration>,
    ) -> Result<Option<Granted>, sqlx::Error> {
        match self.get_lock(conn, id, &lock_timeout(limit), true).await? {
            (_, Some(granted)) => Ok(Some(granted)),
            // Not granted within the limit: the session is as it was.
            (Some(0), None) => Ok(None),
            // `NULL`: the wait was interrupted (`KILL QUERY`); treated
            // as the end of the session, which gives up whatever it
            // might hold.
            _ => Err(sqlx::Error::Protocol(
                "GET_LOCK was interrupted on the server".into(),
            )),
        }
    }

    async fn unlock(
        &self,
        conn: &mut MySqlSession,
        id: &String,
        _mode: Mode,
    ) -> Result<bool, sqlx::Error> {
        Ok(on_own_session(conn, "RELEASE_LOCK(?)", id).await? == Some(1))
    }

    async fn end_session(
        &self,
        conn: &mut MySqlSession,
        session: &ServerSession,
    ) -> Result<(), sqlx::Error> {
        // Only the session that holds its marker lock: a connection of
        // the same id on another server (ids start from 1 on each, and
        // after a restart) holds none. `KILL` takes no condition, so
        // the check is a statement before it, on the same connection,
        // so on the same server, which never gives an id to two
        // connections in its life: the id still names the session
        // checked, or none (ER_NO_SUCH_THREAD below).
        let marked: Option<i64> = sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS SIGNED)")
            .bind(&session.incarnation)
            .fetch_one(&mut conn.conn)
            .await?;
        if marked != Some(session.id as i64) {
            return Ok(());
        }
        match conn
            .conn
            .execute(format!("KILL CONNECTION {}", session.id).as_str())
            .await
        {
            Ok(_) => Ok(()),
            // ER_NO_SUCH_THREAD: it ended already.
            Err(e) if error_number(&e) == Some(1094) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn ping(&self, conn: &mut MySqlSession) -> Result<(), sqlx::Error> {
        let session: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
            .fetch_one(&mut conn.conn)
            .await?;
        conn.check(session)
    }

    async fn proclaim(
        &self,
        conn: &mut MySqlSession,
        id: &String,
        token: &Token,
        fence: i64,
        value: &[u8],
    ) -> Result<(), sqlx::Error> {
        let owner = self.token_lock('h', token);
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
    }

    async fn disclaim(
        &self,
        conn: &mut MySqlSession,
        id: &String,
        token: &Token,
    ) -> Result<(), sqlx::Error> {
        let owner = self.token_lock('h', token);
        let delete = format!(
            "DELETE FROM {} WHERE lock_id = ? AND owner = ?",
            self.holders
        );
        sqlx::query(delete.as_str())
            .bind(id)
            .bind(&owner)
            .execute(&mut conn.conn)
            .await?;
        on_own_session(conn, "RELEASE_LOCK(?)", &owner)
            .await
            .map(drop)
    }

    /// Refused: a `GET_LOCK` name keeps a key only up to 64 characters
    /// (a longer one ends in a hash), and the server lists held names
    /// only through `performance_schema`, off by default on MariaDB.
    fn list_refused(&self, _prefix: &str) -> Option<&'static str> {
        Some(
            "listing of held locks (GET_LOCK names keep only 64 characters of a key, and the \
             server lists them only through performance_schema, off by default on MariaDB)",
        )
    }

    /// The connection that holds the named lock (`IS_USED_LOCK`), unless
    /// it is this one, killed (`KILL CONNECTION`), in one request on one
    /// server session. `KILL` takes no condition: a holder that lets go
    /// in between is ended all the same, as if the operator came earlier.
    async fn end_holder(
        &self,
        session: &mut MySqlSession,
        id: &String,
    ) -> Result<bool, sqlx::Error> {
        // A text request (two statements, so no parameters): the name
        // as the hex of its bytes, read as the connection's character
        // set reads a bound name. Id 0 is no connection's.
        let name: String = id.bytes().map(|b| format!("{b:02X}")).collect();
        let end = format!(
            "SET @dlock_end = (SELECT IF(h <=> CONNECTION_ID() OR CONNECTION_ID() <> {own}, \
             0, IFNULL(h, 0)) FROM (SELECT IS_USED_LOCK(CONVERT(X'{name}' USING utf8mb4)) \
             AS h) AS holder); KILL CONNECTION @dlock_end",
            own = session.id,
        );
        match sqlx::Executor::execute(&mut session.conn, end.as_str()).await {
            Ok(_) => Ok(true),
            // ER_NO_SUCH_THREAD: no holder, or it ended meanwhile.
            Err(e) if error_number(&e) == Some(1094) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn holder(
        &self,
        conn: &mut MySqlSession,
        id: &String,
    ) -> Result<Option<(Option<i64>, Option<Vec<u8>>)>, sqlx::Error> {
        let read = format!(
            "SELECT CAST(IS_USED_LOCK(?) AS SIGNED), h.fence, h.value, \
             CAST(IS_USED_LOCK({}) AS SIGNED) \
             FROM (SELECT 1) x LEFT JOIN {} h ON h.lock_id = ?",
            lock_name_in("h.owner"),
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
    }

    /// `ER_KILL_DENIED_ERROR` (1095) from `KILL CONNECTION`, or
    /// `ER_SPECIFIC_ACCESS_DENIED_ERROR` (1227).
    fn missing_right(&self, e: &sqlx::Error) -> Option<&'static str> {
        matches!(error_number(e), Some(1095 | 1227)).then_some(
            "the holder's user, or `CONNECTION ADMIN` (MariaDB) / `CONNECTION_ADMIN` \
             (MySQL) or `SUPER`",
        )
    }

    /// The connection failed, or the server ended the session: SQLSTATE
    /// class 08, `70100` (killed), or errors 1053 (shutdown), 1927
    /// (connection killed) and 4031 (idle timeout, MySQL 8).
    fn ends_the_session(&self, e: &sqlx::Error) -> bool {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(d) => {
                d.code()
                    .is_some_and(|code| code.starts_with("08") || code == "70100")
                    || matches!(error_number(e), Some(1053 | 1927 | 4031))
            }
            _ => false,
        }
    }
}
