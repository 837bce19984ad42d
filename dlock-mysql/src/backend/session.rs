//! Sessions: opening one, checking the server and setting up its tables,
//! the ping that keeps it alive, and ending another one.

use dlock_core::{backend::BoxFuture, Token};
use dlock_sql::{sqlx, ServerSession};
use sqlx::{
    mysql::{MySqlConnection, MySqlDatabaseError},
    Connection, Executor, Row,
};

use super::{lock_name_in, MySqlDialect, MySqlSession, QUEUE_ROW};
use crate::config::FenceSource;

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

impl MySqlDialect {
    /// The session takes a named lock of its own, its marker: whoever
    /// holds it (`IS_USED_LOCK`) on a server is this session, as no
    /// connection id can tell (see [`ServerSession`]).
    pub(super) fn open_inner(
        &self,
    ) -> BoxFuture<'_, Result<(MySqlSession, ServerSession), sqlx::Error>> {
        Box::pin(async move {
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
        })
    }

    pub(super) fn setup_inner<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
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
        })
    }

    pub(super) fn end_session_inner<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        session: &'a ServerSession,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
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

    pub(super) fn ping_inner<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let session: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
                .fetch_one(&mut conn.conn)
                .await?;
            conn.check(session)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
