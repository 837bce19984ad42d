//! Acquiring a named lock: the uncontended attempt on a holder session,
//! and the wait on the server on a waiter session.

use std::{sync::atomic::Ordering, time::Duration};

use dlock_sql::{sqlx, Dialect, Granted};
use sqlx::{Executor, Row};

use super::{error_number, MySqlDialect, MySqlSession, FENCE_ROWS};
use crate::config::FenceSource;

/// The stored function `{prefix}_take_v1(session, name, timeout, shard)`:
/// `GET_LOCK` and, if granted, the token from the name's counter row, in
/// one prepared statement. The same work as [`MySqlDialect::get_lock`]'s
/// text request of three statements, with the same counter rows, so
/// clients that use it and clients that cannot lock alike. Answers the
/// token (from 1 up), 0 if refused, -1 if the counter row is missing (the
/// lock is held then: the caller undoes it), -2 if `GET_LOCK` answered
/// `NULL` (interrupted), -3 on another server session (nothing run).
///
/// The name is ASCII, as in the text request: the function locks the
/// same bytes whatever the database's character set. A change to the
/// body takes a new name (`_v2`): clients of the old body keep using it.
const TAKE_BODY: &str = "(s BIGINT, n VARCHAR(64) CHARACTER SET ascii, t DOUBLE, sh SMALLINT) \
     RETURNS BIGINT \
     NOT DETERMINISTIC MODIFIES SQL DATA SQL SECURITY DEFINER \
     COMMENT 'dlock: a named lock and its fencing token, in one statement' \
     BEGIN DECLARE g INT; \
     IF CONNECTION_ID() <> s THEN RETURN -3; END IF; \
     SET g = GET_LOCK(n, t); \
     IF g IS NULL THEN RETURN -2; END IF; \
     IF g = 0 THEN RETURN 0; END IF; \
     UPDATE {table} SET v = LAST_INSERT_ID(v + 1) WHERE shard = sh; \
     IF ROW_COUNT() <> 1 THEN RETURN -1; END IF; \
     RETURN LAST_INSERT_ID(); END";

/// Errors of a call to `{prefix}_take_v1` that ran none of it: the function
/// is gone (1305), may not be run by this login (1370), has other
/// parameters (1318), or its definer is gone (1449).
pub(super) fn take_did_not_run(e: &sqlx::Error) -> bool {
    matches!(error_number(e), Some(1305 | 1370 | 1318 | 1449))
}

impl MySqlDialect {
    /// At connect, with fences: makes `{prefix}_take_v1` if it is
    /// missing, and tries it once. Without the rights to make it (`CREATE
    /// ROUTINE`, and with binary logging `log_bin_trust_function_creators
    /// = 1`) or to run it (`EXECUTE`), each attempt sends the text request
    /// instead, a few statements longer; nothing else changes. Neither
    /// with a statement-based binary log: a replica would replay the call,
    /// `GET_LOCK` included, where the text request logs its `UPDATE`.
    pub(super) async fn prepare_take(&self, conn: &mut MySqlSession) -> Result<(), sqlx::Error> {
        let (log_bin, format): (i64, Option<String>) =
            sqlx::query_as("SELECT CAST(@@log_bin AS SIGNED), CAST(@@binlog_format AS CHAR)")
                .fetch_one(&mut conn.conn)
                .await?;
        if log_bin != 0 && format.as_deref() != Some("ROW") {
            tracing::info!(
                binlog_format = format.as_deref().unwrap_or(""),
                "dlock mysql leaves its stored function out with a binary log not in ROW format; \
                 each lock sends a longer text request"
            );
            return Ok(());
        }
        let exists: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = DATABASE() \
             AND ROUTINE_NAME = ? AND ROUTINE_TYPE = 'FUNCTION'",
        )
        .bind(&self.take)
        .fetch_one(&mut conn.conn)
        .await?;
        if exists == 0 {
            let create = format!(
                "CREATE FUNCTION {}{}",
                self.take,
                TAKE_BODY.replace("{table}", &self.table)
            );
            match conn.conn.execute(create.as_str()).await {
                // 1304: made meanwhile, by another client's connect.
                Ok(_) => {}
                Err(e) if error_number(&e) == Some(1304) => {}
                Err(error @ sqlx::Error::Database(_)) => {
                    tracing::info!(
                        %error,
                        function = %self.take,
                        "dlock mysql cannot make its stored function; each lock sends a longer text request"
                    );
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        // On session id -1, the function runs nothing but its first check.
        let tried = sqlx::query_scalar::<_, Option<i64>>(&format!(
            "SELECT CAST({}(-1, '', 0, 0) AS SIGNED)",
            self.take
        ))
        .fetch_one(&mut conn.conn)
        .await;
        match tried {
            Ok(Some(-3)) => self.take_ready.store(true, Ordering::Relaxed),
            Ok(answer) => tracing::warn!(
                ?answer,
                function = %self.take,
                "a stored function of dlock's name is not dlock's; each lock sends a text request"
            ),
            Err(e) if self.ends_the_session(&e) => return Err(e),
            Err(error) => tracing::info!(
                %error,
                function = %self.take,
                "dlock mysql cannot run its stored function; each lock sends a longer text request"
            ),
        }
        Ok(())
    }

    /// An attempt that does not wait, through `{prefix}_take_v1`.
    pub(super) async fn take(
        &self,
        conn: &mut MySqlSession,
        id: &String,
    ) -> Result<Option<i64>, sqlx::Error> {
        let shard = (self.shard(id) % FENCE_ROWS) as i64;
        let (taken, session): (i64, i64) = sqlx::query_as(&self.take_call)
            .bind(conn.id)
            .bind(id)
            .bind(shard)
            .fetch_one(&mut conn.conn)
            .await?;
        conn.check(session)?;
        match taken {
            1.. => Ok(Some(taken)),
            0 | -2 => Ok(None),
            -1 => self.token(None).map(Some),
            other => Err(sqlx::Error::Protocol(format!(
                "{} answered {other}",
                self.take
            ))),
        }
    }

    /// One text request on `conn`'s own server session: `GET_LOCK(name,
    /// timeout)` then, if granted, the token from the name's counter row.
    /// Answers the lock's state (1 granted, 0 timed out, `NULL`
    /// interrupted) and a grant, its server's time measured only if
    /// `timed`. Names are ASCII letters, digits and `-_.:/%#` only: safe
    /// inside quotes.
    pub(super) async fn get_lock(
        &self,
        conn: &mut MySqlSession,
        name: &str,
        timeout: &str,
        timed: bool,
    ) -> Result<(Option<i64>, Option<Granted>), sqlx::Error> {
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
        let request = format!(
            "{start}\
             SET @dlock_g = IF(CONNECTION_ID() = {session}, GET_LOCK('{name}', {timeout}), -1); \
             {take}\
             SELECT @dlock_g, {token}, {took}, CAST(CONNECTION_ID() AS SIGNED)",
            session = conn.id,
        );
        let rows = conn.conn.fetch_all(request.as_str()).await?;
        let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
        conn.check(row.try_get(3)?)?;
        let state: Option<i64> = row.try_get(0)?;
        if state != Some(1) {
            return Ok((state, None));
        }
        let took: i64 = row.try_get(2)?;
        let granted = Granted {
            fence: self.token(row.try_get(1)?)?,
            took: Duration::from_micros(u64::try_from(took).unwrap_or(0)),
        };
        Ok((state, Some(granted)))
    }
}
