//! Acquiring a named lock: the uncontended attempt on a holder session,
//! and the wait on the server on a waiter session.

use std::time::Duration;

use dlock_core::backend::{BoxFuture, Mode};
use dlock_sql::{sqlx, Dialect, Granted};
use sqlx::{Executor, Row};

use super::{on_own_session, MySqlDialect, MySqlSession, FENCE_ROWS, FOREVER_SECS};
use crate::config::FenceSource;

impl MySqlDialect {
    /// One request: `GET_LOCK(name, timeout)` (only on the server session
    /// `session`) then, if granted, the token from the name's counter row
    /// (`-1` if the row is missing); answers the lock's state (1 granted,
    /// 0 timed out, `NULL` interrupted, -1 on another session), the
    /// token, and the server's time on it in µs (0 unless `timed`: an
    /// attempt that does not wait has no use for it). Names are ASCII letters,
    /// digits and `-_.:/%#` only: safe inside quotes.
    fn get_lock(&self, session: i64, name: &str, timeout: &str, timed: bool) -> String {
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
        // An attempt that does not wait has no use for the server's time
        // on it: one statement fewer.
        let (start, took) = if timed {
            (
                "SET @dlock_t = SYSDATE(6); ",
                "TIMESTAMPDIFF(MICROSECOND, @dlock_t, SYSDATE(6))",
            )
        } else {
            ("", "0")
        };
        format!(
            "{start}\
             SET @dlock_g = IF(CONNECTION_ID() = {session}, GET_LOCK('{name}', {timeout}), -1); \
             {take}\
             SELECT @dlock_g, {token}, {took}, CAST(CONNECTION_ID() AS SIGNED)"
        )
    }

    pub(super) fn try_lock_inner<'a>(
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
            let request = self.get_lock(conn.id, id, "0", false);
            let rows = conn.conn.fetch_all(request.as_str()).await?;
            let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
            conn.check(row.try_get(3)?)?;
            match row.try_get::<Option<i64>, _>(0)? {
                Some(1) => self.token(row.try_get(1)?).map(Some),
                _ => Ok(None),
            }
        })
    }

    // The signature of `Dialect::wait`, whose `Id` is a `String` here.
    #[allow(clippy::ptr_arg)]
    pub(super) fn wait_inner<'a>(
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
            let request = self.get_lock(conn.id, id, &timeout, true);
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
}
