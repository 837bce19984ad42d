//! Locks on the caller's own transaction or connection: the lock and the
//! data change commit together, as with sqlx's `PgAdvisoryLock`, on the
//! same identifiers and fencing sequence as the backend's own locks.

use std::fmt;

use dlock_core::{backend::Mode, LockError, LockKey, LostReason, Result};
use dlock_sql::{sqlx, Dialect, Refusal};
use sqlx::{
    pool::PoolConnection,
    postgres::{PgConnection, PgTransactionManager},
    Postgres, Transaction, TransactionManager,
};

use super::PgDialect;

fn sql_error(e: sqlx::Error) -> LockError {
    LockError::backend("postgres", e)
}

/// A failure of this module's own, saying `why`.
fn failed(why: &str) -> LockError {
    LockError::backend("postgres", std::io::Error::other(why.to_owned()))
}

/// A lock held by the caller's own transaction
/// ([`PgDialect::lock_in`]), freed by its commit or rollback and by
/// nothing else: a receipt, not a guard, whose drop changes nothing.
///
/// # Examples
///
/// ```no_run
/// use dlock_postgres::{sqlx::PgPool, PgBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = PgPool::connect("postgres://app@127.0.0.1:5432/app").await?;
/// let backend = PgBackend::from_pool(&pool).await?;
/// let mut tx = pool.begin().await?;
/// let lock = backend.lock_in(&mut tx, "order:42").await?;
/// sqlx::query("UPDATE orders SET state = 'paid', fence = $1 WHERE id = 42")
///     .bind(lock.fencing_token() as i64)
///     .execute(&mut *tx)
///     .await?;
/// tx.commit().await?; // the update and the unlock, together
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "the lock is held until the transaction ends; its fencing token is in here"]
pub struct TxLock {
    key: String,
    fence: u64,
}

impl TxLock {
    /// The key locked.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(backend: dlock_postgres::PgBackend, mut tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), dlock_core::LockError> {
    /// let lock = backend.lock_in(&mut tx, "order:42").await?;
    /// assert_eq!(lock.key(), "order:42");
    /// # Ok(())
    /// # }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The grant's fencing token, from the backend's fencing sequence:
    /// it orders this grant among every grant of the key, the backend's
    /// own locks included.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(backend: dlock_postgres::PgBackend, mut tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), dlock_core::LockError> {
    /// let lock = backend.lock_in(&mut tx, "order:42").await?;
    /// println!("fence {}", lock.fencing_token());
    /// # Ok(())
    /// # }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.fence
    }
}

/// A connection [`PgDialect::lock_on`] can own: a [`PgConnection`], or a
/// [`PoolConnection`] of the application's pool. Owned, it can be closed
/// (out of its pool) when its [`ConnLock`], or a waiting `lock_on`, is
/// dropped, which frees its session's locks; a borrowed one would go
/// back to its pool still holding the lock, or waiting for it.
pub trait CallerConnection: Send + private::Sealed {
    /// The connection statements run on.
    fn connection(&mut self) -> &mut PgConnection;

    /// The same, shared.
    fn connection_ref(&self) -> &PgConnection;

    /// Closes the connection, never returning it to a pool.
    fn discard(self);
}

mod private {
    pub trait Sealed {}
    impl Sealed for super::PgConnection {}
    impl Sealed for super::PoolConnection<super::Postgres> {}
}

impl CallerConnection for PgConnection {
    fn connection(&mut self) -> &mut PgConnection {
        self
    }

    fn connection_ref(&self) -> &PgConnection {
        self
    }

    /// Dropped: the socket closes, and the server ends the session.
    fn discard(self) {
        drop(self);
    }
}

impl CallerConnection for PoolConnection<Postgres> {
    fn connection(&mut self) -> &mut PgConnection {
        self
    }

    fn connection_ref(&self) -> &PgConnection {
        self
    }

    /// Detached from its pool, then dropped.
    fn discard(self) {
        drop(self.detach());
    }
}

/// A session-level advisory lock on a connection of the caller's
/// ([`PgDialect::lock_on`]), which it owns until
/// [`release`](ConnLock::release) hands it back; statements run on it
/// through `Deref` (`query.execute(&mut *lock)`). Dropped without
/// `release`, it closes the connection, which frees the lock.
#[must_use = "dropping the lock closes its connection; `release` gives the connection back"]
pub struct ConnLock<C: CallerConnection> {
    /// `None` once released.
    conn: Option<C>,
    key: String,
    id: i64,
    /// `None` until granted.
    fence: Option<u64>,
    /// The server session that locked (`pg_backend_pid()`).
    pid: i32,
}

