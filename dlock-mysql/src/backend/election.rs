//! Holders: recording a hold's value behind its entry lock, deleting the
//! record, and reading the holder of a plain lock.

use dlock_core::{backend::BoxFuture, Token};
use dlock_sql::sqlx;
use sqlx::Row;

use super::{lock_name_in, on_own_session, MySqlDialect, MySqlSession};

impl MySqlDialect {
    /// A proclaimed hold's entry lock, named as a queue entry's is.
    fn holder_lock(&self, token: &Token) -> String {
        self.token_lock('h', token)
    }

    pub(super) fn proclaim_inner<'a>(
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

    pub(super) fn disclaim_inner<'a>(
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

    // The signature of `Dialect::holder`.
    #[allow(clippy::type_complexity)]
    pub(super) fn holder_inner<'a>(
        &'a self,
        conn: &'a mut MySqlSession,
        id: &'a String,
    ) -> BoxFuture<'a, Result<Option<(Option<i64>, Option<Vec<u8>>)>, sqlx::Error>> {
        Box::pin(async move {
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
        })
    }
}
