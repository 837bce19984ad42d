//! Releasing a named lock, on the session's own server session only.

use dlock_core::backend::{BoxFuture, Mode};
use dlock_sql::sqlx;

use super::{on_own_session, MySqlDialect, MySqlSession};

impl MySqlDialect {
    pub(super) fn unlock_inner<'a>(
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
}