impl<C: CallerConnection> fmt::Debug for ConnLock<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnLock")
            .field("key", &self.key)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

impl<C: CallerConnection> ConnLock<C> {
    /// The key locked.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(backend: dlock_postgres::PgBackend, conn: sqlx::PgConnection) -> Result<(), dlock_core::LockError> {
    /// let lock = backend.lock_on(conn, "migrations").await?;
    /// assert_eq!(lock.key(), "migrations");
    /// # let _conn = lock.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The grant's fencing token (see [`TxLock::fencing_token`]).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(backend: dlock_postgres::PgBackend, conn: sqlx::PgConnection) -> Result<(), dlock_core::LockError> {
    /// let lock = backend.lock_on(conn, "migrations").await?;
    /// println!("fence {}", lock.fencing_token());
    /// # let _conn = lock.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.fence.unwrap_or_default()
    }

    /// Unlocks (`pg_advisory_unlock`) and hands the connection back.
    ///
    /// # Errors
    ///
    /// [`LockError::Lost`] if the session no longer held the lock (a
    /// statement run through the lock called `pg_advisory_unlock_all`, or
    /// the connection reconnected); [`LockError::Backend`] if the
    /// statement failed. Either way the connection is closed, which frees
    /// whatever its session still held. Dropping this future before it
    /// completes closes it too.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(backend: dlock_postgres::PgBackend, conn: sqlx::PgConnection) -> Result<(), dlock_core::LockError> {
    /// let mut lock = backend.lock_on(conn, "migrations").await?;
    /// sqlx::query("CREATE TABLE IF NOT EXISTS t (id int)")
    ///     .execute(&mut *lock)
    ///     .await
    ///     .map_err(|e| dlock_core::LockError::backend("postgres", e))?;
    /// let conn = lock.release().await?; // unlocked; the connection is ours again
    /// # drop(conn);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn release(mut self) -> Result<C> {
        // Only on the server session that locked: through a pooler that
        // moves statements, another session's unlock would free nothing.
        let unlocked = sqlx::query_as::<_, (Option<bool>, i32)>(
            "SELECT CASE WHEN pg_backend_pid() = $2 THEN pg_advisory_unlock($1) END, \
             pg_backend_pid()",
        )
        .bind(self.id)
        .bind(self.pid)
        .fetch_one(&mut *self)
        .await;
        match unlocked {
            Ok((Some(true), _)) => self.conn.take().ok_or_else(|| failed("released twice")),
            Ok((Some(false), _)) => Err(LockError::Lost {
                key: self.key.clone(),
                reason: LostReason::NotHeld,
            }),
            Ok((None, found)) => Err(sql_error(
                Refusal::SessionMoved {
                    expected: u64::try_from(self.pid).unwrap_or_default(),
                    found: u64::try_from(found).unwrap_or_default(),
                }
                .into(),
            )),
            Err(e) => Err(sql_error(e)),
        }
    }
}

impl<C: CallerConnection> std::ops::Deref for ConnLock<C> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn
            .as_ref()
            .expect("held until released")
            .connection_ref()
    }
}

impl<C: CallerConnection> std::ops::DerefMut for ConnLock<C> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn
            .as_mut()
            .expect("held until released")
            .connection()
    }
}

impl<C: CallerConnection> Drop for ConnLock<C> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.fence.is_some() {
                tracing::warn!(
                    key = %self.key,
                    "dlock postgres: a connection lock dropped without release; \
                     closing its connection frees it"
                );
            }
            conn.discard();
        }
    }
}

impl PgDialect {
    /// The lock identifier of `key`'s plain lock, as the backend's own
    /// locks name it, and its fencing sequence as `regclass` text (bound
    /// as `$2`).
    fn caller_lock(&self, key: &str) -> Result<(LockKey, i64, &str)> {
        let key = LockKey::new(key)?;
        let id = self.lock_id(&key, Mode::Exclusive);
        let fence = self
            .caller_fence
            .get()
            .ok_or_else(|| failed("the fencing sequence's schema was not read at connect"))?;
        Ok((key, id, fence.as_str()))
    }

