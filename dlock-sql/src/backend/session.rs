//! Sessions: opening them (the backend's first ones on connect), keeping
//! them alive, running statements on them to their end, and ending them,
//! with the locks they hold.

use std::{
    collections::HashMap,
    panic::AssertUnwindSafe,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use dlock_core::{
    backend::{BoxFuture, ConnectionStates, FinishOnDrop, LeaseTimers, SessionHolders},
    LockError, Result,
};
use futures_util::future::{FutureExt, Shared};
use tokio::{sync::Semaphore, time::Instant};

use super::{backend_error, lock, Inner, SqlBackend};
use crate::{Dialect, Refusal, ServerSession};

/// One server session: its connection, the server's identifier of it, and
/// the guards whose locks it holds.
pub(super) struct Session<D: Dialect> {
    pub(super) dialect: Arc<D>,
    /// `None` once the session ended: its connection is closed, and the
    /// server has released (or, if it cannot be reached, will release at
    /// its idle timeout) every lock it held.
    pub(super) conn: Arc<tokio::sync::Mutex<Option<D::Conn>>>,
    /// The server's identifier of the session, and its incarnation.
    server: ServerSession,
    pub(super) timeout: Duration,
    pub(super) holders: SessionHolders<()>,
    /// The statement [`Session::run`] runs now, for whoever waits for the
    /// connection to drive to its end: its caller may have polled it once
    /// and stopped (a `&mut` future in a `select!` loop), and until its
    /// answer is read, nothing else can use the connection.
    in_flight: Mutex<Option<InFlight>>,
}

/// A statement in flight on a session, shared by its caller and whoever
/// waits for the connection; its answer goes to its caller by a channel.
type InFlight = Shared<BoxFuture<'static, ()>>;

/// One statement's hold on a session's connection.
pub(super) struct Live<D: Dialect> {
    conn: tokio::sync::OwnedMutexGuard<Option<D::Conn>>,
    pub(super) sent: Instant,
    session: Arc<Session<D>>,
}

impl<D: Dialect> Live<D> {
    pub(super) fn conn(&mut self) -> &mut D::Conn {
        self.conn
            .as_mut()
            .expect("a live session has its connection")
    }

    /// Takes the statement's answer: a success proves the session alive
    /// when the statement was sent, which renews every guard on it; a
    /// failure of the connection ends the session and loses them.
    pub(super) fn done<T>(
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

impl<D: Dialect> Session<D> {
    /// Opens a session, with the server's idle timeout set.
    async fn open(dialect: &Arc<D>, states: &ConnectionStates) -> Result<Arc<Session<D>>> {
        let settings = dialect.settings();
        let timeout = settings.session_timeout();
        let (conn, server) =
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
            server,
            timeout,
            holders: SessionHolders::reporting_to(Instant::now(), states.clone()),
            in_flight: Mutex::new(None),
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
    pub(super) async fn live(self: &Arc<Self>) -> std::result::Result<Live<D>, sqlx::Error> {
        let conn = self.connection().await;
        if conn.is_none() || self.holders.is_expired() {
            return Err(sqlx::Error::PoolClosed);
        }
        Ok(Live {
            conn,
            sent: Instant::now(),
            session: self.clone(),
        })
    }

    /// Runs `statement` in the caller's task, through [`Session::live`]:
    /// for a caller that never leaves half-way (a task of dlock's own).
    async fn run_here<T>(
        self: &Arc<Self>,
        statement: impl for<'c> FnOnce(
            &'c D,
            &'c mut D::Conn,
        ) -> BoxFuture<'c, std::result::Result<T, sqlx::Error>>,
    ) -> std::result::Result<T, sqlx::Error> {
        let mut live = self.live().await?;
        let answer = answered_within(self.timeout, statement(&self.dialect, live.conn())).await;
        live.done(answer)
    }

    /// The connection, once no statement holds it: a statement in flight
    /// whose caller stopped polling it is driven to its end here.
    async fn connection(&self) -> tokio::sync::OwnedMutexGuard<Option<D::Conn>> {
        loop {
            let in_flight = lock(&self.in_flight).clone();
            let Some(in_flight) = in_flight else {
                return self.conn.clone().lock_owned().await;
            };
            tokio::select! {
                conn = self.conn.clone().lock_owned() => return conn,
                // A statement that panicked is its caller's to report.
                _ = AssertUnwindSafe(in_flight.clone()).catch_unwind() => {
                    self.settled(&in_flight);
                }
            }
        }
    }

    /// Forgets `statement`, which has ended, unless another took its place.
    fn settled(&self, statement: &InFlight) {
        let mut in_flight = lock(&self.in_flight);
        if in_flight.as_ref().is_some_and(|s| s.ptr_eq(statement)) {
            *in_flight = None;
        }
    }

    /// Runs one statement on the session to its end, even if the caller
    /// stops waiting for it: when it was sent and its answer.
    ///
    /// A statement dropped half-way would leave the connection in the
    /// middle of an answer, and the next statement of any lock on the
    /// session would read the rest of it (or the server would cut the
    /// connection, taking every lock the session holds). So the caller may
    /// leave while it waits for the connection, when nothing was sent; the
    /// statement runs in the caller's task while the caller waits for it
    /// (no task hop), and if the caller leaves once it started, it runs on
    /// to its end in a task of its own ([`FinishOnDrop`]). Its successors
    /// on the session queue behind it in order, and drive it to its end if
    /// its caller stopped polling it (see [`Session::connection`]).
    pub(super) async fn run<T, F>(
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
        let live = self.live().await?;
        let dialect = self.dialect.clone();
        let within = self.timeout;
        let (answer_to, answer) = tokio::sync::oneshot::channel();
        let statement: InFlight = async move {
            let mut unanswered = Unanswered(Some(live));
            let Some(live) = unanswered.0.as_mut() else {
                return;
            };
            let sent = live.sent;
            let answer = answered_within(within, statement(&dialect, live.conn())).await;
            if let Some(live) = unanswered.0.take() {
                let _ = answer_to.send(live.done(answer).map(|value| (sent, value)));
            }
        }
        .boxed()
        .shared();
        *lock(&self.in_flight) = Some(statement.clone());
        FinishOnDrop::new(statement.clone()).await;
        self.settled(&statement);
        // No answer: the statement was dropped half-way (see `Unanswered`).
        answer.await.unwrap_or(Err(sqlx::Error::PoolClosed))
    }

    /// Runs an undo whose caller left (an unlock, a dequeue) in a task of
    /// its own, after what runs on the session now; if it fails, the
    /// session ends, which undoes it too. Without a runtime to send it
    /// from, the session's guards expire at once, and the session ends
    /// when it is dropped with its connection.
    pub(super) fn undo_later<T: Send + 'static>(
        self: Arc<Self>,
        undo: impl for<'c> FnOnce(
                &'c D,
                &'c mut D::Conn,
            ) -> BoxFuture<'c, std::result::Result<T, sqlx::Error>>
            + Send
            + 'static,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.holders.expire();
            return;
        };
        runtime.spawn(async move {
            if self.run_here(undo).await.is_err() && self.is_usable() {
                self.end();
            }
        });
    }

    /// Ends the session: every guard on it is lost, and its connection is
    /// closed once no statement runs on it (a waiter's blocked statement
    /// is ended from another session, see `EndOnDrop`).
    pub(super) fn end(self: &Arc<Self>) {
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
        self.connection().await.take();
    }

    pub(super) fn is_usable(&self) -> bool {
        !self.holders.is_expired()
    }
}

