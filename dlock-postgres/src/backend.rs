//! `PgBackend`: the `Backend` trait over PostgreSQL's session-level
//! advisory locks.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use dlock_core::{
    backend::{
        AcquireRequest, Acquired, Backend, BoxFuture, Capabilities, LeaseKind, ReleaseOutcome,
        RenewOutcome, RenewRequest, SessionHolders, Wait,
    },
    LockError, LockKey, LostReason, Result, Token,
};
use sqlx::{postgres::PgConnection, Connection, Executor, Row};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

use crate::config::{lock_id, PgConfig};

const NAME: &str = "postgres";

/// How long a key counts as contended after an attempt at it was refused:
/// its next waits skip the try on the holder session.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// SQLSTATE `lock_not_available`: a wait that ran into `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

fn backend_error(e: impl std::error::Error + Send + Sync + 'static) -> LockError {
    LockError::backend(NAME, e)
}

/// A PostgreSQL lock server: session-level advisory locks.
///
/// Build it with [`PgBackend::connect`] and turn it into a
/// [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker).
///
/// # How it locks
///
/// - **Identifiers.** A key maps to a 64-bit advisory lock identifier,
///   FNV-1a of the URL's `lock_prefix` and the key, so dlock's locks never
///   meet an application's own advisory locks by accident. Two keys whose
///   identifiers collide contend as if they were one: a collision costs a
///   wait, never exclusion.
/// - **A few sessions hold every uncontended lock.** Each key belongs to
///   one of `holder_sessions` holder sessions (4 by default), by its
///   identifier, so that tasks on different keys do not wait for one
///   connection. An acquire is one round trip on the key's holder session: `pg_try_advisory_lock`, and in the same
///   statement the next value of the fencing sequence when it is granted.
///   Release is `pg_advisory_unlock` on the session that holds the lock.
///   One session holds any number of locks (the server's shared lock
///   table bounds them: `max_locks_per_transaction × max_connections`).
/// - **Waiting is done by the server, first come, first served.** An
///   attempt that is refused (or any wait for a key refused in the last
///   second, which skips the try) takes a waiter session (at most
///   `max_waiters`, reused) and blocks in `pg_advisory_lock` there, with
///   the wait limit as `lock_timeout`. The server grants waiters in the
///   order they came, and the waiter session then holds the lock until its
///   release; nothing polls. A wait that is dropped ends its session
///   (`pg_terminate_backend`), so a grant that arrives after the caller
///   left cannot outlive it.
/// - **Within one process**, tasks that lock the same key queue locally
///   first: a session's advisory locks are reentrant on the server, and two
///   scopes must never both hold a key through one session.
/// - **Crashes and pauses.** A killed holder's connection closes and its
///   locks go at once. A paused one's sessions are ended by the server
///   after `session_timeout` idle (`idle_session_timeout`, PostgreSQL 14
///   and later); dlock keeps every session busy with one ping per third of
///   it (any statement counts), and counts each guard's lease from the
///   last statement its session answered, so a guard reports lost before
///   the server can grant its lock to another client.
/// - **Fencing tokens** come from one sequence, `{lock_prefix}_fence`,
///   created at connect if missing: they increase across all keys, so per
///   key too. A waiter's token is taken right after its grant, on the
///   session that holds it.
/// - **Fixed leases**: the lock is released when the lease ends, by this
///   process; if the process dies first, its connection closes.
///
/// # Examples
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_postgres::PgBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = PgBackend::connect("postgres://app@127.0.0.1:5432/app")
///     .await?
///     .into_locker();
/// let guard = locker.lock("report:daily").await?;
/// println!("fence {:?}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PgBackend {
    inner: Arc<Inner>,
}

struct Inner {
    config: PgConfig,
    /// `nextval('{prefix}_fence')`.
    fence_expr: String,
    /// The uncontended acquire: the lock, and the fence when granted.
    try_lock: String,
    /// The sessions that take uncontended locks, a key's always the same
    /// one (by its identifier); each replaced once it ends.
    holders: Vec<tokio::sync::Mutex<Option<Arc<Session>>>>,
    /// Waiter sessions that hold nothing, ready for the next wait.
    idle: Mutex<Vec<Arc<Session>>>,
    /// Bounds the waiter sessions.
    waiters: Arc<Semaphore>,
    /// Every held lock, by token.
    owned: Mutex<HashMap<Token, Owned>>,
    /// This process's turn per lock identifier.
    local: Mutex<HashMap<i64, Arc<Semaphore>>>,
    /// When an attempt at each identifier was last refused.
    contended: Mutex<HashMap<i64, Instant>>,
}

