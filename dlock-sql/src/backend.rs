//! `SqlBackend`: the `Backend` trait over a database's session-level
//! named locks, whatever the server, through a [`Dialect`].

use std::{
    collections::HashMap,
    fmt,
    sync::{atomic::AtomicBool, Arc, Mutex, MutexGuard},
    time::Duration,
};

use dlock_core::{
    backend::{
        unsupported_holder,
        wait::{drive, StepError},
        AcquireRequest, Acquired, Backend, Capabilities, Holder, LeaseTimers, LocalTurn,
        LocalTurns, Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
    },
    LockError, LockKey, Result, Token,
};
use tokio::{sync::Semaphore, time::Instant};

use crate::Dialect;

mod acquire;
mod queue;
mod release;
mod session;

use session::{answered_within, EndOnDrop, Session};

/// A database lock server, through dialect `D`: a few holder sessions
/// take every uncontended lock (a key always on the same one), a refused
/// attempt waits on the server on one of at most `max_waiters` waiter
/// sessions, and every session is kept busy within the server's idle
/// timeout. The backend crates (`dlock-postgres`, `dlock-mysql`) say how
/// each server locks; what a dropped future leaves behind is said where
/// each statement runs (`try_on_holder`, `Session::run`, `unlock`).
///
/// # Examples
///
/// A backend crate names it for its dialect, for example
/// `dlock_postgres::PgBackend`:
///
/// ```text
/// pub type PgBackend = dlock_sql::SqlBackend<PgDialect>;
/// let backend = PgBackend::connect("postgres://app@db/app").await?;
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
    /// Fed by every session: a statement answered, a session ended with
    /// guards on it (see `SessionHolders::reporting_to`).
    states: dlock_core::backend::ConnectionStates,
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
    local: LocalTurns<D::Id>,
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
    _turn: Option<LocalTurn<D::Id>>,
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

/// What a wait step answers.
type Answer<T> = std::result::Result<T, StepError>;

/// A statement's failure on `session`, as a wait step's: worth trying
/// again (on a new session) if the session ended.
fn step_error<D: Dialect>(session: &Session<D>, e: sqlx::Error) -> StepError {
    let error = backend_error::<D>(e);
    if session.is_usable() {
        StepError::Fatal(error)
    } else {
        StepError::Retry(error)
    }
}

/// The dialect's own features (PostgreSQL's locks on the caller's
/// transaction, for example) are methods of the backend.
impl<D: Dialect> std::ops::Deref for SqlBackend<D> {
    type Target = D;

    fn deref(&self) -> &D {
        &self.inner.dialect
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// Connects to the server of a URL of the dialect's scheme (see its
    /// config): opens a holder session, and creates the fencing object and
    /// the tables if they are missing.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a malformed URL;
    /// [`LockError::Backend`] if no session opens within the connect
    /// timeout, the login is refused, or the setup fails;
    /// [`LockError::UnsafeDeployment`] for a server or a pooler that
    /// cannot hold session locks safely.
    pub async fn connect(url: &str) -> Result<SqlBackend<D>> {
        Self::connect_with(D::parse_url(url)?).await
    }

    /// Connects with the connect options of the application's own pool:
    /// the same server, login and TLS settings, on sessions of dlock's
    /// own, with the same guarantees as [`connect`](SqlBackend::connect).
    ///
    /// dlock never borrows the pool's connections: a lock lives exactly as
    /// long as the session that holds it, and a pooled connection is lent
    /// to other code, reset and closed when the pool decides. For dlock's
    /// own settings (session timeout, prefix), make the dialect's config
    /// from `pool.connect_options()` and use
    /// [`connect_with`](SqlBackend::connect_with).
    ///
    /// # Errors
    ///
    /// As [`connect`](SqlBackend::connect).
    pub async fn from_pool(pool: &sqlx::Pool<D::Database>) -> Result<SqlBackend<D>> {
        Self::connect_with(D::pool_config((*pool.connect_options()).clone())).await
    }
}

impl<D: Dialect> Backend for SqlBackend<D> {
    fn name(&self) -> &'static str {
        D::NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .forced_release(true)
            .fencing(self.inner.dialect.fences())
            .read_write(true)
            .semaphores(true)
            .fifo(true)
            .session_leases(true)
    }

