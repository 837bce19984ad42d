//! Releasing an advisory lock, on the session's own server process only.

use dlock_core::backend::{BoxFuture, Mode};
use dlock_sql::sqlx;

use super::{own, split, PgDialect, PgSession};

/// Releases a hold, on the session's own server process only (`$2`):
/// whether it was held, and the process id.
const UNLOCK: &str = "SELECT CASE WHEN pg_backend_pid() = $2 THEN pg_advisory_unlock($1) END, \
     pg_backend_pid()";

/// The same for a writer (two-key space; `$3` the process id).
const UNLOCK_TWO_KEY: &str =
    "SELECT CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($1, $2) END, \
     pg_backend_pid()";

/// The same for a reader.
const UNLOCK_SHARED: &str =
    "SELECT CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock_shared($1, $2) END, \
     pg_backend_pid()";

impl PgDialect {
    pub(super) fn unlock_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
        mode: Mode,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        let (hi, lo) = split(*id);
        Box::pin(async move {
            let pid = session.pid;
            let answer = match mode {
                Mode::Read => sqlx::query_as(UNLOCK_SHARED).bind(hi).bind(lo),
                Mode::Write => sqlx::query_as(UNLOCK_TWO_KEY).bind(hi).bind(lo),
                _ => sqlx::query_as(UNLOCK).bind(*id),
            }
            .bind(pid)
            .fetch_one(&mut session.conn)
            .await?;
            Ok(own(session, answer)?.unwrap_or(false))
        })
    }
}