/// A lock this process holds.
struct Owned {
    session: Arc<Session>,
    id: i64,
    /// Held by the release in progress: a second release of the same token
    /// (a fixed lease's end and the caller's at once) runs after the first
    /// finished, and finds the lock gone, rather than unlocking a session
    /// that may hold the key again by then for someone else.
    releasing: Arc<tokio::sync::Mutex<()>>,
    _turn: OwnedSemaphorePermit,
    /// The waiter slot of a lock held on a waiter session.
    _slot: Option<OwnedSemaphorePermit>,
}

/// One server session: its connection, its backend PID, and the guards
/// whose locks it holds.
struct Session {
    /// `None` once the session ended: its connection is closed, and the
    /// server has released (or, if it cannot be reached, will release at
    /// its idle timeout) every lock it held.
    conn: tokio::sync::Mutex<Option<PgConnection>>,
    pid: i32,
    timeout: Duration,
    holders: SessionHolders<()>,
}

/// One statement's hold on a session's connection.
struct Live<'s> {
    conn: tokio::sync::MutexGuard<'s, Option<PgConnection>>,
    sent: Instant,
    session: &'s Session,
}

impl Live<'_> {
    fn conn(&mut self) -> &mut PgConnection {
        self.conn
            .as_mut()
            .expect("a live session has its connection")
    }

    /// Takes the statement's answer: a success proves the session alive
    /// when the statement was sent, which renews every guard on it; a
    /// failure of the connection ends the session and loses them.
    fn done<T>(
        mut self,
        answer: std::result::Result<T, sqlx::Error>,
    ) -> std::result::Result<T, sqlx::Error> {
        match &answer {
            Ok(_) => self
                .session
                .holders
                .renewed(self.sent, self.session.timeout),
            Err(e) if ends_the_session(e) => {
                self.session.holders.expire();
                *self.conn = None;
            }
            Err(_) => {}
        }
        answer
    }
}

/// Whether `e` means the session is gone: the connection failed, or the
/// server ended it (SQLSTATE class 08, connection exception, or 57,
/// operator intervention: a shutdown, `pg_terminate_backend`, the idle
/// session timeout).
fn ends_the_session(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57")),
        _ => false,
    }
}

/// Why a wait on the server gave no answer.
enum WaitFailed {
    /// Its session ended (or none could be opened): worth waiting again on
    /// a new one, with the turn at the key given back.
    SessionEnded(LockError, OwnedSemaphorePermit),
    /// Anything else: the caller's error.
    Other(LockError),
}

/// Retries a step whose session ended (a server restart, a cut
/// connection) on a new one, with backoff, until the wait limit, or for
/// the connect timeout when there is none.
struct Retry {
    give_up: Option<Instant>,
    backoff: Duration,
}

impl Retry {
    fn new(wait: Wait, connect_timeout: Duration) -> Retry {
        Retry {
            give_up: match wait {
                Wait::Forever => None,
                wait => wait.deadline(),
            }
            .or_else(|| Some(Instant::now() + connect_timeout)),
            backoff: Duration::from_millis(50),
        }
    }

    /// Sleeps before the next try, or gives `error` back if none is left.
    async fn after(&mut self, error: LockError) -> Result<()> {
        let now = Instant::now();
        if self.give_up.is_some_and(|g| now + self.backoff >= g) {
            return Err(error);
        }
        tracing::debug!(%error, "dlock postgres session ended; trying a new one");
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(Duration::from_millis(500));
        Ok(())
    }
}