    /// Locks `key` in the caller's transaction, waiting as long as it
    /// takes: `pg_advisory_xact_lock`, and in the same statement the
    /// next fencing token. The transaction's commit or rollback frees it;
    /// the lock and the transaction's writes become visible together.
    ///
    /// It excludes the backend's own locks of `key` (the same identifier
    /// and fencing sequence) and every other session's, first come, first
    /// served; locking a key twice in one transaction is granted at once.
    /// It works through a pooler in transaction mode.
    ///
    /// Only at the transaction's top level: PostgreSQL frees a lock taken
    /// inside a savepoint when the savepoint is rolled back, so a nested
    /// transaction (`tx.begin()`) is refused with
    /// [`LockError::Unsupported`]. A savepoint made by your own SQL cannot
    /// be seen: do not lock inside one.
    ///
    /// A wait has no limit of its own: set `lock_timeout` in the
    /// transaction (`SET LOCAL lock_timeout = '5s'`), or use
    /// [`try_lock_in`](PgDialect::try_lock_in). Dropping this future does
    /// not end the wait: the transaction's next statement waits for the
    /// grant (or `lock_timeout`), and the lock is then the transaction's.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidKey`] for an empty or oversized key;
    /// [`LockError::Unsupported`] inside a nested transaction (a
    /// savepoint), with nothing sent; [`LockError::Backend`] if the
    /// statement fails (a deadlock the server detects, `lock_timeout`, a
    /// transaction already aborted).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use dlock_postgres::{sqlx::PgPool, PgBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPool::connect("postgres://app@127.0.0.1:5432/app").await?;
    /// let backend = PgBackend::from_pool(&pool).await?;
    /// let mut tx = pool.begin().await?;
    /// let lock = backend.lock_in(&mut tx, "stock:7").await?;
    /// sqlx::query("UPDATE stock SET n = n - 1 WHERE id = 7").execute(&mut *tx).await?;
    /// tx.rollback().await?; // no change, and the lock is free
    /// # drop(lock);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: impl AsRef<str>,
    ) -> Result<TxLock> {
        self.take_in(tx, key.as_ref(), true)
            .await?
            .ok_or_else(|| failed("no grant"))
    }

    /// Locks `key` in the caller's transaction if it is free now
    /// (`pg_try_advisory_xact_lock`): `None` if another holds it. As
    /// [`lock_in`](PgDialect::lock_in) otherwise.
    ///
    /// # Errors
    ///
    /// As [`lock_in`](PgDialect::lock_in).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(backend: dlock_postgres::PgBackend, mut tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), dlock_core::LockError> {
    /// match backend.try_lock_in(&mut tx, "report:daily").await? {
    ///     Some(lock) => println!("ours, fence {}", lock.fencing_token()),
    ///     None => println!("another transaction runs it"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_lock_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: impl AsRef<str>,
    ) -> Result<Option<TxLock>> {
        self.take_in(tx, key.as_ref(), false).await
    }

    /// `pg_advisory_xact_lock` (with `wait`) or `pg_try_advisory_xact_lock`
    /// on `key`, and the fence after the grant, in one statement.
    async fn take_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        key: &str,
        wait: bool,
    ) -> Result<Option<TxLock>> {
        let (key, id, sequence) = self.caller_lock(key)?;
        // sqlx counts the transactions it began on the connection: 1 is
        // the top level, more are savepoints.
        if PgTransactionManager::get_transaction_depth(&**tx) > 1 {
            return Err(LockError::Unsupported {
                backend: "postgres",
                what: "transaction lock inside a savepoint (a nested transaction), \
                       whose rollback would free it: lock in the outer transaction",
            });
        }
        // The subquery (kept apart by `OFFSET 0`) is granted before the
        // fence is taken: fences follow grants.
        let statement = if wait {
            "SELECT nextval($2::regclass) \
             FROM (SELECT pg_advisory_xact_lock($1) OFFSET 0) AS granted"
        } else {
            "SELECT CASE WHEN pg_try_advisory_xact_lock($1) THEN nextval($2::regclass) END"
        };
        let fence: Option<i64> = sqlx::query_scalar(statement)
            .bind(id)
            .bind(sequence)
            .fetch_one(&mut **tx)
            .await
            .map_err(sql_error)?;
        Ok(fence.map(|fence| TxLock {
            key: key.as_str().to_owned(),
            fence: fence as u64,
        }))
    }

    /// Locks `key` on the caller's connection, waiting as long as it
    /// takes: a session-level `pg_advisory_lock`, and in the same
    /// statement the next fencing token. The connection's session holds
    /// it across commits and rollbacks (to a savepoint too), in or out of
    /// a transaction, until [`ConnLock::release`], which hands the
    /// connection back.
    ///
    /// It excludes the backend's own locks of `key` and every other
    /// session's, first come, first served. Dropped unreleased, or dropped
    /// while this future waits, it closes the connection, which frees the
    /// lock. Not through a pooler in transaction mode.
    ///
    /// # Errors
    ///
    /// As [`lock_in`](PgDialect::lock_in); the connection is closed.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use dlock_postgres::{sqlx::PgPool, PgBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPool::connect("postgres://app@127.0.0.1:5432/app").await?;
    /// let backend = PgBackend::from_pool(&pool).await?;
    /// let mut lock = backend.lock_on(pool.acquire().await?, "migrations").await?;
    /// sqlx::query("CREATE TABLE IF NOT EXISTS seen (id int)").execute(&mut *lock).await?;
    /// let conn = lock.release().await?; // back to the pool when dropped
    /// # drop(conn);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_on<C: CallerConnection>(
        &self,
        conn: C,
        key: impl AsRef<str>,
    ) -> Result<ConnLock<C>> {
        match self.take_on(conn, key.as_ref(), true).await? {
            Ok(lock) => Ok(lock),
            Err(conn) => {
                conn.discard();
                Err(failed("no grant"))
            }
        }
    }

    /// Locks `key` on the caller's connection if it is free now
    /// (`pg_try_advisory_lock`). `Err(conn)` inside the `Ok` hands the
    /// connection back when another holds the key. As
    /// [`lock_on`](PgDialect::lock_on) otherwise.
    ///
    /// # Errors
    ///
    /// As [`lock_on`](PgDialect::lock_on); the connection is closed.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(backend: dlock_postgres::PgBackend, conn: sqlx::PgConnection) -> Result<(), dlock_core::LockError> {
    /// match backend.try_lock_on(conn, "report:daily").await? {
    ///     Ok(lock) => drop(lock.release().await?),
    ///     Err(conn) => drop(conn), // another session runs it
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn try_lock_on<C: CallerConnection>(
        &self,
        conn: C,
        key: impl AsRef<str>,
    ) -> Result<std::result::Result<ConnLock<C>, C>> {
        self.take_on(conn, key.as_ref(), false).await
    }

    /// `pg_advisory_lock` (with `wait`) or `pg_try_advisory_lock` on
    /// `key`, the fence after the grant, and the server session, in one
    /// statement; `Err(conn)` when refused.
    async fn take_on<C: CallerConnection>(
        &self,
        conn: C,
        key: &str,
        wait: bool,
    ) -> Result<std::result::Result<ConnLock<C>, C>> {
        let (key, id, sequence) = self.caller_lock(key)?;
        let statement = if wait {
            "SELECT nextval($2::regclass), pg_backend_pid() \
             FROM (SELECT pg_advisory_lock($1) OFFSET 0) AS granted"
        } else {
            "SELECT CASE WHEN pg_try_advisory_lock($1) THEN nextval($2::regclass) END, \
             pg_backend_pid()"
        };
        // Owned by the lock from here: dropped at any await, it closes.
        let mut lock = ConnLock {
            conn: Some(conn),
            key: key.as_str().to_owned(),
            id,
            fence: None,
            pid: 0,
        };
        let (fence, pid): (Option<i64>, i32) = sqlx::query_as(statement)
            .bind(id)
            .bind(sequence)
            .fetch_one(&mut *lock)
            .await
            .map_err(sql_error)?;
        lock.pid = pid;
        match (fence, lock.conn.take()) {
            (Some(fence), Some(conn)) => {
                lock.conn = Some(conn);
                lock.fence = Some(fence as u64);
                Ok(Ok(lock))
            }
            (None, Some(conn)) => Ok(Err(conn)),
            (_, None) => Err(failed("the connection went missing")),
        }
    }
}
