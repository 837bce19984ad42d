//! PostgreSQL's statements, as `dlock-sql`'s [`Dialect`]: opening a
//! session, the uncontended attempt and the wait on the server, the
//! semaphores' queue table, the holders' records, and ending sessions.

use std::time::Duration;

use dlock_core::{
    backend::{HeldLock, Holder, ListCursor, ListPage, ListedKey, Mode},
    LockError, LockKey, Token,
};
use dlock_sql::{sqlx, Dialect, Granted, QueueEntry, ServerSession, SqlSettings};
use sqlx::{
    postgres::{PgConnectOptions, PgConnection},
    Connection, Executor, Row,
};

use super::{
    ahead, lock_query, on_own_session, one_key_lock, own, split, token_lock, wait_statement,
    PgDialect, PgSession, LOCK_NOT_AVAILABLE, READ_WRITE_SALT, SEMAPHORE_SALT, THIS_DATABASE,
};
use crate::config::{lock_id, PgConfig};

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

impl Dialect for PgDialect {
    type Config = PgConfig;
    type Database = sqlx::Postgres;
    type Conn = PgSession;
    type Id = i64;

    const NAME: &'static str = "postgres";

    fn parse_url(url: &str) -> Result<PgConfig, LockError> {
        PgConfig::from_url(url)
    }

    fn pool_config(options: PgConnectOptions) -> PgConfig {
        PgConfig::from_options(options)
    }

