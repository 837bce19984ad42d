//! Sessions: opening one, setting up the server's objects, the ping that
//! keeps it alive, and ending another one.

use dlock_core::backend::BoxFuture;
use dlock_sql::{sqlx, ServerSession};
use sqlx::{postgres::PgConnection, Connection, Executor, Row};

use super::{PgDialect, PgSession};

/// The incarnation of the session of process `pid` (an SQL expression),
/// as text: the server's system identifier (set by `initdb`, shared by
/// its physical replicas) and the session's start in microseconds.
/// `NULL` if no such session is seen.
fn incarnation(pid: &str) -> String {
    format!(
        "(SELECT system_identifier FROM pg_control_system())::text || '/' || \
         (SELECT (extract(epoch FROM a.backend_start) * 1000000)::bigint::text \
         FROM pg_stat_activity a WHERE a.pid = {pid})"
    )
}

impl PgDialect {
    /// A simple query (no prepared statement: a pooler in transaction
    /// mode would break those before dlock could tell it is there).
    pub(super) fn open_inner(
        &self,
    ) -> BoxFuture<'_, Result<(PgSession, ServerSession), sqlx::Error>> {
        Box::pin(async move {
            let mut conn = PgConnection::connect_with(self.config.connect_options()).await?;
            let opened = format!(
                "SELECT pg_backend_pid(), set_config('idle_session_timeout', '{}', false), \
                 set_config('client_connection_check_interval', '1000', false), {}",
                self.config.session_timeout().as_millis(),
                incarnation("pg_backend_pid()"),
            );
            let row = conn.fetch_one(opened.as_str()).await?;
            let pid: i32 = row.try_get(0)?;
            // `NULL` only if the server hides the session's start from
            // its own login; then nothing can end it by id.
            let incarnation: Option<String> = row.try_get(3)?;
            let session = ServerSession {
                id: pid as u64,
                incarnation: incarnation.unwrap_or_default(),
            };
            Ok((PgSession { conn, pid }, session))
        })
    }

    /// Also reads the schema the tables live in, for the lock identifiers.
    pub(super) fn setup_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let schema: Option<String> = sqlx::query_scalar("SELECT current_schema()")
                .fetch_one(&mut session.conn)
                .await?;
            let prefix = self.config.lock_prefix();
            // The default schema keeps the plain prefix's identifiers.
            let _ = self.scope.set(match schema.as_deref() {
                None | Some("public") => prefix.to_owned(),
                Some(schema) => format!("{prefix}\0{schema}"),
            });
            // The caller's own connections may search other schemas: the
            // sequence by its schema's name, as `regclass` text (bound as
            // a parameter, never written into a statement).
            let sequence = format!("{prefix}_fence");
            let _ = self.caller_fence.set(match schema.as_deref() {
                None => sequence,
                Some(schema) => format!("\"{}\".{sequence}", schema.replace('"', "\"\"")),
            });
            let created: bool = sqlx::query_scalar(self.created.as_str())
                .fetch_one(&mut session.conn)
                .await?;
            let create = if created {
                Ok(Default::default())
            } else {
                session.conn.execute(self.create.as_str()).await
            };
            match create {
                Ok(_) => {}
                // Two clients creating it at once: one of them is told it
                // exists (unique_violation or duplicate_table). It does now.
                Err(sqlx::Error::Database(e))
                    if matches!(e.code().as_deref(), Some("23505" | "42P07")) => {}
                Err(e) => return Err(e),
            }
            // Entries whose sessions ended are deleted by the next enqueue
            // of their key; those of keys nobody locks again, here.
            session.conn.execute(self.reap.as_str()).await.map(drop)
        })
    }

    pub(super) fn end_session_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
        other: &'a ServerSession,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        // The incarnation is compared in the statement that ends the
        // session: a server whose identifier or session start differs
        // (another server behind the address, a restart) ends nothing.
        let end = format!(
            "SELECT pg_terminate_backend($1) WHERE {} = $2",
            incarnation("$1")
        );
        Box::pin(async move {
            sqlx::query(&end)
                .bind(other.id as i32)
                .bind(&other.incarnation)
                .execute(&mut session.conn)
                .await
                .map(drop)
        })
    }

    pub(super) fn ping_inner<'a>(
        &'a self,
        session: &'a mut PgSession,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut session.conn)
                .await?;
            session.check(pid)
        })
    }
}
