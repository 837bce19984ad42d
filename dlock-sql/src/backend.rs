//! `SqlBackend`: the `Backend` trait over a database's session-level
//! named locks, whatever the server, through a [`Dialect`].

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use dlock_core::{
    backend::{
        unsupported_holder, AcquireRequest, Acquired, Backend, Backoff, BoxFuture, Capabilities,
        Holder, LeaseKind, LeaseTimers, Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
        SessionHolders, Wait,
    },
    LockError, LockKey, LostReason, Result, Token,
};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

use crate::{Dialect, Granted};

mod queue;

/// The permits of a key's local turn: a reader takes one, so that readers
/// of one process share the key (their session holds it shared, once per
/// reader), and any other mode takes them all.
const TURN: u32 = 1 << 16;

fn turn_weight(mode: Mode) -> u32 {
    if mode == Mode::Read {
        1
    } else {
        TURN
    }
}

/// How long a key counts as contended after an attempt at it was refused:
/// its next waits skip the try on the holder session.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// A database lock server, through dialect `D`: see the backend crates
/// (`dlock-postgres`, `dlock-mysql`) for how each server locks.
///
/// - **A few sessions hold every uncontended lock.** Each key belongs to
///   one of `holder_sessions` holder sessions, by its identifier, so that
///   tasks on different keys do not wait for one connection. An acquire is
///   one round trip on the key's holder session: the attempt, and the
///   fencing token when it is granted. Release is one statement on the
///   session that holds the lock.
/// - **Waiting is done by the server, first come, first served.** An
///   attempt that is refused (or any wait for a key refused in the last
///   second, which skips the try) takes a waiter session (at most
///   `max_waiters`, reused) and blocks on the server there, with the wait
///   limit as the statement's timeout; nothing polls. The waiter session
///   then holds the lock until its release (a connection per such lock),
///   and gives its waiter slot back at the grant: `max_waiters` bounds
///   waits, not holds. A wait that is dropped ends its
///   session from another one, so a grant that arrives after the caller
///   left cannot outlive it; an attempt dropped in flight is unlocked after
///   it, by the statement's own task and only if the server granted it.
/// - **Every undo matches its effect.** A session's holds of one key stack
///   on the server (readers of one process share a session), so an unlock
///   for a hold the session was never granted would remove another one's.
///   An attempt's undo is armed from the server's answer, and a release
///   takes its lock out of the books right before its statement is sent:
///   a release cut off after that runs to its end, and the next one finds
///   nothing to send.
/// - **A dropped future never cuts a statement half-way** on a session
///   that holds locks: once sent, the statement runs to its end in a task
///   of its own, and the next one on the session follows it. A connection
///   left in the middle of an answer would hand the rest of it to another
///   lock's statement, or be cut by the server, with every lock on it (a
///   MariaDB run without this lost a bystander's lock in 2 of 4 runs of
///   `dropped_futures_cost_the_clients_other_locks_nothing`).
/// - **Within one process**, tasks that lock the same key queue locally
///   first: a session's locks are reentrant on the server, and two scopes
///   must never both hold a key through one session.
/// - **Crashes and pauses.** A killed holder's connection closes and its
///   locks go at once. A paused one's sessions are ended by the server
///   after `session_timeout` idle; every session here is kept busy with one
///   ping per third of it (any statement counts), and each guard's lease
///   counts from the last statement its session answered, so a guard
///   reports lost before the server can grant its lock to another client.
/// - **Fixed leases** are ended by this process; if it dies first, its
///   connection closes.
///
/// # Examples
///
/// Built by a backend crate, for example `dlock_postgres::PgBackend`.
///
/// ```text
/// let backend: SqlBackend<PgDialect> = SqlBackend::connect(dialect).await?;
/// ```
pub struct SqlBackend<D: Dialect> {
    inner: Arc<Inner<D>>,
}