impl fmt::Debug for PgBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgBackend")
            .field("prefix", &self.inner.config.lock_prefix())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Session {
    /// Opens a session: the connection, its idle timeout and its PID.
    async fn open(config: &PgConfig) -> Result<Arc<Session>> {
        let timeout = config.session_timeout();
        let opened = tokio::time::timeout(config.connect_timeout(), async {
            let mut conn = PgConnection::connect_with(config.connect_options()).await?;
            let row = sqlx::query(
                "SELECT pg_backend_pid(), set_config('idle_session_timeout', $1, false), \
                 set_config('client_connection_check_interval', '1000', false)",
            )
            .bind(timeout.as_millis().to_string())
            .fetch_one(&mut conn)
            .await?;
            let pid: i32 = row.try_get(0)?;
            Ok::<_, sqlx::Error>((conn, pid))
        })
        .await;
        let (conn, pid) = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => return Err(backend_error(e)),
            Err(_) => {
                return Err(backend_error(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no PostgreSQL session within the connect timeout ({:?})",
                        config.connect_timeout()
                    ),
                )))
            }
        };
        let session = Arc::new(Session {
            conn: tokio::sync::Mutex::new(Some(conn)),
            pid,
            timeout,
            holders: SessionHolders::new(Instant::now()),
        });
        tokio::spawn(keep_alive(Arc::downgrade(&session)));
        Ok(session)
    }

    /// The session's connection, for one statement, and the time it is
    /// sent; `None` if the session ended. Pass the statement's answer to
    /// [`Live::done`].
    async fn live(&self) -> std::result::Result<Live<'_>, sqlx::Error> {
        let conn = self.conn.lock().await;
        if conn.is_none() || self.holders.is_expired() {
            return Err(sqlx::Error::PoolClosed);
        }
        Ok(Live {
            conn,
            sent: Instant::now(),
            session: self,
        })
    }

    /// Ends the session: every guard on it is lost, and its connection is
    /// closed once no statement runs on it (a waiter's blocked statement
    /// is ended from another session, see `EndOnDrop`).
    fn end(self: &Arc<Self>) {
        self.holders.expire();
        let session = self.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                session.conn.lock().await.take();
            });
        }
    }

    fn is_usable(&self) -> bool {
        !self.holders.is_expired()
    }
}

/// Pings the session once a third of its timeout has passed without a
/// statement, so that the server never finds it idle for the timeout
/// while this process runs. Ends with the session.
async fn keep_alive(session: Weak<Session>) {
    loop {
        let Some(s) = session.upgrade() else { return };
        if s.holders.is_expired() {
            return;
        }
        let tick = s.timeout / 3;
        let quiet_since = s.holders.renewed_at();
        drop(s);
        tokio::time::sleep_until(quiet_since + tick).await;
        let Some(s) = session.upgrade() else { return };
        if s.holders.renewed_at() > quiet_since {
            continue;
        }
        let pinged = match s.live().await {
            Ok(mut live) => {
                let answer = live.conn().ping().await;
                live.done(answer)
            }
            Err(e) => Err(e),
        };
        if let Err(error) = pinged {
            tracing::debug!(%error, pid = s.pid, "dlock postgres session ended");
            s.end();
            return;
        }
    }
}

impl PgBackend {
    /// Connects to the server of a `postgres://` URL (see [`PgConfig`]):
    /// opens the holder session and creates the fencing sequence if it is
    /// missing.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a malformed URL;
    /// [`LockError::Backend`] if no session opens within the connect
    /// timeout, the login is refused, or the sequence cannot be created.
    pub async fn connect(url: &str) -> Result<PgBackend> {
        Self::connect_with(PgConfig::from_url(url)?).await
    }

