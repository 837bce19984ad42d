//! `MySqlBackend`: the `Backend` trait over MySQL's and MariaDB's named
//! locks (`GET_LOCK`), as a dialect of `dlock-sql`.

use std::{sync::OnceLock, time::Duration};

use dlock_core::{backend::BoxFuture, LockKey, Result};
use dlock_sql::{sqlx, Dialect, Granted, SqlBackend, SqlSettings};
use sqlx::{
    mysql::{MySqlConnection, MySqlDatabaseError},
    Connection, Executor, Row,
};

use crate::config::{lock_name, FenceSource, MySqlConfig};

/// `GET_LOCK`'s timeout for a wait without limit: a year, after which the
/// wait starts again (MariaDB answers a negative timeout at once).
const FOREVER_SECS: u64 = 365 * 24 * 3600;

/// A MySQL or MariaDB lock server: `GET_LOCK` named locks.
///
/// Build it with [`MySqlBackend::connect`] and turn it into a
/// [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker).
///
/// # How it locks
///
/// - **Names.** A key's lock is named `{lock_prefix}:` and the key,
///   escaped to lowercase-safe ASCII (names are compared without case);
///   a name over MySQL's 64 characters ends in a 64-bit hash of the key
///   instead (a collision costs a wait, never exclusion).
/// - **A few sessions hold every uncontended lock** (`holder_sessions`, 4
///   by default, each key always on the same one). An acquire is one round
///   trip: `GET_LOCK(name, 0)` and, in the same request, the fencing token
///   when it is granted. Release is `RELEASE_LOCK` on the session that
///   holds the lock. One session holds any number of locks (MySQL 5.7 and
///   MariaDB 10.0.2 and later).
/// - **Waiting is done by the server, first come, first served.** A
///   refused attempt takes a waiter session (at most `max_waiters`, reused)
///   and blocks in `GET_LOCK` with the wait limit as its timeout; nothing
///   polls. A wait that is dropped ends its session (`KILL CONNECTION`),
///   so a grant that arrives after the caller left cannot outlive it.
/// - **Within one process**, tasks that lock the same key queue locally
///   first: a session's named locks are reentrant on the server.
/// - **Crashes and pauses.** A killed holder's connection closes and its
///   locks go at once. A paused one's sessions are ended by the server
///   after `session_timeout` idle (`wait_timeout`, rounded up to whole
///   seconds); dlock keeps every session busy with one ping per third of
///   it, and counts each guard's lease from the last statement its session
///   answered, so a guard reports lost before the server can grant its
///   lock to another client.
/// - **Fencing tokens** come from `{lock_prefix}_fence`: a sequence on
///   MariaDB (`NEXTVAL`, in the acquire's statement), or a counter row on
///   MySQL (`UPDATE … SET v = LAST_INSERT_ID(v + 1)`, in the same
///   request), created at connect if missing. They increase across all
///   keys, so per key too. See [`FenceSource`].
/// - **Fixed leases**: the lock is released when the lease ends, by this
///   process; if the process dies first, its connection closes.
///
/// # Examples
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_mysql::MySqlBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = MySqlBackend::connect("mysql://app:secret@127.0.0.1:3306/app")
///     .await?
///     .into_locker();
/// let guard = locker.lock("report:daily").await?;
/// println!("fence {:?}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlBackend(SqlBackend<MySqlDialect>);

dlock_sql::forward_backend!(MySqlBackend);

impl MySqlBackend {
    /// Connects to the server of a `mysql://` URL (see [`MySqlConfig`]):
    /// opens a holder session and creates the fencing sequence or counter
    /// if it is missing.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](dlock_core::LockError::InvalidOptions)
    /// for a malformed URL;
    /// [`LockError::Backend`](dlock_core::LockError::Backend) if no session
    /// opens within the connect timeout, the login is refused, the URL
    /// names no database, or the fencing object cannot be created (or is
    /// not of the kind `fence=` asks for).
    pub async fn connect(url: &str) -> Result<MySqlBackend> {
        Self::connect_with(MySqlConfig::from_url(url)?).await
    }