impl<D: Dialect> Clone for SqlBackend<D> {
    fn clone(&self) -> Self {
        SqlBackend {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<D: Dialect> {
    dialect: Arc<D>,
    /// The sessions that take uncontended locks, a key's always the same
    /// one (by its identifier); each replaced once it ends.
    holders: Vec<tokio::sync::Mutex<Option<Arc<Session<D>>>>>,
    /// Waiter sessions that hold nothing, ready for the next wait.
    idle: Mutex<Vec<Arc<Session<D>>>>,
    /// Bounds the waiter sessions.
    waiters: Arc<Semaphore>,
    /// Every held lock, by token.
    owned: Mutex<HashMap<Token, Owned<D>>>,
    /// This process's turn per lock identifier.
    local: Mutex<HashMap<D::Id, Arc<Semaphore>>>,
    /// When an attempt at each identifier was last refused.
    contended: Mutex<HashMap<D::Id, Instant>>,
    /// Ends fixed leases (session locks have no TTL): one task for all.
    lease_ends: LeaseTimers,
}

/// A lock this process holds.
struct Owned<D: Dialect> {
    session: Arc<Session<D>>,
    id: D::Id,
    mode: Mode,
    /// Held by the release in progress: a second release of the same token
    /// (a fixed lease's end and the caller's at once) runs after the first
    /// finished, and finds the lock gone, rather than unlocking a session
    /// that may hold the key again by then for someone else.
    releasing: Arc<tokio::sync::Mutex<()>>,
    /// This process's turn at the key (none for a queued mode, whose
    /// entries never share a session lock).
    _turn: Option<OwnedSemaphorePermit>,
    /// When a fixed lease ends: the lock is not renewable from then on,
    /// though its release (sent then) may not have been answered yet.
    fixed_end: Option<Instant>,
    /// Whether the lock is held on a waiter session (won by waiting),
    /// which holds nothing else: back to the idle ones once released. Its
    /// waiter slot was given back at the grant.
    on_waiter: bool,
    /// The fencing token of the grant.
    fence: i64,
    /// The token a queued mode's entry is named for: the lock's own, or
    /// a retry's new one.
    entry: Token,
    /// Whether the hold was recorded in the holders' table (by a proclaim):
    /// its release deletes the record first.
    proclaimed: bool,
}

/// One server session: its connection, the server's identifier of it, and
/// the guards whose locks it holds.
struct Session<D: Dialect> {
    dialect: Arc<D>,
    /// `None` once the session ended: its connection is closed, and the
    /// server has released (or, if it cannot be reached, will release at
    /// its idle timeout) every lock it held.
    conn: Arc<tokio::sync::Mutex<Option<D::Conn>>>,
    server_id: u64,
    timeout: Duration,
    holders: SessionHolders<()>,
}

/// One statement's hold on a session's connection.
struct Live<D: Dialect> {
    conn: tokio::sync::OwnedMutexGuard<Option<D::Conn>>,
    sent: Instant,
    session: Arc<Session<D>>,
}

impl<D: Dialect> Live<D> {
    fn conn(&mut self) -> &mut D::Conn {
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
            Err(e) if self.session.dialect.ends_the_session(e) => {
                self.session.holders.expire();
                *self.conn = None;
            }
            Err(_) => {}
        }
        answer
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
    backoff: Backoff,
}

impl Retry {
    fn new(wait: Wait, connect_timeout: Duration) -> Retry {
        Retry {
            give_up: match wait {
                Wait::Forever => None,
                wait => wait.deadline(),
            }
            .or_else(|| Some(Instant::now() + connect_timeout)),
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_millis(500)),
        }
    }

    /// Sleeps before the next try, or gives `error` back if none is left.
    async fn after(&mut self, error: LockError) -> Result<()> {
        let now = Instant::now();
        let delay = self.backoff.next_delay();
        if self.give_up.is_some_and(|g| now + delay >= g) {
            return Err(error);
        }
        tracing::debug!(%error, "dlock database session ended; trying a new one");
        tokio::time::sleep(delay).await;
        Ok(())
    }
}

impl<D: Dialect> fmt::Debug for SqlBackend<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlBackend")
            .field("server", &D::NAME)
            .field("prefix", &self.inner.dialect.settings().lock_prefix())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn backend_error<D: Dialect>(e: impl std::error::Error + Send + Sync + 'static) -> LockError {
    LockError::backend(D::NAME, e)
}

impl<D: Dialect> Session<D> {
    /// Opens a session, with the server's idle timeout set.
    async fn open(dialect: &Arc<D>) -> Result<Arc<Session<D>>> {
        let settings = dialect.settings();
        let timeout = settings.session_timeout();
        let (conn, server_id) =
            match tokio::time::timeout(settings.connect_timeout(), dialect.open()).await {
                Ok(Ok(opened)) => opened,
                Ok(Err(e)) => return Err(backend_error::<D>(e)),
                Err(_) => {
                    return Err(backend_error::<D>(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no {} session within the connect timeout ({:?})",
                            D::NAME,
                            settings.connect_timeout()
                        ),
                    )))
                }
            };
        let session = Arc::new(Session {
            dialect: dialect.clone(),
            conn: Arc::new(tokio::sync::Mutex::new(Some(conn))),
            server_id,
            timeout,
            holders: SessionHolders::new(Instant::now()),
        });
        tokio::spawn(keep_alive(Arc::downgrade(&session)));
        Ok(session)
    }

    /// The session's connection, for one statement, and the time it is
    /// sent; `None` if the session ended. Pass the statement's answer to
    /// [`Live::done`].
    ///
    /// Only for a statement whose caller may not leave half-way (a task
    /// of dlock's own) or on a session that is ended if it does (a wait):
    /// anything else goes through [`Session::run`].
    async fn live(self: &Arc<Self>) -> std::result::Result<Live<D>, sqlx::Error> {
        let conn = self.conn.clone().lock_owned().await;
        if conn.is_none() || self.holders.is_expired() {
            return Err(sqlx::Error::PoolClosed);
        }
        Ok(Live {
            conn,
            sent: Instant::now(),
            session: self.clone(),
        })
    }

    /// Runs one statement on the session to its end, even if the caller
    /// stops waiting for it: when it was sent and its answer.
    ///
    /// A statement dropped half-way would leave the connection in the
    /// middle of an answer, and the next statement of any lock on the
    /// session would read the rest of it (or the server would cut the
    /// connection, taking every lock the session holds). So the caller may
    /// leave while it waits for the connection, when nothing was sent, and
    /// once the statement started it runs on in a task of its own; its
    /// successors on the session queue behind it in order.
    async fn run<T, F>(
        self: &Arc<Self>,
        statement: F,
    ) -> std::result::Result<(Instant, T), sqlx::Error>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(
                &'c D,
                &'c mut D::Conn,
            ) -> BoxFuture<'c, std::result::Result<T, sqlx::Error>>
            + Send
            + 'static,
    {
        let mut live = self.live().await?;
        let dialect = self.dialect.clone();
        let within = self.timeout;
        let task = tokio::spawn(async move {
            let sent = live.sent;
            let answer = answered_within(within, statement(&dialect, live.conn())).await;
            live.done(answer).map(|value| (sent, value))
        });
        match task.await {
            Ok(answer) => answer,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: whether the statement ran is
            // unknown, so the session counts as ended.
            Err(_) => {
                self.holders.expire();
                Err(sqlx::Error::PoolClosed)
            }
        }
    }