    /// Connects with a prepared [`PgConfig`].
    ///
    /// # Errors
    ///
    /// As [`PgBackend::connect`].
    pub async fn connect_with(config: PgConfig) -> Result<PgBackend> {
        let sequence = format!("{}_fence", config.lock_prefix());
        let backend = PgBackend {
            inner: Arc::new(Inner {
                waiters: Arc::new(Semaphore::new(config.max_waiters())),
                fence_expr: format!("nextval('{sequence}')"),
                try_lock: format!(
                    "SELECT CASE WHEN pg_try_advisory_lock($1) THEN nextval('{sequence}') END"
                ),
                holders: (0..config.holder_sessions())
                    .map(|_| tokio::sync::Mutex::new(None))
                    .collect(),
                idle: Mutex::new(Vec::new()),
                owned: Mutex::new(HashMap::new()),
                local: Mutex::new(HashMap::new()),
                contended: Mutex::new(HashMap::new()),
                config,
            }),
        };
        let holder = backend.holder(0).await?;
        let create = format!("CREATE SEQUENCE IF NOT EXISTS {sequence}");
        let created = match holder.live().await {
            Ok(mut live) => {
                let answer = live.conn().execute(create.as_str()).await;
                live.done(answer)
            }
            Err(e) => Err(e),
        };
        match created {
            Ok(_) => {}
            // Two clients creating it at once: one of them is told it
            // exists (unique_violation or duplicate_table). It does now.
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("23505" | "42P07")) => {}
            Err(e) => return Err(backend_error(e)),
        }
        Ok(backend)
    }

    /// The holder session of lock `id`, opened again if it ended.
    async fn holder(&self, id: i64) -> Result<Arc<Session>> {
        let slots = &self.inner.holders;
        let mut holder = slots[(id as u64 % slots.len() as u64) as usize]
            .lock()
            .await;
        if let Some(session) = holder.as_ref().filter(|s| s.is_usable()) {
            return Ok(session.clone());
        }
        let session = Session::open(&self.inner.config).await?;
        *holder = Some(session.clone());
        Ok(session)
    }

    /// A waiter session that holds nothing: an idle one, or a new one.
    async fn waiter_session(&self) -> Result<Arc<Session>> {
        loop {
            let Some(session) = lock(&self.inner.idle).pop() else {
                return Session::open(&self.inner.config).await;
            };
            if session.is_usable() {
                return Ok(session);
            }
        }
    }

    /// This process's turn at `id`; `None` if `wait` ran out first.
    async fn local_turn(&self, id: i64, wait: Wait) -> Option<OwnedSemaphorePermit> {
        let queue = lock(&self.inner.local)
            .entry(id)
            .or_insert_with(|| Arc::new(Semaphore::new(1)))
            .clone();
        match wait {
            Wait::No => queue.try_acquire_owned().ok(),
            Wait::Until(deadline) => tokio::time::timeout_at(deadline, queue.acquire_owned())
                .await
                .ok()?
                .ok(),
            Wait::Forever => queue.acquire_owned().await.ok(),
        }
    }

    /// Forgets the turn queue of `id` once nobody uses it.
    fn sweep_local(&self, id: i64) {
        let mut local = lock(&self.inner.local);
        if local.get(&id).is_some_and(|q| Arc::strong_count(q) == 1) {
            local.remove(&id);
        }
    }

    async fn acquire_inner(&self, req: &AcquireRequest<'_>) -> Result<Option<Acquired>> {
        let id = lock_id(self.inner.config.lock_prefix(), req.key.as_str());
        let Some(turn) = self.local_turn(id, req.wait).await else {
            self.sweep_local(id);
            return Ok(None);
        };
        let mut retry = Retry::new(req.wait, self.inner.config.connect_timeout());
        let mut turn = turn;
        loop {
            // Refused a moment ago: the try would most likely be refused
            // again, so wait on the server at once (one statement less).
            if req.wait == Wait::No || !self.recently_contended(id) {
                let (holder, sent, fence, back) = self.try_on_holder(id, turn, &mut retry).await?;
                if let Some(fence) = fence {
                    return self.granted(req, holder, id, back, None, sent, fence);
                }
                turn = back;
                self.mark_contended(id);
                if req.wait == Wait::No {
                    return Ok(None);
                }
            }
            match self.wait_on_server(req, id, turn).await {
                Ok(outcome) => return Ok(outcome),
                // The waiter session ended (a server restart, a cut
                // connection): wait again on a new one, within the limit.
                Err(WaitFailed::SessionEnded(error, back)) => {
                    retry.after(error).await?;
                    turn = back;
                }
                Err(WaitFailed::Other(error)) => return Err(error),
            }
        }
    }

    /// One uncontended attempt on `id`'s holder session, on a new session
    /// if it ended (within `retry`): the session, when the attempt was sent,
    /// the fence if granted, and the turn back.
    async fn try_on_holder(
        &self,
        id: i64,
        mut turn: OwnedSemaphorePermit,
        retry: &mut Retry,
    ) -> Result<(Arc<Session>, Instant, Option<i64>, OwnedSemaphorePermit)> {
        loop {
            let holder = match self.holder(id).await {
                Ok(holder) => holder,
                Err(e) => {
                    retry.after(e).await?;
                    continue;
                }
            };
            let mut undo = UnlockOnDrop {
                session: Some(holder.clone()),
                id,
                turn: Some(turn),
            };
            let answer = async {
                let mut live = holder.live().await?;
                let sent = live.sent;
                let answer = sqlx::query_scalar::<_, Option<i64>>(self.inner.try_lock.as_str())
                    .bind(id)
                    .fetch_one(live.conn())
                    .await;
                live.done(answer).map(|fence| (sent, fence))
            }
            .await;
            // Answered (or never sent): nothing to undo.
            undo.session = None;
            turn = undo.turn.take().expect("the turn is ours until answered");
            match answer {
                Ok((sent, fence)) => return Ok((holder, sent, fence, turn)),
                // The session ended (the server restarted, the connection
                // was cut): its locks went with it; try on a new one.
                Err(e) if !holder.is_usable() => retry.after(backend_error(e)).await?,
                Err(e) => return Err(backend_error(e)),
            }
        }
    }

    /// Whether an attempt at `id` was refused within [`CONTENDED_FOR`].
    fn recently_contended(&self, id: i64) -> bool {
        lock(&self.inner.contended)
            .get(&id)
            .is_some_and(|at| at.elapsed() < CONTENDED_FOR)
    }

    /// Remembers that an attempt at `id` was refused now; forgets keys
    /// not refused for a while once there are many.
    fn mark_contended(&self, id: i64) {
        let mut contended = lock(&self.inner.contended);
        if contended.len() >= 1024 {
            contended.retain(|_, at| at.elapsed() < CONTENDED_FOR);
        }
        contended.insert(id, Instant::now());
    }

    /// Blocks in `pg_advisory_lock` on a waiter session until the server
    /// grants the lock or the wait limit passes.
    async fn wait_on_server(
        &self,
        req: &AcquireRequest<'_>,
        id: i64,
        turn: OwnedSemaphorePermit,
    ) -> std::result::Result<Option<Acquired>, WaitFailed> {
        let deadline = req.wait.deadline();
        let slot = self.inner.waiters.clone();
        let slot = match deadline {
            Some(d) => match tokio::time::timeout_at(d, slot.acquire_owned()).await {
                Ok(slot) => slot,
                Err(_) => return Ok(None),
            },
            None => slot.acquire_owned().await,
        }
        .map_err(|e| WaitFailed::Other(backend_error(e)))?;
        let session = match self.waiter_session().await {
            Ok(session) => session,
            Err(error) => return Err(WaitFailed::SessionEnded(error, turn)),
        };
        // Ends the session if this future is dropped mid-wait: the server
        // may grant the lock to it at any moment, and nobody would release.
        let mut abandon = EndOnDrop {
            backend: self.clone(),
            session: Some(session.clone()),
        };
        let lock_timeout = match deadline {
            None => 0,
            Some(d) => d
                .saturating_duration_since(Instant::now())
                .as_millis()
                .max(1),
        };
        // One round trip: the wait, then (a statement of its own, so only
        // after the grant) the token, and how long the server took since
        // it received the query. Our send time plus that is no later than
        // the server's: the lease counts from there, and the server counts
        // the session's idle time from the query's end, later still.
        let wait = format!(
            "SET lock_timeout = {lock_timeout}; SELECT pg_advisory_lock({id}); \
             SELECT {}, (extract(epoch FROM clock_timestamp() - statement_timestamp()) \
             * 1000000)::bigint; SET lock_timeout = 0",
            self.inner.fence_expr
        );
        let waited = match session.live().await {
            Ok(mut live) => {
                let sent = live.sent;
                let answer = live.conn().fetch_all(wait.as_str()).await;
                live.done(answer).map(|rows| (sent, rows))
            }
            Err(e) => Err(e),
        };
        let (sent, rows) = match waited {
            Ok(answer) => answer,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                // Not granted: the session is as it was, ready for another
                // wait (its `lock_timeout` is set again at the next one).
                abandon.session = None;
                self.put_idle(session);
                drop(turn);
                self.sweep_local(id);
                return Ok(None);
            }
            Err(e) if !session.is_usable() => {
                return Err(WaitFailed::SessionEnded(backend_error(e), turn))
            }
            Err(e) => return Err(WaitFailed::Other(backend_error(e))),
        };
        let granted = rows
            .last()
            .ok_or_else(|| sqlx::Error::RowNotFound)
            .and_then(|row| Ok((row.try_get::<i64, _>(0)?, row.try_get::<i64, _>(1)?)));
        let (fence, waited_us) = granted.map_err(|e| WaitFailed::Other(backend_error(e)))?;
        let sent = sent + Duration::from_micros(u64::try_from(waited_us).unwrap_or(0));
        abandon.session = None;
        self.granted(req, session, id, turn, Some(slot), sent, fence)
            .map_err(WaitFailed::Other)
    }

    #[allow(clippy::too_many_arguments)]
    fn granted(
        &self,
        req: &AcquireRequest<'_>,
        session: Arc<Session>,
        id: i64,
        turn: OwnedSemaphorePermit,
        slot: Option<OwnedSemaphorePermit>,
        sent: Instant,
        fence: i64,
    ) -> Result<Option<Acquired>> {
        let fixed_end = (req.lease_kind == LeaseKind::Fixed).then(|| sent + req.lease);
        let Some(confirmed_at) = session
            .holders
            .hold(*req.token, req.loss.clone(), fixed_end, ())
        else {
            return Err(backend_error(std::io::Error::other(
                "the session ended as the lock was granted",
            )));
        };
        lock(&self.inner.owned).insert(
            *req.token,
            Owned {
                session: session.clone(),
                id,
                releasing: Arc::default(),
                _turn: turn,
                _slot: slot,
            },
        );
        let alive_at = confirmed_at.max(sent);
        let acquired = Acquired::new(sent)
            .with_fence(u64::try_from(fence).unwrap_or(0))
            .kept_alive_by_backend();
        Ok(Some(match fixed_end {
            None => acquired.with_lease_from(alive_at, session.timeout),
            Some(ends) => {
                // Advisory locks have no TTL: end the lease here.
                let (backend, token) = (self.clone(), *req.token);
                tokio::spawn(async move {
                    tokio::time::sleep_until(ends).await;
                    let _ = backend.unlock(&token).await;
                });
                if alive_at + session.timeout < ends {
                    acquired.with_lease_from(alive_at, session.timeout)
                } else {
                    acquired.with_lease_from(sent, req.lease)
                }
            }
        }))
    }

    /// Returns a waiter session that holds nothing to the idle ones.
    fn put_idle(&self, session: Arc<Session>) {
        if session.is_usable() {
            let mut idle = lock(&self.inner.idle);
            if idle.len() < self.inner.config.max_waiters() {
                idle.push(session);
            }
        }
    }

    /// Releases the lock `token` holds, on the session that holds it. The
    /// lock is forgotten only once the server answered: a release cut off
    /// half-way is sent again by core, and finds it still there.
    async fn unlock(&self, token: &Token) -> Result<ReleaseOutcome> {
        let Some(releasing) = lock(&self.inner.owned)
            .get(token)
            .map(|o| o.releasing.clone())
        else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let _one_at_a_time = releasing.lock().await;
        // Read again: a release that ran first has forgotten it.
        let Some((session, id)) = lock(&self.inner.owned)
            .get(token)
            .map(|o| (o.session.clone(), o.id))
        else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let released = if session.is_usable() {
            let unlocked = match session.live().await {
                Ok(mut live) => {
                    let answer = sqlx::query_scalar::<_, bool>("SELECT pg_advisory_unlock($1)")
                        .bind(id)
                        .fetch_one(live.conn())
                        .await;
                    live.done(answer)
                }
                Err(e) => Err(e),
            };
            match unlocked {
                Ok(released) => released,
                // The session ended meanwhile: its locks went with it.
                Err(_) if !session.is_usable() => false,
                Err(e) => return Err(backend_error(e)),
            }
        } else {
            // The session ended, and its locks with it; its guards were told.
            false
        };
        let owned = lock(&self.inner.owned).remove(token);
        session.holders.forget(token, LostReason::NotHeld);
        let on_waiter_session = owned.as_ref().is_some_and(|o| o._slot.is_some());
        drop(owned);
        self.sweep_local(id);
        if on_waiter_session {
            self.put_idle(session);
        }
        Ok(if released {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        })
    }
}

