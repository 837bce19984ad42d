//! Holders: recording a hold's value behind its entry lock, deleting the
//! record, and reading the holder of a plain lock.

use dlock_core::{backend::BoxFuture, Token};
use dlock_sql::sqlx;
use sqlx::Row;

use super::{own, token_lock, PgDialect, PgSession};

/// A proclaimed hold's entry lock: a one-key advisory lock named for its
/// token, held by the holder's session while its record is its own.
fn holder_lock(token: &Token) -> i64 {
    token_lock("dlock-holder", token)
}

impl PgDialect {
    pub(super) fn proclaim_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
        token: &'a Token,
        fence: i64,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let (written, pid): (i64, i32) = sqlx::query_as(self.proclaim.as_str())
                .bind(*id)
                .bind(holder_lock(token))
                .bind(fence)
                .bind(value)
                .bind(session.pid)
                .fetch_one(&mut session.conn)
                .await?;
            session.check(pid)?;
            if written == 1 {
                Ok(())
            } else {
                // Another session holds the entry lock: never, short of
                // two tokens' names colliding in 64 bits.
                Err(sqlx::Error::RowNotFound)
            }
        })
    }

    pub(super) fn disclaim_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let answer: (Option<bool>, i32) = sqlx::query_as(self.disclaim.as_str())
                .bind(*id)
                .bind(holder_lock(token))
                .bind(session.pid)
                .fetch_one(&mut session.conn)
                .await?;
            own(session, answer).map(drop)
        })
    }

    // The signature of `Dialect::holder`.
    #[allow(clippy::type_complexity)]
    pub(super) fn holder_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        id: &'a i64,
    ) -> BoxFuture<'a, Result<Option<(Option<i64>, Option<Vec<u8>>)>, sqlx::Error>> {
        Box::pin(async move {
            let row = sqlx::query(self.holder.as_str())
                .bind(*id)
                .fetch_optional(&mut session.conn)
                .await?;
            row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .transpose()
        })
    }
}