    /// Ends the session: every guard on it is lost, and its connection is
    /// closed once no statement runs on it (a waiter's blocked statement
    /// is ended from another session, see `EndOnDrop`).
    fn end(self: &Arc<Self>) {
        self.holders.expire();
        let session = self.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                session.close().await;
            });
        }
    }

    /// Closes the connection, once no statement runs on it.
    async fn close(&self) {
        self.conn.lock().await.take();
    }

    fn is_usable(&self) -> bool {
        !self.holders.is_expired()
    }
}

/// `statement`'s answer, or, if none comes `within`, an I/O error that ends
/// the session: the connection is cut or black-holed, and the server ends
/// a session it hears nothing from for the session timeout, with its
/// locks. Without it, a statement on a connection whose traffic is
/// dropped waits for the operating system's TCP retries, about 15 minutes.
pub(crate) async fn answered_within<T>(
    within: Duration,
    statement: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
) -> std::result::Result<T, sqlx::Error> {
    match tokio::time::timeout(within, statement).await {
        Ok(answer) => answer,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer within {within:?}: the connection is cut or its traffic dropped"),
        ))),
    }
}

/// Pings the session once a third of its timeout has passed without a
/// statement, so that the server never finds it idle for the timeout
/// while this process runs. Ends with the session.
async fn keep_alive<D: Dialect>(session: Weak<Session<D>>) {
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
                let answer = answered_within(s.timeout, s.dialect.ping(live.conn())).await;
                live.done(answer)
            }
            Err(e) => Err(e),
        };
        if let Err(error) = pinged {
            tracing::debug!(%error, session = s.server_id, "dlock {} session ended", D::NAME);
            s.end();
            return;
        }
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// Connects through `dialect`: opens the first holder session and
    /// creates what the dialect needs on the server.
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] if no session opens within the connect
    /// timeout, the login is refused, or the setup fails.
    pub async fn connect(dialect: D) -> Result<SqlBackend<D>> {
        // rustls needs one process-wide crypto provider, and cannot pick
        // one when the build compiles in more than one (another crate may
        // bring aws-lc-rs): ring, unless the application installed its own.
        #[cfg(feature = "tls")]
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (max_waiters, holder_sessions) = {
            let settings = dialect.settings();
            (settings.max_waiters(), settings.holder_sessions())
        };
        let backend = SqlBackend {
            inner: Arc::new_cyclic(|inner: &std::sync::Weak<Inner<D>>| {
                let inner = inner.clone();
                Inner {
                    waiters: Arc::new(Semaphore::new(max_waiters)),
                    holders: (0..holder_sessions)
                        .map(|_| tokio::sync::Mutex::new(None))
                        .collect(),
                    idle: Mutex::new(Vec::new()),
                    owned: Mutex::new(HashMap::new()),
                    local: Mutex::new(HashMap::new()),
                    contended: Mutex::new(HashMap::new()),
                    dialect: Arc::new(dialect),
                    lease_ends: LeaseTimers::new(move |token| {
                        // A lease ended: release it, if still held (a
                        // release that raced the timer finds nothing).
                        if let Some(inner) = inner.upgrade() {
                            let backend = SqlBackend { inner };
                            tokio::spawn(async move {
                                let _ = backend.unlock(&token).await;
                            });
                        }
                    }),
                }
            }),
        };
        let holder = backend.holder_at(0).await?;
        backend.refuse_moving_sessions(&holder).await?;
        let set_up = match holder.live().await {
            Ok(mut live) => {
                let answer =
                    answered_within(holder.timeout, backend.inner.dialect.setup(live.conn())).await;
                live.done(answer)
            }
            Err(e) => Err(e),
        };
        set_up.map_err(|e| match crate::deployment_refused(&e) {
            Some(why) => LockError::UnsafeDeployment {
                backend: D::NAME,
                reason: why.to_owned(),
            },
            None => backend_error::<D>(e),
        })?;
        Ok(backend)
    }

    /// Refuses a deployment that moves a connection's statements between
    /// server sessions (a pooler in transaction or statement mode, a
    /// multiplexing proxy): opens a second session beside `first`, and
    /// pings both. Two connections given one server session, or a ping
    /// that finds its connection on another one, is
    /// [`LockError::UnsafeDeployment`]. The second session stays, as an
    /// idle waiter session.
    ///
    /// A pooler hands a connection's next statement the server session
    /// that ran the last one, if it is idle (PgBouncer's default): the
    /// second connection's first statement gets the first one's.
    async fn refuse_moving_sessions(&self, first: &Arc<Session<D>>) -> Result<()> {
        let second = Session::open(&self.inner.dialect).await?;
        let mut moved = (second.server_id == first.server_id).then(|| {
            format!(
                "two connections were given one server session ({})",
                first.server_id
            )
        });
        for session in [first, &second] {
            if moved.is_some() {
                break;
            }
            match session.run(|d, c| d.ping(c)).await {
                Ok(_) => {}
                Err(e) if crate::is_session_moved(&e) => moved = Some(e.to_string()),
                Err(e) => return Err(backend_error::<D>(e)),
            }
        }
        if let Some(why) = moved {
            first.end();
            second.end();
            return Err(LockError::UnsafeDeployment {
                backend: D::NAME,
                reason: format!(
                    "{why}. A session-level lock would then sit on a server session this \
                     client no longer talks to, or go with it, and two owners could hold \
                     it. Connect to the server directly, or through a pooler in session \
                     mode (PgBouncer `pool_mode = session`; no ProxySQL multiplexing)"
                ),
            });
        }
        self.put_idle(second);
        Ok(())
    }

    /// The dialect this backend speaks.
    pub fn dialect(&self) -> &D {
        &self.inner.dialect
    }

    /// The holder session of lock `id`, opened again if it ended.
    async fn holder(&self, id: &D::Id) -> Result<Arc<Session<D>>> {
        self.holder_at(self.inner.dialect.shard(id)).await
    }

    async fn holder_at(&self, shard: u64) -> Result<Arc<Session<D>>> {
        let slots = &self.inner.holders;
        let mut holder = slots[(shard % slots.len() as u64) as usize].lock().await;
        if let Some(session) = holder.as_ref().filter(|s| s.is_usable()) {
            return Ok(session.clone());
        }
        let session = Session::open(&self.inner.dialect).await?;
        *holder = Some(session.clone());
        Ok(session)
    }

    /// A waiter session that holds nothing: an idle one, or a new one.
    async fn waiter_session(&self) -> Result<Arc<Session<D>>> {
        loop {
            let Some(session) = lock(&self.inner.idle).pop() else {
                return Session::open(&self.inner.dialect).await;
            };
            if session.is_usable() {
                return Ok(session);
            }
        }
    }

    /// This process's turn at `id`; `None` if `wait` ran out first.
    async fn local_turn(&self, id: &D::Id, mode: Mode, wait: Wait) -> Option<OwnedSemaphorePermit> {
        let queue = lock(&self.inner.local)
            .entry(id.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(TURN as usize)))
            .clone();
        let weight = turn_weight(mode);
        match wait {
            Wait::No => queue.try_acquire_many_owned(weight).ok(),
            Wait::Until(deadline) => {
                tokio::time::timeout_at(deadline, queue.acquire_many_owned(weight))
                    .await
                    .ok()?
                    .ok()
            }
            Wait::Forever => queue.acquire_many_owned(weight).await.ok(),
        }
    }

    /// Whether a task of this process other than the caller (which holds
    /// a turn) holds or waits for a turn at `id`.
    fn other_local_turns(&self, id: &D::Id) -> bool {
        lock(&self.inner.local)
            .get(id)
            .is_some_and(|queue| queue.available_permits() < TURN as usize - 1)
    }

    /// Forgets the turn queue of `id` once nobody uses it.
    fn sweep_local(&self, id: &D::Id) {
        let mut local = lock(&self.inner.local);
        if local.get(id).is_some_and(|q| Arc::strong_count(q) == 1) {
            local.remove(id);
        }
    }

    async fn acquire_inner(&self, req: &AcquireRequest<'_>) -> Result<Option<Acquired>> {
        if self.inner.dialect.queues(req.mode) {
            return self.acquire_queued(req).await;
        }
        let id = self.inner.dialect.lock_id(req.key, req.mode);
        let Some(turn) = self.local_turn(&id, req.mode, req.wait).await else {
            self.sweep_local(&id);
            return Ok(None);
        };
        let mut retry = Retry::new(req.wait, self.inner.dialect.settings().connect_timeout());
        let mut turn = turn;
        loop {
            // Refused a moment ago: the try would most likely be refused
            // again, so wait on the server at once (one statement less).
            if req.wait == Wait::No || !self.recently_contended(&id) {
                let (holder, sent, fence, back) =
                    self.try_on_holder(&id, req.mode, turn, &mut retry).await?;
                if let Some(fence) = fence {
                    return self.granted(
                        req,
                        holder,
                        id,
                        Some(back),
                        false,
                        sent,
                        fence,
                        *req.token,
                    );
                }
                turn = back;
                self.mark_contended(&id);
                if req.wait == Wait::No {
                    return Ok(None);
                }
            }
            match self.wait_on_server(req, &id, turn).await {
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
    ///
    /// The undo of a grant nobody takes is armed inside the statement's own
    /// task, from the server's answer: an attempt dropped before it was
    /// sent undoes nothing, and one dropped after undoes exactly the hold
    /// the server granted to it. An unlock sent for a read that was never
    /// granted would remove another reader's hold of the same session,
    /// where the server stacks them.
    async fn try_on_holder(
        &self,
        id: &D::Id,
        mode: Mode,
        turn: OwnedSemaphorePermit,
        retry: &mut Retry,
    ) -> Result<(Arc<Session<D>>, Instant, Option<i64>, OwnedSemaphorePermit)> {
        // The turn goes with the statement once it is sent: a grant's undo
        // keeps it until the unlock ran, so that no other task's hold of
        // the key on the session is undone instead.
        let turn = Arc::new(Mutex::new(Some(turn)));
        loop {
            let holder = match self.holder(id).await {
                Ok(holder) => holder,
                Err(e) => {
                    retry.after(e).await?;
                    continue;
                }
            };
            let (attempt, on, cell) = (id.clone(), holder.clone(), turn.clone());
            // Another reader of this process may hold the key on the
            // session: then a writer that waits comes first.
            let behind_writers = mode == Mode::Read && self.other_local_turns(id);
            let answer = holder
                .run(move |d, c| {
                    Box::pin(async move {
                        let answer = if behind_writers {
                            d.try_read_behind_writers(c, &attempt).await
                        } else {
                            d.try_lock(c, &attempt, mode).await
                        };
                        let undo = |granted| UnlockOnDrop {
                            session: Some(on.clone()),
                            id: attempt.clone(),
                            mode,
                            turn: lock(&cell).take(),
                            granted,
                        };
                        match answer {
                            // Undone when dropped unclaimed: with the task's
                            // output, if the caller left.
                            Ok(Some(fence)) => Ok(Some((fence, undo(true)))),
                            Ok(None) => Ok(None),
                            // The session ended, and its locks with it.
                            Err(e) if d.ends_the_session(&e) => Err(e),
                            // A failure after the grant is possible (the
                            // token could not be taken): undone at once.
                            Err(e) => {
                                drop(undo(false));
                                Err(e)
                            }
                        }
                    })
                })
                .await;
            match answer {
                Ok((sent, Some((fence, undo)))) => {
                    let turn = undo.defuse().expect("a grant's undo holds the turn");
                    return Ok((holder, sent, Some(fence), turn));
                }
                Ok((sent, None)) => {
                    let turn = lock(&turn).take().expect("a refusal leaves the turn");
                    return Ok((holder, sent, None, turn));
                }
                // The session ended (the server restarted, the connection
                // was cut) before or while the attempt ran: its locks went
                // with it; try on a new one.
                Err(e) if !holder.is_usable() && lock(&turn).is_some() => {
                    retry.after(backend_error::<D>(e)).await?;
                }
                Err(e) => return Err(backend_error::<D>(e)),
            }
        }
    }

    /// Whether an attempt at `id` was refused within [`CONTENDED_FOR`].
    fn recently_contended(&self, id: &D::Id) -> bool {
        lock(&self.inner.contended)
            .get(id)
            .is_some_and(|at| at.elapsed() < CONTENDED_FOR)
    }

    /// Remembers that an attempt at `id` was refused now; forgets keys
    /// not refused for a while once there are many.
    fn mark_contended(&self, id: &D::Id) {
        let mut contended = lock(&self.inner.contended);
        if contended.len() >= 1024 {
            contended.retain(|_, at| at.elapsed() < CONTENDED_FOR);
        }
        contended.insert(id.clone(), Instant::now());
    }

    /// Blocks on a waiter session until the server grants the lock or the
    /// wait limit passes.
    async fn wait_on_server(
        &self,
        req: &AcquireRequest<'_>,
        id: &D::Id,
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
        .map_err(|e| WaitFailed::Other(backend_error::<D>(e)))?;
        let session = match self.waiter_session().await {
            Ok(session) => session,
            Err(error) => return Err(WaitFailed::SessionEnded(error, turn)),
        };
        // Ends the session if this future is dropped mid-wait (or the wait
        // fails in a way that may follow a grant): the server may grant
        // the lock to it at any moment, and nobody would release.
        let mut abandon = EndOnDrop {
            backend: self.clone(),
            session: Some(session.clone()),
        };
        let limit = deadline.map(|d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        let waited = match session.live().await {
            Ok(mut live) => {
                let sent = live.sent;
                // A wait blocks on the server for its limit; past that and
                // a session timeout with no answer, the connection is gone.
                let within = limit.map_or(Duration::MAX, |l| l.saturating_add(session.timeout));
                let answer = answered_within(
                    within,
                    self.inner.dialect.wait(live.conn(), id, req.mode, limit),
                )
                .await;
                live.done(answer).map(|granted| (sent, granted))
            }
            Err(e) => Err(e),
        };
        match waited {
            Ok((sent, Some(Granted { fence, took }))) => {
                // The statement's send time plus the server's time on it is
                // no later than the server's end of it, where its idle
                // clock starts: the lease counts from there. Never later
                // than the answer's arrival, whatever the server's clock
                // said (a lease counted from the future would outlast the
                // server's).
                let took = took.min(sent.elapsed());
                abandon.session = None;
                // The slot bounds waits, not holds: free at the grant.
                drop(slot);
                self.granted(
                    req,
                    session,
                    id.clone(),
                    Some(turn),
                    true,
                    sent + took,
                    fence,
                    *req.token,
                )
                .map_err(WaitFailed::Other)
            }
            Ok((_, None)) => {
                // Not granted: the session is as it was, ready for another
                // wait.
                abandon.session = None;
                self.put_idle(session);
                drop(turn);
                self.sweep_local(id);
                Ok(None)
            }
            Err(e) if !session.is_usable() => {
                Err(WaitFailed::SessionEnded(backend_error::<D>(e), turn))
            }
            Err(e) => Err(WaitFailed::Other(backend_error::<D>(e))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn granted(
        &self,
        req: &AcquireRequest<'_>,
        session: Arc<Session<D>>,
        id: D::Id,
        turn: Option<OwnedSemaphorePermit>,
        on_waiter: bool,
        sent: Instant,
        fence: i64,
        entry: Token,
    ) -> Result<Option<Acquired>> {
        let fixed_end = (req.lease_kind == LeaseKind::Fixed).then(|| sent + req.lease);
        let Some(confirmed_at) = session
            .holders
            .hold(*req.token, req.loss.clone(), fixed_end, ())
        else {
            return Err(backend_error::<D>(std::io::Error::other(
                "the session ended as the lock was granted",
            )));
        };
        lock(&self.inner.owned).insert(
            *req.token,
            Owned {
                session: session.clone(),
                id,
                mode: req.mode,
                releasing: Arc::default(),
                _turn: turn,
                fixed_end,
                on_waiter,
                fence,
                entry,
                proclaimed: false,
            },
        );
        let alive_at = confirmed_at.max(sent);
        let mut acquired = Acquired::new(sent).kept_alive_by_backend();
        if self.inner.dialect.fences() {
            acquired = acquired.with_fence(u64::try_from(fence).unwrap_or(0));
        }
        Ok(Some(match fixed_end {
            None => acquired.with_lease_from(alive_at, session.timeout),
            Some(ends) => {
                // Session locks have no TTL: end the lease here.
                self.inner.lease_ends.add(*req.token, ends);
                if alive_at + session.timeout < ends {
                    acquired.with_lease_from(alive_at, session.timeout)
                } else {
                    acquired.with_lease_from(sent, req.lease)
                }
            }
        }))
    }

    /// Returns a waiter session that holds nothing to the idle ones.
    fn put_idle(&self, session: Arc<Session<D>>) {
        if session.is_usable() {
            let mut idle = lock(&self.inner.idle);
            if idle.len() < self.inner.dialect.settings().max_waiters() {
                idle.push(session);
            }
        }
    }

    /// Releases the lock `token` holds, on the session that holds it.
    ///
    /// The lock is taken out of `owned` by the statement's own task, right
    /// before the unlock is sent on the session's connection: a release
    /// dropped before that sent nothing and leaves the lock to the next
    /// release; one dropped after runs to its end, and a second release
    /// (core sends one for a guard whose release was cut off) finds nothing
    /// to send. An unlock sent twice would remove another hold of the same
    /// session where the server stacks them (a second reader's).
    async fn unlock(&self, token: &Token) -> Result<ReleaseOutcome> {
        let Some((releasing, session)) = lock(&self.inner.owned)
            .get(token)
            .map(|o| (o.releasing.clone(), o.session.clone()))
        else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let _one_at_a_time = releasing.lock().await;
        if !session.is_usable() {
            // The session ended, and its locks with it; its guards were told.
            if let Some(owned) = self.take_owned(token) {
                self.forget(owned, token, false);
            }
            return Ok(ReleaseOutcome::NotHeld);
        }
        let (backend, token) = (self.clone(), *token);
        let unlocked = session
            .run(move |d, c| {
                Box::pin(async move {
                    let Some(owned) = backend.take_owned(&token) else {
                        // Released already, by a release cut off after
                        // this point.
                        return Ok(false);
                    };
                    let answer = async {
                        if d.queues(owned.mode) {
                            return d.dequeue(c, &owned.entry).await;
                        }
                        if owned.proclaimed {
                            d.disclaim(c, &owned.id, &token).await?;
                        }
                        d.unlock(c, &owned.id, owned.mode).await
                    }
                    .await;
                    match &answer {
                        Ok(_) => backend.forget(owned, &token, true),
                        // Whether the lock went is unknown: ending the
                        // session makes sure (its other guards are told).
                        Err(e) => {
                            if !d.ends_the_session(e) {
                                owned.session.end();
                            }
                            backend.forget(owned, &token, false);
                        }
                    }
                    answer
                })
            })
            .await;
        match unlocked {
            Ok((_, true)) => Ok(ReleaseOutcome::Released),
            Ok((_, false)) => Ok(ReleaseOutcome::NotHeld),
            // The session ended meanwhile: its locks went with it.
            Err(_) if !session.is_usable() => {
                if let Some(owned) = self.take_owned(&token) {
                    self.forget(owned, &token, false);
                }
                Ok(ReleaseOutcome::NotHeld)
            }
            Err(e) => Err(backend_error::<D>(e)),
        }
    }

    /// Takes the lock `token` holds out of `owned`: from here on, its
    /// release is the taker's.
    fn take_owned(&self, token: &Token) -> Option<Owned<D>> {
        lock(&self.inner.owned).remove(token)
    }

    /// Forgets a lock taken out of `owned`: its guard, its turn at the key,
    /// and (a lock won by waiting, once `unlocked`) its session back to
    /// the idle waiter sessions.
    fn forget(&self, owned: Owned<D>, token: &Token, unlocked: bool) {
        owned.session.holders.forget(token, LostReason::NotHeld);
        if owned.fixed_end.is_some() {
            self.inner.lease_ends.cancel(*token);
        }
        let (session, id, on_waiter) = (owned.session.clone(), owned.id.clone(), owned.on_waiter);
        drop(owned);
        self.sweep_local(&id);
        if on_waiter && unlocked {
            self.put_idle(session);
        }
    }
}

/// Undoes an uncontended attempt's grant on the holder session that nobody
/// took: its caller left before reading the answer, or the attempt failed
/// after the grant. Made in the statement's task from the server's answer,
/// so that it undoes exactly what the server granted. Keeps this process's
/// turn at the key until the unlock ran after the attempt (the session
/// runs one statement at a time, in order), so no other task's grant of
/// the key on that session is undone instead.
struct UnlockOnDrop<D: Dialect> {
    session: Option<Arc<Session<D>>>,
    id: D::Id,
    mode: Mode,
    turn: Option<OwnedSemaphorePermit>,
    /// Whether the server said it granted the lock: if unknown (a failure
    /// after the statement was sent), a read ends the session instead, as
    /// an unlock could remove another reader's hold that the session holds
    /// too.
    granted: bool,
}

impl<D: Dialect> UnlockOnDrop<D> {
    /// Claims the grant: nothing to undo; the turn back.
    fn defuse(mut self) -> Option<OwnedSemaphorePermit> {
        self.session = None;
        self.turn.take()
    }
}

impl<D: Dialect> Drop for UnlockOnDrop<D> {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let turn = self.turn.take();
        if !self.granted && self.mode == Mode::Read {
            // Every hold on the session goes, and their guards are told.
            session.end();
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send it from: end the session instead, when
            // it is dropped with its connection.
            session.holders.expire();
            return;
        };
        let (id, mode) = (self.id.clone(), self.mode);
        runtime.spawn(async move {
            if let Ok(mut live) = session.live().await {
                let answer = answered_within(
                    session.timeout,
                    session.dialect.unlock(live.conn(), &id, mode),
                )
                .await;
                if live.done(answer).is_err() && session.is_usable() {
                    session.end();
                }
            }
            drop(turn);
        });
    }
}

/// Ends a waiter session whose wait was dropped: from another session (the
/// dropped statement may still hold its connection), and the connection
/// goes with the session.
struct EndOnDrop<D: Dialect> {
    backend: SqlBackend<D>,
    session: Option<Arc<Session<D>>>,
}

impl<D: Dialect> Drop for EndOnDrop<D> {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        // A session that ended already (its connection failed, or went
        // unanswered) is not ended by id: after a server restart, its id
        // may name another client's session. The server ends it on its
        // own: at once if its connection closed, after the session
        // timeout if it hears nothing.
        let alive = session.is_usable();
        let runtime = tokio::runtime::Handle::try_current();
        let (true, Ok(runtime)) = (alive, runtime) else {
            session.end();
            return;
        };
        // Its guards are lost now; its connection stays open until the
        // server session is ended by id, then closes. Closed first, a
        // pooler in session mode (PgBouncer) could hand the server session
        // to another client before the id ends it, and end that client's.
        session.holders.expire();
        let backend = self.backend.clone();
        runtime.spawn(async move {
            let server_id = session.server_id;
            let ended = match backend.holder_at(server_id).await {
                Ok(holder) => match holder.live().await {
                    Ok(mut live) => {
                        let answer = answered_within(
                            holder.timeout,
                            holder.dialect.end_session(live.conn(), server_id),
                        )
                        .await;
                        live.done(answer).map_err(backend_error::<D>)
                    }
                    Err(e) => Err(backend_error::<D>(e)),
                },
                Err(e) => Err(e),
            };
            if let Err(error) = ended {
                // Its connection closes below, and the server ends the
                // session when it notices.
                tracing::debug!(%error, server_id, "dlock {} could not end an abandoned wait", D::NAME);
            }
            session.close().await;
        });
    }
}

impl<D: Dialect> Backend for SqlBackend<D> {
    fn name(&self) -> &'static str {
        D::NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .fencing(self.inner.dialect.fences())
            .read_write(self.inner.dialect.supports(Mode::Read))
            .semaphores(
                self.inner
                    .dialect
                    .supports(Mode::Permits { count: 1, limit: 1 }),
            )
            .fifo(true)
            .session_leases(true)
    }

    fn acquire<'a>(&'a self, req: AcquireRequest<'a>) -> BoxFuture<'a, Result<Option<Acquired>>> {
        Box::pin(async move { self.acquire_inner(&req).await })
    }

    fn release<'a>(
        &'a self,
        _key: &'a LockKey,
        _mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move { self.unlock(token).await })
    }

    /// Ends the session that holds the token's lock: the server releases
    /// every lock on it at once. The other guards on it are lost, and later
    /// acquisitions open a new session.
    fn abandon<'a>(
        &'a self,
        _key: &'a LockKey,
        _mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Some(owned) = lock(&self.inner.owned).remove(token) else {
                return;
            };
            owned.session.end();
            let id = owned.id.clone();
            drop(owned);
            self.sweep_local(&id);
        })
    }

    fn renew<'a>(&'a self, locks: &'a [RenewRequest]) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        // Locks live on sessions that their keepalive renews.
        Box::pin(async move {
            let owned = lock(&self.inner.owned);
            Ok(locks
                .iter()
                .map(|l| match owned.get(&l.token) {
                    Some(o)
                        if o.session.is_usable()
                            && o.fixed_end.is_none_or(|end| Instant::now() < end) =>
                    {
                        RenewOutcome::Renewed
                    }
                    _ => RenewOutcome::NotHeld,
                })
                .collect())
        })
    }

    /// A statement on the first holder session (opening one if it ended).
    fn check_servers(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let holder = self.holder_at(0).await?;
            holder
                .run(|d, c| d.ping(c))
                .await
                .map(drop)
                .map_err(backend_error::<D>)
        })
    }

    /// Records the hold in the holders' table, on the session that holds
    /// it, behind its entry lock: the record is the holder's for as long
    /// as that session holds the entry lock, which its release gives back
    /// (after deleting the record) and the session's end takes.
    fn proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if !self.records_holders() {
                return Err(unsupported_holder(D::NAME));
            }
            let Some(releasing) = lock(&self.inner.owned)
                .get(token)
                .map(|o| o.releasing.clone())
            else {
                return Ok(false);
            };
            // Not while its release runs: that would leave a record the
            // release did not delete.
            let _not_releasing = releasing.lock().await;
            let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
            let Some(session) = lock(&self.inner.owned)
                .get(token)
                .map(|o| o.session.clone())
            else {
                return Ok(false);
            };
            let (backend, token, value) = (self.clone(), *token, value.to_vec());
            let written = session
                .run(move |d, c| {
                    Box::pin(async move {
                        // Checked and marked by the statement's own task,
                        // right before it is sent: a release queued behind
                        // it deletes what it writes, and one that ran
                        // first leaves nothing to write for.
                        let fence = {
                            let mut owned = lock(&backend.inner.owned);
                            let Some(o) = owned.get_mut(&token).filter(|o| {
                                o.mode == Mode::Exclusive
                                    && o.id == id
                                    && o.fixed_end.is_none_or(|end| Instant::now() < end)
                            }) else {
                                return Ok(false);
                            };
                            o.proclaimed = true;
                            o.fence
                        };
                        d.proclaim(c, &id, &token, fence, &value).await?;
                        Ok(true)
                    })
                })
                .await;
            match written {
                Ok((_, written)) => Ok(written),
                // The session ended meanwhile: its locks went with it.
                Err(_) if !session.is_usable() => Ok(false),
                Err(e) => Err(backend_error::<D>(e)),
            }
        })
    }

    /// Reads the server's lock table, and the holders' table, on the key's
    /// holder session.
    fn holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>> {
        Box::pin(async move {
            if !self.records_holders() {
                return Err(unsupported_holder(D::NAME));
            }
            let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
            let session = self.holder(&id).await?;
            let (_, read) = session
                .run(move |d, c| Box::pin(async move { d.holder(c, &id).await }))
                .await
                .map_err(backend_error::<D>)?;
            Ok(read.map(|(fence, value)| {
                Holder::new(fence.and_then(|f| u64::try_from(f).ok()), value)
            }))
        })
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// Whether holders can be recorded and read: the dialect records them,
    /// and grants carry fencing tokens.
    fn records_holders(&self) -> bool {
        self.inner.dialect.records_holders() && self.inner.dialect.fences()
    }
}