/// Undoes an uncontended attempt on the holder session that was dropped
/// before its answer was read: the server may have granted the lock to
/// the session, with nobody to release it. Keeps this process's turn at
/// the key until the unlock ran after the attempt (the session runs one
/// statement at a time, in order), so no other task's grant of the same
/// key on that session is undone instead.
struct UnlockOnDrop {
    session: Option<Arc<Session>>,
    id: i64,
    turn: Option<OwnedSemaphorePermit>,
}

impl Drop for UnlockOnDrop {
    fn drop(&mut self) {
        let (Some(session), Some(turn)) = (self.session.take(), self.turn.take()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send it from: end the session instead, when
            // it is dropped with its connection.
            session.holders.expire();
            return;
        };
        let id = self.id;
        runtime.spawn(async move {
            if let Ok(mut live) = session.live().await {
                let answer = sqlx::query("SELECT pg_advisory_unlock($1)")
                    .bind(id)
                    .execute(live.conn())
                    .await;
                if live.done(answer).is_err() && session.is_usable() {
                    session.end();
                }
            }
            drop(turn);
        });
    }
}

/// Ends a waiter session whose wait was dropped: from another session,
/// `pg_terminate_backend` (the dropped statement may still hold its
/// connection), and the connection goes with the session.
struct EndOnDrop {
    backend: PgBackend,
    session: Option<Arc<Session>>,
}

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        session.end();
        let backend = self.backend.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let pid = session.pid;
            let ended = match backend.holder(i64::from(pid)).await {
                Ok(holder) => match holder.live().await {
                    Ok(mut live) => {
                        let answer = sqlx::query("SELECT pg_terminate_backend($1)")
                            .bind(pid)
                            .execute(live.conn())
                            .await;
                        live.done(answer).map(drop).map_err(backend_error)
                    }
                    Err(e) => Err(backend_error(e)),
                },
                Err(e) => Err(e),
            };
            if let Err(error) = ended {
                // Its connection still closes when the session is dropped,
                // and the server ends the session when it notices.
                tracing::debug!(%error, pid, "dlock postgres could not end an abandoned wait");
            }
        });
    }
}

