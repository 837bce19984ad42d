//! `Dialect`: the statements one database server speaks.

use std::{fmt, hash::Hash, time::Duration};

use dlock_core::{
    backend::{BoxFuture, Mode},
    LockKey,
};

use crate::SqlSettings;

/// A lock granted to a waiting session: its fencing token, and how long
/// the server spent on the statement (measured by the server: the wait
/// itself, and the token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// The fencing token taken right after the grant, on the same session.
    pub fence: i64,
    /// The server's time from receiving the statement to the token. Added
    /// to when the statement was sent, it gives an instant no later than
    /// the server's end of the statement, where its idle clock starts.
    pub took: Duration,
}

/// The statements of one database server's session-level named locks.
///
/// A [`SqlBackend`](crate::SqlBackend) holds locks on a few holder
/// sessions and waits on bounded waiter sessions; it decides which session
/// runs what, and keeps them alive. A dialect only runs one statement on
/// the connection it is given. Every method's future may be dropped at any
/// point: the backend then undoes what the statement may have done (an
/// unlock, or ending the session).
///
/// The server's locks must be held by a session until it unlocks them or
/// ends, and a session that is idle for the session timeout must be ended
/// by the server.
///
/// # Examples
///
/// A dialect is used through its backend crate:
///
/// ```text
/// let backend = dlock_sql::SqlBackend::connect(MyDialect::new(url)?).await?;
/// ```
pub trait Dialect: Send + Sync + Sized + 'static {
    /// The driver's connection.
    type Conn: Send + 'static;
    /// A lock's identifier on the server.
    type Id: Clone + Eq + Hash + fmt::Debug + Send + Sync + 'static;

    /// The backend's name in errors and traces.
    const NAME: &'static str;

    /// The settings shared by every database.
    fn settings(&self) -> &SqlSettings;

    /// Whether grants carry fencing tokens (the token
    /// [`try_lock`](Dialect::try_lock) and [`wait`](Dialect::wait) answer
    /// is ignored otherwise).
    fn fences(&self) -> bool {
        true
    }

    /// Whether the server offers `mode` (plain locks always; the default
    /// offers nothing else).
    fn supports(&self, mode: Mode) -> bool {
        mode == Mode::Exclusive
    }

    /// The server's identifier of `key` in `mode`, under the lock prefix:
    /// a key's plain lock and its read-write lock are different locks.
    fn lock_id(&self, key: &LockKey, mode: Mode) -> Self::Id;

    /// A number that picks the holder session of `id`: every key always
    /// on the same one.
    fn shard(&self, id: &Self::Id) -> u64;

    /// Opens a session whose server ends it after the session timeout
    /// idle, and returns it with the server's identifier of it (for
    /// [`end_session`](Dialect::end_session)).
    fn open(&self) -> BoxFuture<'_, Result<(Self::Conn, u64), sqlx::Error>>;

    /// Creates what the dialect needs on the server (the fencing sequence
    /// or counter), if it is missing, once at connect.
    fn setup<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// One attempt at `mode` of `id` without waiting: the fencing token if
    /// it was granted, in the same round trip.
    fn try_lock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        id: &'a Self::Id,
        mode: Mode,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>>;

    /// Blocks on the server until the lock is granted (`Some`) or `limit`
    /// passes (`None`; `None` limit: no limit), in one round trip. The
    /// session must be as before when the limit passes.
    fn wait<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        id: &'a Self::Id,
        mode: Mode,
        limit: Option<Duration>,
    ) -> BoxFuture<'a, Result<Option<Granted>, sqlx::Error>>;

    /// Releases the session's hold of `mode` of `id`: whether it held it.
    fn unlock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        id: &'a Self::Id,
        mode: Mode,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    /// Ends session `session` (another one, maybe blocked in a wait),
    /// which releases every lock it holds.
    fn end_session<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        session: u64,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// The cheapest statement the server answers, to keep a session busy.
    fn ping<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Whether `error` means the session is gone, with every lock it held:
    /// the connection failed, or the server ended the session.
    fn ends_the_session(&self, error: &sqlx::Error) -> bool;
}
