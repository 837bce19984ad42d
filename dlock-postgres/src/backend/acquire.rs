//! Acquiring an advisory lock: the uncontended attempt on a holder
//! session, and the wait on the server on a waiter session.

use std::time::Duration;

use dlock_core::backend::{BoxFuture, Mode};
use dlock_sql::{sqlx, Granted};
use sqlx::{Executor, Row};

use super::{own, split, PgDialect, PgSession, LOCK_NOT_AVAILABLE};

impl PgDialect {
    pub(super) fn try_lock_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
        mode: Mode,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        let (hi, lo) = split(*id);
        Box::pin(async move {
            let pid = session.pid;
            let answer = match mode {
                Mode::Read => sqlx::query_as(self.try_read.as_str()).bind(hi).bind(lo),
                Mode::Write => sqlx::query_as(self.try_write.as_str()).bind(hi).bind(lo),
                _ => sqlx::query_as(self.try_lock.as_str()).bind(*id),
            }
            .bind(pid)
            .fetch_one(&mut session.conn)
            .await?;
            own(session, answer)
        })
    }

    /// Reads `pg_locks` for a waiting writer first (only when this
    /// process may hold the key shared already, so off the common path).
    pub(super) fn try_read_behind_writers_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        let (hi, lo) = split(*id);
        Box::pin(async move {
            let pid = session.pid;
            let answer = sqlx::query_as(self.try_read_behind_writers.as_str())
                .bind(hi)
                .bind(lo)
                .bind(pid)
                .fetch_one(&mut session.conn)
                .await?;
            own(session, answer)
        })
    }

    pub(super) fn wait_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
        mode: Mode,
        limit: Option<Duration>,
    ) -> BoxFuture<'a, Result<Option<Granted>, sqlx::Error>> {
        Box::pin(async move {
            let lock_timeout = limit.map_or(0, |l| l.as_millis().max(1));
            let (hi, lo) = split(*id);
            let lock = match mode {
                Mode::Read => format!("pg_advisory_lock_shared({hi}, {lo})"),
                Mode::Write => format!("pg_advisory_lock({hi}, {lo})"),
                _ => format!("pg_advisory_lock({id})"),
            };
            // One round trip, one server session: the session's process
            // id, the wait (only on the session's own process), then (a
            // statement of its own, so only after the grant) the token,
            // and how long the server took since it received the query.
            // The limit is lifted before the token, so the token's
            // statement never times out after a grant.
            let wait = format!(
                "SET lock_timeout = {lock_timeout}; SELECT pg_backend_pid(); \
                 SELECT {lock} WHERE pg_backend_pid() = {pid}; SET lock_timeout = 0; \
                 SELECT {fence}, (extract(epoch FROM clock_timestamp() - statement_timestamp()) \
                 * 1000000)::bigint WHERE pg_backend_pid() = {pid}",
                pid = session.pid,
                fence = self.fence_expr,
            );
            let rows = match session.conn.fetch_all(wait.as_str()).await {
                Ok(rows) => rows,
                // Not granted, most likely; but the server may grant the
                // lock in the very instant it times the wait out, and a
                // session-level lock outlives the failed statement. A
                // waiter session holds nothing else, so an unlock can only
                // undo this wait's own grant: then the session is as it
                // was (its `lock_timeout` is set again at the next wait).
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
                {
                    let unlock = match mode {
                        Mode::Read => format!("SELECT pg_advisory_unlock_shared({hi}, {lo})"),
                        Mode::Write => format!("SELECT pg_advisory_unlock({hi}, {lo})"),
                        _ => format!("SELECT pg_advisory_unlock({id})"),
                    };
                    session.conn.execute(unlock.as_str()).await?;
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            let ran_on: i32 = rows.first().ok_or(sqlx::Error::RowNotFound)?.try_get(0)?;
            session.check(ran_on)?;
            let row = rows.get(2).ok_or(sqlx::Error::RowNotFound)?;
            let took_us: i64 = row.try_get(1)?;
            Ok(Some(Granted {
                fence: row.try_get(0)?,
                took: Duration::from_micros(u64::try_from(took_us).unwrap_or(0)),
            }))
        })
    }
}