/// A statement's hold on the connection until its answer is read. Dropped
/// before that (its runtime shut down, or it panicked), it expires the
/// session's guards first, then lets the connection go: whether the
/// statement ran is unknown, and the connection may hold the rest of an
/// answer, so no later statement may run on it.
struct Unanswered<D: Dialect>(Option<Live<D>>);

impl<D: Dialect> Drop for Unanswered<D> {
    fn drop(&mut self) {
        if let Some(mut live) = self.0.take() {
            live.session.holders.expire();
            *live.conn = None;
        }
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
        if let Err(error) = s.run_here(|d, c| Box::pin(d.ping(c))).await {
            tracing::debug!(%error, session = s.server.id, "dlock {} session ended", D::NAME);
            s.end();
            return;
        }
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// Connects with a prepared config of the dialect's.
    ///
    /// # Errors
    ///
    /// As [`connect`](SqlBackend::connect).
    pub async fn connect_with(config: D::Config) -> Result<SqlBackend<D>> {
        let dialect = D::new(config);
        let (max_waiters, holder_sessions) = {
            let settings = dialect.settings();
            (settings.max_waiters(), settings.holder_sessions())
        };
        let backend = SqlBackend {
            inner: Arc::new_cyclic(|inner: &std::sync::Weak<Inner<D>>| {
                let inner = inner.clone();
                Inner {
                    states: ConnectionStates::new(D::NAME),
                    waiters: Arc::new(Semaphore::new(max_waiters)),
                    holders: (0..holder_sessions)
                        .map(|_| tokio::sync::Mutex::new(None))
                        .collect(),
                    idle: Mutex::new(Vec::new()),
                    owned: Mutex::new(HashMap::new()),
                    local: dlock_core::backend::LocalTurns::new(),
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
        let set_up = holder.run_here(|d, c| Box::pin(d.setup(c))).await;
        set_up.map_err(|e| match Refusal::of(&e) {
            Some(Refusal::UnsafeDeployment(why)) => LockError::UnsafeDeployment {
                backend: D::NAME,
                reason: why.to_owned(),
            },
            _ => backend_error::<D>(e),
        })?;
        let weak = Arc::downgrade(&backend.inner);
        backend.inner.states.probe_while_disconnected(move || {
            let backend = SqlBackend {
                inner: weak.upgrade()?,
            };
            Some(async move {
                let _ = dlock_core::backend::Backend::check_servers(&backend).await;
            })
        });
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
        let second = Session::open(&self.inner.dialect, &self.inner.states).await?;
        let mut moved = (second.server.id == first.server.id).then(|| {
            format!(
                "two connections were given one server session ({})",
                first.server.id
            )
        });
        for session in [first, &second] {
            if moved.is_some() {
                break;
            }
            match session.run(|d, c| Box::pin(d.ping(c))).await {
                Ok(_) => {}
                Err(e) if matches!(Refusal::of(&e), Some(Refusal::SessionMoved { .. })) => {
                    moved = Some(e.to_string())
                }
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

    /// The holder session of lock `id`, opened again if it ended.
    pub(super) async fn holder(&self, id: &D::Id) -> Result<Arc<Session<D>>> {
        self.holder_at(self.inner.dialect.shard(id)).await
    }

    pub(super) async fn holder_at(&self, shard: u64) -> Result<Arc<Session<D>>> {
        let slots = &self.inner.holders;
        let mut holder = slots[(shard % slots.len() as u64) as usize].lock().await;
        if let Some(session) = holder.as_ref().filter(|s| s.is_usable()) {
            return Ok(session.clone());
        }
        let session = Session::open(&self.inner.dialect, &self.inner.states).await?;
        *holder = Some(session.clone());
        Ok(session)
    }

    /// A waiter session that holds nothing: an idle one, or a new one.
    pub(super) async fn waiter_session(&self) -> Result<Arc<Session<D>>> {
        loop {
            let Some(session) = lock(&self.inner.idle).pop() else {
                return Session::open(&self.inner.dialect, &self.inner.states).await;
            };
            if session.is_usable() {
                return Ok(session);
            }
        }
    }

    /// Runs a read on a waiter session that holds nothing (an idle one,
    /// or a new one), never on one that holds locks: a slow read delays
    /// no acquire, release or keepalive, and a read that fails or gets no
    /// answer within the session timeout fails alone, with no guard lost
    /// (its session is closed). It takes no waiter slot (a wait may hold
    /// one without end): each read in flight may add a session to
    /// `max_waiters` ones. Dropped half-way, the read runs on to its end
    /// in a task of its own, and its session, no longer anyone's, closes.
    pub(super) async fn on_idle_session<T, F>(&self, read: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(
                &'c D,
                &'c mut D::Conn,
            ) -> BoxFuture<'c, std::result::Result<T, sqlx::Error>>
            + Send
            + 'static,
    {
        let session = self.waiter_session().await?;
        match session.run(read).await {
            Ok((_, answer)) => {
                self.put_idle(session);
                Ok(answer)
            }
            Err(e) => {
                // Whether the answer was read to its end is unknown.
                session.end();
                Err(backend_error::<D>(e))
            }
        }
    }

    /// Returns a waiter session that holds nothing to the idle ones.
    pub(super) fn put_idle(&self, session: Arc<Session<D>>) {
        if session.is_usable() {
            let mut idle = lock(&self.inner.idle);
            if idle.len() < self.inner.dialect.settings().max_waiters() {
                idle.push(session);
            }
        }
    }
}

/// Ends a waiter session whose wait was dropped: from another session (the
/// dropped statement may still hold its connection), and the connection
/// goes with the session.
pub(super) struct EndOnDrop<D: Dialect> {
    pub(super) backend: SqlBackend<D>,
    pub(super) session: Option<Arc<Session<D>>>,
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
            // The holder session may be a new one, on another server (a
            // failover, a virtual IP): the incarnation, checked in the
            // statement that ends the session, keeps it from ending
            // another client's session of the same identifier there.
            let (server_id, target) = (session.server.id, session.server.clone());
            let ended = match backend.holder_at(server_id).await {
                Ok(holder) => holder
                    .run_here(move |d, c| Box::pin(async move { d.end_session(c, &target).await }))
                    .await
                    .map_err(backend_error::<D>),
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
