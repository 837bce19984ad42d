//! Acquiring an advisory lock: the uncontended attempt on a holder
//! session, and the wait on the server on a waiter session.

use std::time::Duration;

use dlock_core::backend::{BoxFuture, Mode};
use dlock_sql::{sqlx, Granted};
use sqlx::Executor;

use super::{own, split, PgDialect, PgSession, LOCK_NOT_AVAILABLE};

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
            let lock_timeout = limit.map_or(0, |l| l.as_millis().max(1)).to_string();
            let (hi, lo) = split(*id);
            let pid = session.pid;
            let answer = match mode {
                Mode::Read => sqlx::query_as(self.wait_read.as_str()).bind(hi).bind(lo),
                Mode::Write => sqlx::query_as(self.wait_write.as_str()).bind(hi).bind(lo),
                _ => sqlx::query_as(self.wait_lock.as_str()).bind(*id),
            }
            .bind(lock_timeout)
            .bind(pid)
            .fetch_one(&mut session.conn)
            .await;
            let (ran_on, fence, took_us): (i32, Option<i64>, i64) = match answer {
                Ok(answer) => answer,
                // Not granted, most likely; but the server may grant the
                // lock in the very instant it times the wait out, and a
                // session-level lock outlives the failed statement. A
                // waiter session holds nothing else, so an unlock can only
                // undo this wait's own grant: then the session is as it
                // was (the failed statement undid its `lock_timeout`).
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
            session.check(ran_on)?;
            Ok(Some(Granted {
                fence: fence.ok_or(sqlx::Error::RowNotFound)?,
                took: Duration::from_micros(u64::try_from(took_us).unwrap_or(0)),
            }))
        })
    }
}
