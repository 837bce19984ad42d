//! The queue table of read-write locks and semaphores: entries, the
//! entries ahead of one, and the wait on the entry lock of one of them.

use std::time::Duration;

use dlock_core::{
    backend::{BoxFuture, Mode},
    Token,
};
use dlock_sql::{sqlx, QueueEntry};
use sqlx::{Executor, Row};

use super::{lock_name_in, on_own_session, MySqlDialect, MySqlSession, FOREVER_SECS, QUEUE_ROW};
use crate::config::FenceSource;

/// How long an enqueue waits at most for the key's other enqueues (each
/// one insert long) before it answers busy (and is tried again, within the
/// wait limit): a third of the session timeout, or this if shorter.
const ENQUEUE_TIMEOUT: Duration = Duration::from_secs(10);

impl MySqlDialect {
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

    pub(super) fn enqueue_inner<'a>(
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

    pub(super) fn ahead_inner<'a>(
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

    pub(super) fn dequeue_inner<'a>(
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

    pub(super) fn remove_inner<'a>(
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

    pub(super) fn watch_inner<'a>(
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
}