    fn new(config: PgConfig) -> PgDialect {
        let sequence = format!("{}_fence", config.lock_prefix());
        let queue = format!("{}_queue", config.lock_prefix());
        let holders = format!("{}_holder", config.lock_prefix());
        let try_lock = |lock: &str, pid: &str| {
            on_own_session(
                pid,
                &format!("CASE WHEN {lock} THEN nextval('{sequence}') END"),
            )
        };
        PgDialect {
            try_lock: [
                try_lock("pg_try_advisory_lock($1)", "$2"),
                try_lock("pg_try_advisory_lock_shared($1, $2)", "$3"),
                try_lock("pg_try_advisory_lock($1, $2)", "$3"),
            ],
            wait: [
                wait_statement("pg_advisory_lock($1)", "$2", "$3", &sequence),
                wait_statement("pg_advisory_lock_shared($1, $2)", "$3", "$4", &sequence),
                wait_statement("pg_advisory_lock($1, $2)", "$3", "$4", &sequence),
            ],
            unlock: [
                on_own_session("$2", "pg_advisory_unlock($1)"),
                on_own_session("$3", "pg_advisory_unlock_shared($1, $2)"),
                on_own_session("$3", "pg_advisory_unlock($1, $2)"),
            ],
            try_read_behind_writers: on_own_session(
                "$3",
                &format!(
                    "CASE WHEN EXISTS (SELECT 1 FROM pg_locks w \
                     WHERE w.locktype = 'advisory' AND NOT w.granted \
                     AND w.mode = 'ExclusiveLock' AND w.objsubid = 2 \
                     AND w.database = {THIS_DATABASE} \
                     AND w.classid::bigint = ($1::bigint & 4294967295) \
                     AND w.objid::bigint = ($2::bigint & 4294967295)) THEN NULL \
                     WHEN pg_try_advisory_lock_shared($1, $2) THEN nextval('{sequence}') END"
                ),
            ),
            create: format!(
                "CREATE SEQUENCE IF NOT EXISTS {sequence}; \
                 CREATE TABLE IF NOT EXISTS {queue} (\
                 n BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                 lock_id BIGINT NOT NULL, mode TEXT NOT NULL, owner BIGINT NOT NULL, \
                 pid INT NOT NULL); \
                 CREATE INDEX IF NOT EXISTS {queue}_lock ON {queue} (lock_id, n); \
                 CREATE TABLE IF NOT EXISTS {holders} (\
                 lock_id BIGINT PRIMARY KEY, owner BIGINT NOT NULL, \
                 fence BIGINT NOT NULL, value BYTEA NOT NULL)"
            ),
            // In `current_schema()`, where `create` makes them and the
            // caller's statements name the sequence, whatever else the
            // search path finds first.
            created: format!(
                "SELECT to_regclass(format('%I.%I', current_schema(), '{sequence}')) IS NOT NULL \
                 AND to_regclass(format('%I.%I', current_schema(), '{queue}_lock')) IS NOT NULL \
                 AND to_regclass(format('%I.%I', current_schema(), '{holders}')) IS NOT NULL"
            ),
            proclaim: format!(
                "WITH i AS (INSERT INTO {holders} (lock_id, owner, fence, value) \
                 SELECT $1, $2, $3, $4 \
                 WHERE CASE WHEN pg_backend_pid() <> $5 THEN false \
                 WHEN EXISTS (SELECT 1 FROM pg_locks e WHERE {mine} \
                 AND e.pid = pg_backend_pid()) THEN true \
                 ELSE pg_try_advisory_lock($2) END \
                 ON CONFLICT (lock_id) DO UPDATE SET owner = EXCLUDED.owner, \
                 fence = EXCLUDED.fence, value = EXCLUDED.value RETURNING 1) \
                 SELECT (SELECT count(*) FROM i), pg_backend_pid()",
                mine = one_key_lock("e", "$2"),
            ),
            disclaim: format!(
                "WITH d AS (DELETE FROM {holders} WHERE lock_id = $1 AND owner = $2) \
                 SELECT CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($2) END, \
                 pg_backend_pid()"
            ),
            end_holder: format!(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(l.pid)) FROM pg_locks l \
                 WHERE {held} AND l.pid <> pg_backend_pid() AND l.database = {THIS_DATABASE}",
                held = one_key_lock("l", "$1"),
            ),
            holder: format!(
                "SELECT h.fence, h.value FROM pg_locks l \
                 LEFT JOIN {holders} h ON h.lock_id = $1 AND EXISTS (\
                 SELECT 1 FROM pg_locks e WHERE {entry} \
                 AND e.database = l.database AND e.pid = l.pid) \
                 WHERE {held} AND l.database = {THIS_DATABASE}",
                entry = one_key_lock("e", "h.owner"),
                held = one_key_lock("l", "$1"),
            ),
            // Every advisory lock of this database held by some session,
            // after the cursor `($1, $2)` (two-key form, then id), the
            // first `$3` of them with their holders and waiters; not the
            // entry locks of queue entries and holder records (one-key
            // locks named by an owner there).
            list: format!(
                "WITH l AS (SELECT l.objsubid::int AS kind, \
                 ((l.classid::bigint << 32) | l.objid::bigint) AS id, \
                 l.mode, l.granted FROM pg_locks l \
                 WHERE l.locktype = 'advisory' AND l.database = {THIS_DATABASE}), \
                 ids AS (SELECT DISTINCT kind, id FROM l WHERE granted AND (kind, id) > ($1, $2) \
                 AND NOT (kind = 1 AND (EXISTS (SELECT 1 FROM {queue} q WHERE q.owner = l.id) \
                 OR EXISTS (SELECT 1 FROM {holders} h WHERE h.owner = l.id))) \
                 ORDER BY kind, id LIMIT $3) \
                 SELECT ids.kind, ids.id, l.mode, l.granted FROM ids \
                 JOIN l ON l.kind = ids.kind AND l.id = ids.id ORDER BY ids.kind, ids.id"
            ),
            ahead: ahead(&queue, "$1", "$2", false),
            dequeue: format!(
                "WITH d AS (DELETE FROM {queue} WHERE owner = $1 RETURNING n) \
                 SELECT EXISTS (SELECT 1 FROM d), \
                 CASE WHEN pg_backend_pid() = $2 THEN pg_advisory_unlock($1) END, \
                 pg_backend_pid()"
            ),
            remove: format!("DELETE FROM {queue} WHERE n = ANY($1)"),
            reap: format!(
                "DELETE FROM {queue} q WHERE NOT EXISTS (SELECT 1 FROM pg_locks l \
                 WHERE {held} AND l.pid = q.pid AND l.database = {THIS_DATABASE})",
                held = one_key_lock("l", "q.owner"),
            ),
            queue,
            config,
            scope: std::sync::OnceLock::new(),
            caller_fence: std::sync::OnceLock::new(),
        }
    }

    fn settings(&self) -> &SqlSettings {
        self.config.settings()
    }

    /// A plain lock's 64-bit identifier; a read-write lock's is the same
    /// hash with its low bits flipped (so that this process's turns at the
    /// two never meet), and it goes to the server as two 32-bit keys, a
    /// space of advisory locks apart from the one-key space.
    fn lock_id(&self, key: &LockKey, mode: Mode) -> i64 {
        let scope = self
            .scope
            .get()
            .map_or(self.config.lock_prefix(), String::as_str);
        let id = lock_id(scope, key.as_str());
        match mode {
            Mode::Exclusive => id,
            Mode::Permits { .. } => id ^ SEMAPHORE_SALT,
            _ => id ^ READ_WRITE_SALT,
        }
    }

    fn shard(&self, id: &i64) -> u64 {
        *id as u64
    }

    /// A simple query (no prepared statement: a pooler in transaction
    /// mode would break those before dlock could tell it is there).
    async fn open(&self) -> Result<(PgSession, ServerSession), sqlx::Error> {
        let mut conn = PgConnection::connect_with(self.config.connect_options()).await?;
        let opened = format!(
            "SELECT pg_backend_pid(), set_config('idle_session_timeout', '{}', false), \
             set_config('client_connection_check_interval', '1000', false), {}",
            self.config.session_timeout().as_millis(),
            incarnation("pg_backend_pid()"),
        );
        let row = conn.fetch_one(opened.as_str()).await?;
        let pid: i32 = row.try_get(0)?;
        // `NULL` only if the server hides the session's start from its
        // own login; then nothing can end it by id.
        let incarnation: Option<String> = row.try_get(3)?;
        let session = ServerSession {
            id: pid as u64,
            incarnation: incarnation.unwrap_or_default(),
        };
        Ok((PgSession { conn, id: pid }, session))
    }

    /// Also reads the schema the tables live in, for the lock identifiers.
    async fn setup(&self, session: &mut PgSession) -> Result<(), sqlx::Error> {
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
        // sequence by its schema's name, as `regclass` text (bound as a
        // parameter, never written into a statement).
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
        // Entries whose sessions ended are deleted by the next enqueue of
        // their key; those of keys nobody locks again, here.
        session.conn.execute(self.reap.as_str()).await.map(drop)
    }

    async fn try_lock(
        &self,
        session: &mut PgSession,
        id: &i64,
        mode: Mode,
    ) -> Result<Option<i64>, sqlx::Error> {
        let answer = lock_query(&self.try_lock, *id, mode)
            .bind(session.id)
            .fetch_one(&mut session.conn)
            .await?;
        own(session, answer)
    }

    /// Reads `pg_locks` for a waiting writer first (only when this
    /// process may hold the key shared already, so off the common path).
    async fn try_read_behind_writers(
        &self,
        session: &mut PgSession,
        id: &i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        let (hi, lo) = split(*id);
        let pid = session.id;
        let answer = sqlx::query_as(self.try_read_behind_writers.as_str())
            .bind(hi)
            .bind(lo)
            .bind(pid)
            .fetch_one(&mut session.conn)
            .await?;
        own(session, answer)
    }

    async fn wait(
        &self,
        session: &mut PgSession,
        id: &i64,
        mode: Mode,
        limit: Option<Duration>,
    ) -> Result<Option<Granted>, sqlx::Error> {
        let lock_timeout = limit.map_or(0, |l| l.as_millis().max(1)).to_string();
        let answer = lock_query(&self.wait, *id, mode)
            .bind(lock_timeout)
            .bind(session.id)
            .fetch_one(&mut session.conn)
            .await;
        let (ran_on, fence, took_us): (i32, Option<i64>, i64) = match answer {
            Ok(answer) => answer,
            // Not granted, most likely; but the server may grant the lock
            // in the very instant it times the wait out, and a
            // session-level lock outlives the failed statement. A waiter
            // session holds nothing else, so an unlock can only undo this
            // wait's own grant: then the session is as it was (the failed
            // statement undid its `lock_timeout`).
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                self.unlock(session, id, mode).await?;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        session.check(ran_on)?;
        Ok(Some(Granted {
            fence: fence.ok_or(sqlx::Error::RowNotFound)?,
            took: Duration::from_micros(u64::try_from(took_us).unwrap_or(0)),
        }))
    }

    async fn unlock(
        &self,
        session: &mut PgSession,
        id: &i64,
        mode: Mode,
    ) -> Result<bool, sqlx::Error> {
        let answer = lock_query(&self.unlock, *id, mode)
            .bind(session.id)
            .fetch_one(&mut session.conn)
            .await?;
        Ok(own(session, answer)?.unwrap_or(false))
    }

    /// The incarnation is compared in the statement that ends the
    /// session: a server whose identifier or session start differs
    /// (another server behind the address, a restart) ends nothing.
    async fn end_session(
        &self,
        session: &mut PgSession,
        other: &ServerSession,
    ) -> Result<(), sqlx::Error> {
        let end = format!(
            "SELECT pg_terminate_backend($1) WHERE {} = $2",
            incarnation("$1")
        );
        sqlx::query(&end)
            .bind(other.id as i32)
            .bind(&other.incarnation)
            .execute(&mut session.conn)
            .await
            .map(drop)
    }

    async fn ping(&self, session: &mut PgSession) -> Result<(), sqlx::Error> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut session.conn)
            .await?;
        session.check(pid)
    }

    /// Semaphores: the server has no counting lock.
    fn queues(&self, mode: Mode) -> bool {
        matches!(mode, Mode::Permits { .. })
    }

    /// An uncontended permit reads no `pg_locks`: that scan takes every
    /// lock partition of the server, so it is left to the entries that
    /// are refused.
    fn enqueue_counts_all_as_live(&self) -> bool {
        true
    }

    /// One simple query, so one implicit transaction: the key's
    /// transaction lock (the key's enqueues take turns until each insert
    /// commits, so numbers become visible in order), the entry lock and
    /// the insert (only on the session's own server process), then the
    /// entries up to it. Every value written inline is a number, or a tag
    /// of letters, digits and `/`.
    async fn enqueue(
        &self,
        session: &mut PgSession,
        id: &i64,
        mode: Mode,
        token: &Token,
    ) -> Result<(i64, Vec<QueueEntry>), sqlx::Error> {
        let (owner, queue, pid) = (token_lock("dlock-entry", token), &self.queue, session.id);
        let mine = format!("currval(pg_get_serial_sequence('{queue}', 'n'))");
        let request = format!(
            "SELECT pg_backend_pid(), pg_advisory_xact_lock({id}); \
             INSERT INTO {queue} (lock_id, mode, owner, pid) \
             SELECT {id}, '{tag}', {owner}, pg_backend_pid() \
             WHERE CASE WHEN pg_backend_pid() = {pid} \
             THEN pg_try_advisory_lock({owner}) ELSE false END \
             RETURNING n; {ahead}",
            tag = mode.tag(),
            ahead = ahead(queue, &id.to_string(), &mine, true),
        );
        let rows = session.conn.fetch_all(request.as_str()).await?;
        let ran_on: i32 = rows.first().ok_or(sqlx::Error::RowNotFound)?.try_get(0)?;
        session.check(ran_on)?;
        // The transaction lock's row, the insert's, then the entries.
        let inserted = rows
            .get(1)
            .filter(|row| row.len() == 1)
            .ok_or(sqlx::Error::RowNotFound)?;
        let number: i64 = inserted.try_get(0)?;
        let (entries, mine) = QueueEntry::read_rows(rows.get(2..).unwrap_or_default(), number)?;
        if !mine {
            return Err(sqlx::Error::RowNotFound);
        }
        Ok((number, entries))
    }

    async fn ahead(
        &self,
        session: &mut PgSession,
        id: &i64,
        number: i64,
    ) -> Result<(Vec<QueueEntry>, bool), sqlx::Error> {
        let rows = sqlx::query(self.ahead.as_str())
            .bind(*id)
            .bind(number)
            .fetch_all(&mut session.conn)
            .await?;
        QueueEntry::read_rows(&rows, number)
    }

    async fn dequeue(&self, session: &mut PgSession, token: &Token) -> Result<bool, sqlx::Error> {
        let (deleted, _, pid): (bool, Option<bool>, i32) = sqlx::query_as(self.dequeue.as_str())
            .bind(token_lock("dlock-entry", token))
            .bind(session.id)
            .fetch_one(&mut session.conn)
            .await?;
        session.check(pid)?;
        Ok(deleted)
    }

    async fn remove(&self, session: &mut PgSession, numbers: &[i64]) -> Result<(), sqlx::Error> {
        sqlx::query(self.remove.as_str())
            .bind(numbers)
            .execute(&mut session.conn)
            .await
            .map(drop)
    }

    async fn watch(
        &self,
        session: &mut PgSession,
        owner: &str,
        limit: Option<Duration>,
    ) -> Result<bool, sqlx::Error> {
        let owner: i64 = owner
            .parse()
            .map_err(|_| sqlx::Error::Protocol(format!("a queue entry's owner: {owner}")))?;
        let lock_timeout = limit.map_or(0, |l| l.as_millis().max(1));
        // Taken and given back at once: its owner left. One simple query,
        // so one server session whatever is in between.
        let watch = format!(
            "SET lock_timeout = {lock_timeout}; SELECT pg_advisory_lock({owner}); \
             SELECT pg_advisory_unlock({owner}); SET lock_timeout = 0"
        );
        match session.conn.execute(watch.as_str()).await {
            Ok(_) => Ok(true),
            // As for a wait: a grant in the instant of the timeout is
            // given back (a waiter session holds nothing else).
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                let unlock = format!("SELECT pg_advisory_unlock({owner})");
                session.conn.execute(unlock.as_str()).await?;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    async fn proclaim(
        &self,
        session: &mut PgSession,
        id: &i64,
        token: &Token,
        fence: i64,
        value: &[u8],
    ) -> Result<(), sqlx::Error> {
        let (written, pid): (i64, i32) = sqlx::query_as(self.proclaim.as_str())
            .bind(*id)
            .bind(token_lock("dlock-holder", token))
            .bind(fence)
            .bind(value)
            .bind(session.id)
            .fetch_one(&mut session.conn)
            .await?;
        session.check(pid)?;
        if written == 1 {
            Ok(())
        } else {
            // Another session holds the entry lock: never, short of two
            // tokens' names colliding in 64 bits.
            Err(sqlx::Error::RowNotFound)
        }
    }

    async fn disclaim(
        &self,
        session: &mut PgSession,
        id: &i64,
        token: &Token,
    ) -> Result<(), sqlx::Error> {
        let answer: (Option<bool>, i32) = sqlx::query_as(self.disclaim.as_str())
            .bind(*id)
            .bind(token_lock("dlock-holder", token))
            .bind(session.id)
            .fetch_one(&mut session.conn)
            .await?;
        own(session, answer).map(drop)
    }

    async fn holder(
        &self,
        session: &mut PgSession,
        id: &i64,
    ) -> Result<Option<(Option<i64>, Option<Vec<u8>>)>, sqlx::Error> {
        let row = sqlx::query(self.holder.as_str())
            .bind(*id)
            .fetch_optional(&mut session.conn)
            .await?;
        row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .transpose()
    }

    /// A prefix cannot be matched against the hashes the server keeps.
    fn list_refused(&self, prefix: &str) -> Option<&'static str> {
        (!prefix.is_empty()).then_some(
            "listing by key prefix (advisory locks keep only a hash of each key: \
             list with an empty prefix)",
        )
    }

    /// The held advisory locks of this database, by their ids (the server
    /// keeps only a hash of each key): plain locks (one-key form,
    /// exclusive) and read-write locks (two-key form), with their waiters;
    /// not semaphores, whose holders are queue entries (a prefix was
    /// refused by `list_refused`).
    ///
    /// Each page reads the server's whole lock table (`pg_locks`, every
    /// lock of every session), whatever its size: a listing of many held
    /// locks costs least with the largest page
    /// ([`MAX_LIST_PAGE`](dlock_core::backend::MAX_LIST_PAGE)).
    async fn list(
        &self,
        session: &mut PgSession,
        _prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Result<ListPage, &'static str>, sqlx::Error> {
        let (kind, id) = match after {
            None => (0, i64::MIN),
            Some(cursor) => match cursor
                .split_once(':')
                .and_then(|(k, i)| Some((k.parse::<i32>().ok()?, i.parse::<i64>().ok()?)))
            {
                Some(position) => position,
                // Starting again would list every lock twice.
                None => return Ok(Err("a list cursor this backend did not write")),
            },
        };
        let rows = sqlx::query(self.list.as_str())
            .bind(kind)
            .bind(id)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&mut session.conn)
            .await?;
        let mut locks: Vec<((i32, i64), Vec<Holder>, u32)> = Vec::new();
        for row in rows {
            let (kind, id): (i32, i64) = (row.try_get(0)?, row.try_get(1)?);
            let (mode, granted): (String, bool) = (row.try_get(2)?, row.try_get(3)?);
            if locks.last().is_none_or(|(at, _, _)| *at != (kind, id)) {
                locks.push(((kind, id), Vec::new(), 0));
            }
            let Some((_, holders, waiters)) = locks.last_mut() else {
                continue;
            };
            let mode = match (kind, mode.as_str()) {
                (1, _) => Mode::Exclusive,
                (_, "ShareLock") => Mode::Read,
                _ => Mode::Write,
            };
            if granted {
                holders.push(Holder::new(None, None).with_mode(mode));
            } else {
                *waiters += 1;
            }
        }
        let next = (locks.len() >= limit)
            .then(|| {
                locks
                    .last()
                    .map(|((kind, id), _, _)| format!("{kind}:{id}"))
            })
            .flatten()
            .map(ListCursor::new);
        let locks = locks
            .into_iter()
            .map(|((kind, id), holders, waiters)| {
                let form = if kind == 1 { "" } else { ", two-key form" };
                let key = ListedKey::Hashed(format!("advisory lock {id}{form}"));
                HeldLock::new(key, holders).with_waiters(waiters)
            })
            .collect();
        Ok(Ok(ListPage::new(locks, next)))
    }

    /// `pg_terminate_backend` of every other session of this database
    /// that holds the lock (one, as it is exclusive).
    async fn end_holder(&self, session: &mut PgSession, id: &i64) -> Result<bool, sqlx::Error> {
        let ended: i64 = sqlx::query_scalar(&self.end_holder)
            .bind(*id)
            .fetch_one(&mut session.conn)
            .await?;
        Ok(ended > 0)
    }

    /// `insufficient_privilege` (42501) from `pg_terminate_backend`.
    fn missing_right(&self, e: &sqlx::Error) -> Option<&'static str> {
        matches!(e, sqlx::Error::Database(e) if e.code().as_deref() == Some("42501")).then_some(
            "the holder's role, or membership in `pg_signal_backend` \
             (a superuser's session takes a superuser)",
        )
    }

    /// The connection failed, or the server ended the session (SQLSTATE
    /// class 08, connection exception, or 57, operator intervention: a
    /// shutdown, `pg_terminate_backend`, the idle session timeout), or
    /// the connection is no longer on its server session.
    fn ends_the_session(&self, e: &sqlx::Error) -> bool {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(e) => e
                .code()
                .is_some_and(|code| code.starts_with("08") || code.starts_with("57")),
            _ => false,
        }
    }
}