    /// Driven by core's wait engine, with the steps of a lock the server
    /// has (an attempt, then a wait on the server) or of a queued mode (an
    /// entry in the queue table, then a wait for the entry ahead).
    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        let id = self.inner.dialect.lock_id(req.key, req.mode);
        if self.inner.dialect.queues(req.mode) {
            let enqueued = AtomicBool::new(false);
            let steps = queue::QueueWait {
                backend: self,
                id,
                enqueued,
            };
            drive(&steps, &req).await
        } else {
            drive(&acquire::ServerWait { backend: self, id }, &req).await
        }
    }

    async fn release(&self, _key: &LockKey, _mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        self.unlock(token).await
    }

    /// Ends the session that holds the token's lock: the server releases
    /// every lock on it at once. The other guards on it are lost, and later
    /// acquisitions open a new session.
    async fn abandon(&self, _key: &LockKey, _mode: Mode, token: &Token) {
        let Some(owned) = lock(&self.inner.owned).remove(token) else {
            return;
        };
        owned.session.end();
    }

    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        // Locks live on sessions that their keepalive renews.
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
    }

    /// A statement on the first holder session (opening one if it ended).
    async fn check_servers(&self) -> Result<()> {
        let holder = self.holder_at(0).await?;
        holder
            .run(|d, c| Box::pin(d.ping(c)))
            .await
            .map(drop)
            .map_err(backend_error::<D>)
    }

    /// Records the hold in the holders' table, on the session that holds
    /// it, behind its entry lock: the record is the holder's for as long
    /// as that session holds the entry lock, which its release gives back
    /// (after deleting the record) and the session's end takes.
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        // Holders are recorded with their fencing tokens.
        if !self.inner.dialect.fences() {
            return Err(unsupported_holder(D::NAME));
        }
        let Some((releasing, session)) = lock(&self.inner.owned)
            .get(token)
            .map(|o| (o.releasing.clone(), o.session.clone()))
        else {
            return Ok(false);
        };
        // Not while its release runs: that would leave a record the
        // release did not delete (one that ran leaves no lock to check).
        let _not_releasing = releasing.lock().await;
        let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
        let (backend, token, value) = (self.clone(), *token, value.to_vec());
        let written = session
            .run(move |d, c| {
                Box::pin(async move {
                    // Checked and marked by the statement itself,
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
    }

    /// Reads the server's lock table, and the holders' table, on a waiter
    /// session that holds nothing (see `on_idle_session`): a slow read
    /// delays no lock of this process, and loses none.
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        if !self.inner.dialect.fences() {
            return Err(unsupported_holder(D::NAME));
        }
        let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
        let read = self
            .on_idle_session(move |d, c| Box::pin(async move { d.holder(c, &id).await }))
            .await?;
        Ok(read.map(|(fence, value)| {
            Holder::new(fence.and_then(|f| u64::try_from(f).ok()), value).with_mode(Mode::Exclusive)
        }))
    }

    /// Asks the dialect for a page, on a waiter session that holds
    /// nothing (see `on_idle_session`): a slow page delays no lock of this
    /// process, and one with no answer within the session timeout fails
    /// alone. A listing the dialect refuses takes no session.
    async fn list(
        &self,
        req: dlock_core::backend::ListRequest<'_>,
    ) -> Result<dlock_core::backend::ListPage> {
        if let Some(what) = self.inner.dialect.list_refused(req.prefix) {
            return Err(dlock_core::backend::unsupported_list(D::NAME, what));
        }
        let prefix = req.prefix.to_owned();
        let after = req.after.map(|a| a.as_str().to_owned());
        let limit = req.limit;
        let page = self
            .on_idle_session(move |d, c| {
                Box::pin(async move { d.list(c, &prefix, after.as_deref(), limit).await })
            })
            .await?;
        page.map_err(|what| dlock_core::backend::unsupported_list(D::NAME, what))
    }

    /// Fed by the sessions: an answered statement is `Connected` (or
    /// `Reconnected`), a session that ends with guards on it `Lost`; no
    /// `Suspended`, as a session is one connection.
    fn connection_state(&self) -> tokio::sync::watch::Receiver<dlock_core::ConnectionState> {
        self.inner.states.subscribe()
    }

    /// The admitted live entries of the semaphore's queue, in one read.
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        let mode = Mode::Permits { count: 1, limit };
        let id = self.inner.dialect.lock_id(key, mode);
        let session = self.holder(&id).await?;
        let (_, (entries, _)) = session
            .run(move |d, c| Box::pin(async move { d.ahead(c, &id, i64::MAX).await }))
            .await
            .map_err(backend_error::<D>)?;
        let modes = entries
            .iter()
            .filter(|entry| entry.live)
            .map(|entry| Mode::from_tag(&entry.tag).unwrap_or(Mode::Exclusive));
        Ok(dlock_core::backend::permits_taken(modes))
    }

    /// Moves the end this backend keeps for a fixed lease (session locks
    /// have no TTL), once a statement on the session that holds the lock
    /// is answered: a session lock goes only with its session (or its own
    /// unlock), so that proves it still held.
    async fn extend(
        &self,
        _key: &LockKey,
        _mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(Instant, Duration)>> {
        let Some(session) = lock(&self.inner.owned)
            .get(token)
            .map(|o| o.session.clone())
        else {
            return Ok(None);
        };
        if let Err(e) = session
            .run(|d, c| Box::pin(async move { d.ping(c).await }))
            .await
        {
            // A session the server ended took the lock with it.
            return if session.is_usable() {
                Err(backend_error::<D>(e))
            } else {
                Ok(None)
            };
        }
        let mut owned = lock(&self.inner.owned);
        let Some(held) = owned.get_mut(token) else {
            return Ok(None);
        };
        let until =
            session
                .holders
                .extend_fixed(token, lease, session.timeout, &self.inner.lease_ends);
        if until.is_some() {
            held.fixed_end = Some(tokio::time::Instant::now() + lease);
        }
        Ok(until)
    }

    /// Ends the server session that holds the lock, with every other lock
    /// of that session; a lock this backend holds itself is released on
    /// its session instead, and its guard told at once.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
        let own = lock(&self.inner.owned)
            .iter()
            .find(|(_, owned)| owned.id == id && owned.mode == Mode::Exclusive)
            .map(|(token, _)| *token);
        if let Some(token) = own {
            let released = self.unlock(&token).await?;
            return Ok(released == dlock_core::backend::ReleaseOutcome::Released);
        }
        let session = self.holder(&id).await?;
        let (_, ended) = session
            .run(move |d, c| Box::pin(async move { d.end_holder(c, &id).await }))
            .await
            .map_err(|e| match self.inner.dialect.missing_right(&e) {
                Some(right) => dlock_core::LockError::PermissionDenied {
                    backend: D::NAME,
                    source: std::sync::Arc::new(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!("ending the holder's session takes {right}: {e}"),
                    )),
                },
                None => backend_error::<D>(e),
            })?;
        Ok(ended)
    }
}