    /// Connects with a prepared [`MySqlConfig`].
    ///
    /// # Errors
    ///
    /// As [`MySqlBackend::connect`].
    pub async fn connect_with(config: MySqlConfig) -> Result<MySqlBackend> {
        let object = format!("{}_fence", config.lock_prefix());
        let dialect = MySqlDialect {
            wait_timeout: config.session_timeout().as_secs()
                + u64::from(config.session_timeout().subsec_nanos() > 0),
            object,
            fence: OnceLock::new(),
            config,
        };
        SqlBackend::connect(dialect).await.map(MySqlBackend)
    }

    /// Where this backend's fencing tokens come from: decided at connect,
    /// never [`FenceSource::Auto`].
    pub fn fence_source(&self) -> FenceSource {
        self.0
            .dialect()
            .fence
            .get()
            .map_or(FenceSource::Auto, |f| f.source)
    }
}

/// MySQL's statements.
#[derive(Debug)]
struct MySqlDialect {
    config: MySqlConfig,
    /// The server's idle timeout, whole seconds.
    wait_timeout: u64,
    /// `{prefix}_fence`.
    object: String,
    /// Decided at connect.
    fence: OnceLock<Fence>,
}

/// The statements of one fencing source.
#[derive(Debug)]
struct Fence {
    source: FenceSource,
    /// Prepared, with the name bound: the attempt and the token.
    try_lock: Option<String>,
    /// Run after `SET @dlock_g = GET_LOCK(…)`, in the same request: takes
    /// the token if `@dlock_g = 1`, and leaves it for `token`.
    take: Option<String>,
    /// The token's expression in the final `SELECT`.
    token: String,
}

impl MySqlDialect {
    fn fence(&self) -> Result<&Fence, sqlx::Error> {
        self.fence
            .get()
            .ok_or_else(|| sqlx::Error::Protocol("dlock's fencing source is not set up".into()))
    }

    fn fence_for(&self, source: FenceSource) -> Fence {
        match source {
            FenceSource::Sequence => Fence {
                source,
                try_lock: Some(format!(
                    "SELECT IF(GET_LOCK(?, 0) = 1, NEXTVAL({}), NULL)",
                    self.object
                )),
                take: None,
                token: format!("IF(@dlock_g = 1, NEXTVAL({}), NULL)", self.object),
            },
            _ => Fence {
                source: FenceSource::Row,
                try_lock: None,
                take: Some(format!(
                    "UPDATE {} SET v = LAST_INSERT_ID(v + 1) WHERE id = 1 AND @dlock_g = 1; ",
                    self.object
                )),
                token: "IF(@dlock_g = 1, LAST_INSERT_ID(), NULL)".to_owned(),
            },
        }
    }

    /// One request: `GET_LOCK(name, timeout)` then, if granted, the token;
    /// answers the lock's state (1 granted, 0 timed out), the token, and
    /// the server's time on it in µs. Names are ASCII letters, digits and
    /// `-_.:/%#` only: safe inside quotes.
    fn get_lock(&self, fence: &Fence, name: &str, timeout: &str) -> String {
        let take = fence.take.as_deref().unwrap_or("");
        format!(
            "SET @dlock_t = SYSDATE(6); SET @dlock_g = GET_LOCK('{name}', {timeout}); {take}\
             SELECT @dlock_g, CAST({} AS SIGNED), TIMESTAMPDIFF(MICROSECOND, @dlock_t, SYSDATE(6))",
            fence.token
        )
    }
}

impl Dialect for MySqlDialect {
    type Conn = MySqlConnection;
    type Id = String;

    const NAME: &'static str = "mysql";

    fn settings(&self) -> &SqlSettings {
        self.config.settings()
    }

    fn lock_id(&self, key: &LockKey) -> String {
        lock_name(self.config.lock_prefix(), key)
    }

    fn shard(&self, id: &String) -> u64 {
        dlock_sql::fnv1a("", id)
    }