/// Implements [`Backend`] for a newtype around a [`SqlBackend`], by
/// passing every call on to it: how a backend crate names its own type.
///
/// # Examples
///
/// ```text
/// pub struct PgBackend(SqlBackend<PgDialect>);
/// dlock_sql::forward_backend!(PgBackend);
/// ```
#[macro_export]
macro_rules! forward_backend {
    ($name:ty) => {
        impl $crate::__private::Backend for $name {
            fn name(&self) -> &'static str {
                self.0.name()
            }

            fn capabilities(&self) -> $crate::__private::Capabilities {
                self.0.capabilities()
            }

            fn acquire<'a>(
                &'a self,
                req: $crate::__private::AcquireRequest<'a>,
            ) -> $crate::__private::BoxFuture<
                'a,
                $crate::__private::Result<Option<$crate::__private::Acquired>>,
            > {
                self.0.acquire(req)
            }

            fn release<'a>(
                &'a self,
                key: &'a $crate::__private::LockKey,
                mode: $crate::__private::Mode,
                token: &'a $crate::__private::Token,
            ) -> $crate::__private::BoxFuture<
                'a,
                $crate::__private::Result<$crate::__private::ReleaseOutcome>,
            > {
                self.0.release(key, mode, token)
            }

            /// Ends the session that holds the token's lock: the server
            /// releases every lock on it at once. The other guards on it
            /// are lost, and later acquisitions open a new session.
            fn abandon<'a>(
                &'a self,
                key: &'a $crate::__private::LockKey,
                mode: $crate::__private::Mode,
                token: &'a $crate::__private::Token,
            ) -> $crate::__private::BoxFuture<'a, ()> {
                self.0.abandon(key, mode, token)
            }

            fn renew<'a>(
                &'a self,
                locks: &'a [$crate::__private::RenewRequest],
            ) -> $crate::__private::BoxFuture<
                'a,
                $crate::__private::Result<Vec<$crate::__private::RenewOutcome>>,
            > {
                self.0.renew(locks)
            }

            /// A statement on a holder session (opening one if it ended).
            fn check_servers(
                &self,
            ) -> $crate::__private::BoxFuture<'_, $crate::__private::Result<()>> {
                self.0.check_servers()
            }

            fn proclaim<'a>(
                &'a self,
                key: &'a $crate::__private::LockKey,
                token: &'a $crate::__private::Token,
                value: &'a [u8],
            ) -> $crate::__private::BoxFuture<'a, $crate::__private::Result<bool>> {
                self.0.proclaim(key, token, value)
            }

            fn holder<'a>(
                &'a self,
                key: &'a $crate::__private::LockKey,
            ) -> $crate::__private::BoxFuture<
                'a,
                $crate::__private::Result<Option<$crate::__private::Holder>>,
            > {
                self.0.holder(key)
            }

            fn holder_changed<'a>(
                &'a self,
                key: &'a $crate::__private::LockKey,
                seen: Option<&'a $crate::__private::Holder>,
            ) -> $crate::__private::BoxFuture<'a, $crate::__private::Result<()>> {
                self.0.holder_changed(key, seen)
            }
        }
    };
}
