//! The semaphores' queue table: entries, the entries ahead of one, and
//! the wait on the entry lock of one of them.

use std::time::Duration;

use dlock_core::{
    backend::{BoxFuture, Mode},
    Token,
};
use dlock_sql::{sqlx, QueueEntry};
use sqlx::{Executor, Row};

use super::{token_lock, PgDialect, PgSession, LOCK_NOT_AVAILABLE};

/// The entries of semaphore `id` in `queue` numbered up to `number` (SQL
/// expressions), each live while the session that added it (by its
/// process id) holds its entry lock (`pg_locks`), as
/// `QueueEntry::read_rows` reads them.
/// As [`ahead`], with every entry counted as live: no `pg_locks` scan
/// (see `Dialect::enqueue_counts_all_as_live`).
fn ahead_all_live(queue: &str, id: &str, number: &str) -> String {
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

/// A permit entry's lock: a one-key advisory lock named for its token.
fn entry_lock(token: &Token) -> i64 {
    token_lock("dlock-entry", token)
}

impl PgDialect {
    pub(super) fn enqueue_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<(i64, Vec<QueueEntry>), sqlx::Error>> {
        Box::pin(async move {
            let (owner, queue, pid) = (entry_lock(token), &self.queue, session.pid);
            let mine = format!("currval(pg_get_serial_sequence('{queue}', 'n'))");
            let request = format!(
                "SELECT pg_backend_pid(), pg_advisory_xact_lock({id}); \
                 INSERT INTO {queue} (lock_id, mode, owner, pid) \
                 SELECT {id}, '{tag}', {owner}, pg_backend_pid() \
                 WHERE CASE WHEN pg_backend_pid() = {pid} \
                 THEN pg_try_advisory_lock({owner}) ELSE false END \
                 RETURNING n; {ahead}",
                tag = mode.tag(),
                ahead = ahead_all_live(queue, &id.to_string(), &mine),
            );
            let rows = session.conn.fetch_all(request.as_str()).await?;
            let ran_on: i32 = rows.first().ok_or(sqlx::Error::RowNotFound)?.try_get(0)?;
            session.check(ran_on)?;
            // The transaction lock's row, the insert's, then the entries.
            let inserted = rows
                .get(1)
                .filter(|row| row.len() == 1)
                .ok_or(sqlx::Error::RowNotFound)?;
            let number: i64 = inserted.try_get(0)?;
            let (entries, mine) = QueueEntry::read_rows(rows.get(2..).unwrap_or_default(), number)?;
            if !mine {
                return Err(sqlx::Error::RowNotFound);
            }
            Ok((number, entries))
        })
    }

    pub(super) fn ahead_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
        number: i64,
    ) -> BoxFuture<'a, Result<(Vec<QueueEntry>, bool), sqlx::Error>> {
        Box::pin(async move {
            let rows = sqlx::query(self.ahead.as_str())
                .bind(*id)
                .bind(number)
                .fetch_all(&mut session.conn)
                .await?;
            QueueEntry::read_rows(&rows, number)
        })
    }

    pub(super) fn dequeue_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let (deleted, _, pid): (bool, Option<bool>, i32) =
                sqlx::query_as(self.dequeue.as_str())
                    .bind(entry_lock(token))
                    .bind(session.pid)
                    .fetch_one(&mut session.conn)
                    .await?;
            session.check(pid)?;
            Ok(deleted)
        })
    }

    pub(super) fn remove_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        numbers: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(self.remove.as_str())
                .bind(numbers)
                .execute(&mut session.conn)
                .await
                .map(drop)
        })
    }

    pub(super) fn watch_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        owner: &'a str,
        limit: Option<Duration>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let owner: i64 = owner
                .parse()
                .map_err(|_| sqlx::Error::Protocol(format!("a queue entry's owner: {owner}")))?;
            let lock_timeout = limit.map_or(0, |l| l.as_millis().max(1));
            // Taken and given back at once: its owner left. One simple
            // query, so one server session whatever is in between.
            let watch = format!(
                "SET lock_timeout = {lock_timeout}; SELECT pg_advisory_lock({owner}); \
                 SELECT pg_advisory_unlock({owner}); SET lock_timeout = 0"
            );
            match session.conn.execute(watch.as_str()).await {
                Ok(_) => Ok(true),
                // As for a wait: a grant in the instant of the timeout is
                // given back (a waiter session holds nothing else).
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
                {
                    let unlock = format!("SELECT pg_advisory_unlock({owner})");
                    session.conn.execute(unlock.as_str()).await?;
                    Ok(false)
                }
                Err(e) => Err(e),
            }
        })
    }
}