    fn open(&self) -> BoxFuture<'_, Result<(MySqlConnection, u64), sqlx::Error>> {
        Box::pin(async move {
            let mut conn = MySqlConnection::connect_with(self.config.connect_options()).await?;
            let opened = format!(
                "SET SESSION wait_timeout = {}; SELECT CAST(CONNECTION_ID() AS SIGNED)",
                self.wait_timeout.max(1)
            );
            let rows = conn.fetch_all(opened.as_str()).await?;
            let id: i64 = rows.last().ok_or(sqlx::Error::RowNotFound)?.try_get(0)?;
            Ok((conn, id as u64))
        })
    }

    fn setup<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let found: Option<(Option<String>, String)> = sqlx::query_as(
                "SELECT (SELECT TABLE_TYPE FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?), VERSION()",
            )
            .bind(&self.object)
            .fetch_optional(&mut *conn)
            .await?;
            let (existing, version) = found.ok_or(sqlx::Error::RowNotFound)?;
            let existing = existing.map(|kind| {
                if kind == "SEQUENCE" {
                    FenceSource::Sequence
                } else {
                    FenceSource::Row
                }
            });
            let wanted = self.config.fence();
            let source = match (wanted, existing) {
                (FenceSource::Auto, Some(existing)) => existing,
                (FenceSource::Auto, None) if version.contains("MariaDB") => FenceSource::Sequence,
                (FenceSource::Auto, None) => FenceSource::Row,
                (wanted, Some(existing)) if wanted != existing => {
                    return Err(sqlx::Error::Configuration(
                        format!(
                            "`{}` is already a {}, and `fence=` asks for a {}: \
                             every client of one prefix must take tokens from one source",
                            self.object,
                            if existing == FenceSource::Sequence {
                                "sequence"
                            } else {
                                "counter table"
                            },
                            if wanted == FenceSource::Sequence {
                                "sequence"
                            } else {
                                "counter row"
                            },
                        )
                        .into(),
                    ))
                }
                (wanted, _) => wanted,
            };
            let create = match source {
                FenceSource::Sequence => format!("CREATE SEQUENCE IF NOT EXISTS {}", self.object),
                _ => format!(
                    "CREATE TABLE IF NOT EXISTS {0} (id TINYINT PRIMARY KEY, v BIGINT NOT NULL) \
                     ENGINE = InnoDB; INSERT IGNORE INTO {0} VALUES (1, 0)",
                    self.object
                ),
            };
            conn.execute(create.as_str()).await?;
            let _ = self.fence.set(self.fence_for(source));
            Ok(())
        })
    }

    fn try_lock<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        id: &'a String,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        Box::pin(async move {
            let fence = self.fence()?;
            if let Some(statement) = &fence.try_lock {
                return sqlx::query_scalar::<_, Option<i64>>(statement.as_str())
                    .bind(id)
                    .fetch_one(conn)
                    .await;
            }
            let request = self.get_lock(fence, id, "0");
            let rows = conn.fetch_all(request.as_str()).await?;
            rows.last()
                .ok_or(sqlx::Error::RowNotFound)?
                .try_get::<Option<i64>, _>(1)
        })
    }

    fn wait<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        id: &'a String,
        limit: Option<Duration>,
    ) -> BoxFuture<'a, Result<Option<Granted>, sqlx::Error>> {
        Box::pin(async move {
            let fence = self.fence()?;
            let timeout = match limit {
                Some(limit) => format!("{:.6}", limit.as_secs_f64()),
                None => FOREVER_SECS.to_string(),
            };
            let request = self.get_lock(fence, id, &timeout);
            let rows = conn.fetch_all(request.as_str()).await?;
            let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
            match row.try_get::<Option<i64>, _>(0)? {
                Some(1) => {
                    let fence: Option<i64> = row.try_get(1)?;
                    let took_us: i64 = row.try_get(2)?;
                    Ok(Some(Granted {
                        fence: fence.ok_or(sqlx::Error::RowNotFound)?,
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

    fn unlock<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        id: &'a String,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let released = sqlx::query_scalar::<_, Option<i64>>("SELECT RELEASE_LOCK(?)")
                .bind(id)
                .fetch_one(conn)
                .await?;
            Ok(released == Some(1))
        })
    }

    fn end_session<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        session: u64,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            match conn
                .execute(format!("KILL CONNECTION {session}").as_str())
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

    fn ping<'a>(&'a self, conn: &'a mut MySqlConnection) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        conn.ping()
    }

    /// The connection failed, or the server ended the session: SQLSTATE
    /// class 08, `70100` (killed), or errors 1053 (shutdown), 1927
    /// (connection killed) and 4031 (idle timeout, MySQL 8).
    fn ends_the_session(&self, e: &sqlx::Error) -> bool {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(e) => {
                e.code()
                    .is_some_and(|code| code.starts_with("08") || code == "70100")
                    || e.try_downcast_ref::<MySqlDatabaseError>()
                        .is_some_and(|e| matches!(e.number(), 1053 | 1927 | 4031))
            }
            _ => false,
        }
    }
}