impl Backend for PgBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .fencing(true)
            .fifo(true)
            .session_leases(true)
    }

    fn acquire<'a>(&'a self, req: AcquireRequest<'a>) -> BoxFuture<'a, Result<Option<Acquired>>> {
        Box::pin(async move { self.acquire_inner(&req).await })
    }

    fn release<'a>(
        &'a self,
        _key: &'a LockKey,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move { self.unlock(token).await })
    }

    /// Ends the session that holds the token's lock: the server releases
    /// every lock on it at once. The other guards on it are lost, and later
    /// acquisitions open a new session.
    fn abandon<'a>(&'a self, _key: &'a LockKey, token: &'a Token) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Some(owned) = lock(&self.inner.owned).remove(token) else {
                return;
            };
            owned.session.end();
            let id = owned.id;
            drop(owned);
            self.sweep_local(id);
        })
    }

    fn renew<'a>(&'a self, locks: &'a [RenewRequest]) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        // Locks live on sessions that their keepalive renews.
        Box::pin(async move {
            let owned = lock(&self.inner.owned);
            Ok(locks
                .iter()
                .map(|l| match owned.get(&l.token) {
                    Some(o) if o.session.is_usable() => RenewOutcome::Renewed,
                    _ => RenewOutcome::NotHeld,
                })
                .collect())
        })
    }

    /// A statement on the holder session (opening one if it ended).
    fn check_servers(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let holder = self.holder(0).await?;
            let mut live = holder.live().await.map_err(backend_error)?;
            let answer = live.conn().ping().await;
            live.done(answer).map_err(backend_error)
        })
    }
}
