//! `Dialect`: the statements one database server speaks.

use std::{fmt, future::Future, hash::Hash, time::Duration};

use dlock_core::{backend::Mode, LockError, LockKey, Token};

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

/// One entry of a queue table (see [`Dialect::queues`]), as
/// [`Dialect::ahead`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueEntry {
    /// Its number: its place in the queue, and its fencing token.
    pub number: i64,
    /// What it takes, as [`Mode::tag`] wrote it.
    pub tag: String,
    /// Its owner's entry lock, as [`Dialect::watch`] takes it.
    pub owner: String,
    /// Whether its owner's session still holds its entry lock: an entry
    /// whose owner's session ended is dead, and anyone may delete it.
    pub live: bool,
}

impl QueueEntry {
    /// Reads [`Dialect::ahead`]'s answer from rows of `(number, tag,
    /// owner, live)` for a key's entries numbered up to `number`, oldest
    /// first (`live` an integer, 0 for dead): the entries ahead of
    /// `number`, and whether `number` itself is among the rows.
    ///
    /// # Errors
    ///
    /// A row whose columns are not of those types.
    pub fn read_rows<R>(rows: &[R], number: i64) -> Result<(Vec<QueueEntry>, bool), sqlx::Error>
    where
        R: sqlx::Row,
        usize: sqlx::ColumnIndex<R>,
        for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        let mut entries = rows
            .iter()
            .map(|row| {
                Ok(QueueEntry {
                    number: row.try_get(0)?,
                    tag: row.try_get(1)?,
                    owner: row.try_get(2)?,
                    live: row.try_get::<i64, _>(3)? != 0,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        let mine = entries.last().is_some_and(|e| e.number == number);
        if mine {
            entries.pop();
        }
        Ok((entries, mine))
    }
}

/// A server session as [`Dialect::open`] opened it: the server's
/// identifier of it, and its incarnation, which tells it from a session
/// of the same identifier on another server or after a restart (see
/// [`Dialect::end_session`]).
///
/// # Examples
///
/// ```
/// let session = dlock_sql::ServerSession {
///     id: 4242,
///     incarnation: "7312214712345/1718000000123456".to_owned(),
/// };
/// assert_eq!(session.id, 4242);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSession {
    /// The server's identifier of the session: PostgreSQL's process id,
    /// MySQL's connection id.
    pub id: u64,
    /// What the dialect compares, on the server, before it ends the
    /// session: PostgreSQL's system identifier and the session's start,
    /// a marker lock the MySQL session holds.
    pub incarnation: String,
}

/// A dialect's connection ([`Dialect::Conn`]) and the server's identifier
/// of the session it opened (PostgreSQL's process id, MySQL's connection
/// id): every statement that takes or gives back a lock checks, with
/// [`check`](SessionConn::check), that it ran there.
#[derive(Debug)]
pub struct SessionConn<C, I> {
    /// The driver's connection.
    pub conn: C,
    /// The server's identifier of the session the connection opened.
    pub id: I,
}

impl<C, I: Copy + PartialEq + Into<i64>> SessionConn<C, I> {
    /// [`Refusal::SessionMoved`] unless `found`, the session a statement
    /// ran on, is this one.
    pub fn check(&self, found: I) -> Result<(), sqlx::Error> {
        if found == self.id {
            return Ok(());
        }
        let (expected, found) = (self.id.into() as u64, found.into() as u64);
        Err(Refusal::SessionMoved { expected, found }.into())
    }
}

/// What a dialect answers besides the driver's own errors, carried in a
/// [`sqlx::Error`] (`.into()`) and read back with [`Refusal::of`].
///
/// # Examples
///
/// ```
/// use dlock_sql::{sqlx, Refusal};
///
/// let moved = Refusal::SessionMoved { expected: 41, found: 42 };
/// let error: sqlx::Error = moved.clone().into();
/// assert_eq!(Refusal::of(&error), Some(&moved));
/// assert!(error.to_string().contains("server session 42, not 41"));
/// let busy: sqlx::Error = Refusal::Busy("the key's enqueue lock".into()).into();
/// assert!(matches!(Refusal::of(&busy), Some(Refusal::Busy(_))));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A statement ran on server session `found`, not `expected`, the one
    /// its connection opened (a pooler in transaction mode, a proxy that
    /// reconnects): an I/O error, so the session counts as ended and every
    /// guard on it is lost.
    SessionMoved {
        /// The server's identifier of the session the connection opened.
        expected: u64,
        /// The one the statement ran on.
        found: u64,
    },
    /// [`setup`](Dialect::setup) found a server that cannot hold its locks
    /// safely: connect fails with [`LockError::UnsafeDeployment`] and this
    /// reason.
    UnsafeDeployment(String),
    /// A statement could not do its work for now and left the session as
    /// it was: try again, within the wait limit.
    Busy(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::SessionMoved { expected, found } => write!(
                f,
                "a statement ran on server session {found}, not {expected}, the one its \
                 connection opened: a pooler in transaction or statement mode, or a proxy \
                 that reconnects, moves statements between server sessions"
            ),
            Refusal::UnsafeDeployment(why) => f.write_str(why),
            Refusal::Busy(why) => write!(f, "busy, try again: {why}"),
        }
    }
}

impl std::error::Error for Refusal {}

impl From<Refusal> for sqlx::Error {
    fn from(refusal: Refusal) -> sqlx::Error {
        match refusal {
            Refusal::SessionMoved { .. } => sqlx::Error::Io(std::io::Error::other(refusal)),
            Refusal::UnsafeDeployment(_) => sqlx::Error::Configuration(Box::new(refusal)),
            Refusal::Busy(_) => sqlx::Error::Decode(Box::new(refusal)),
        }
    }
}

impl Refusal {
    /// The refusal `error` carries, if it carries one.
    pub fn of(error: &sqlx::Error) -> Option<&Refusal> {
        match error {
            sqlx::Error::Io(e) => e.get_ref()?.downcast_ref::<Refusal>(),
            sqlx::Error::Configuration(e) | sqlx::Error::Decode(e) => e.downcast_ref::<Refusal>(),
            _ => None,
        }
    }
}

/// The statements of one database server's session-level named locks.
///
/// A [`SqlBackend`](crate::SqlBackend) decides which session runs what,
/// and keeps them alive; a dialect runs one statement on the connection it
/// is given. Any method's future may be dropped at any point (the backend
/// undoes what it may have done). The server must hold a session's locks
/// until it unlocks them or ends, and end a session idle for the session
/// timeout. Every statement that takes or gives back a lock, and the ping,
/// checks in the same round trip that it runs on the server session
/// [`open`](Dialect::open) identified, and takes nothing and answers
/// [`Refusal::SessionMoved`] when it does not.
///
/// # Examples
///
/// A dialect is used through its backend crate, as a
/// [`SqlBackend`](crate::SqlBackend) of it:
///
/// ```text
/// pub type MyBackend = dlock_sql::SqlBackend<MyDialect>;
/// let backend = MyBackend::connect("my://host/db").await?;
/// ```
pub trait Dialect: Send + Sync + Sized + 'static {
    /// Where and how to connect: the server, the login, and dlock's
    /// settings.
    type Config: Send;
    /// The driver's database, whose pools
    /// [`SqlBackend::from_pool`](crate::SqlBackend::from_pool) takes.
    type Database: sqlx::Database;
    /// The driver's connection.
    type Conn: Send + 'static;
    /// A lock's identifier on the server.
    type Id: Clone + Eq + Hash + fmt::Debug + Send + Sync + 'static;

    /// The backend's name in errors and traces.
    const NAME: &'static str;

    /// Reads a URL of the dialect's scheme.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong.
    fn parse_url(url: &str) -> Result<Self::Config, LockError>;

    /// The config of a pool's connect options, with the default settings.
    fn pool_config(options: ConnectOptions<Self>) -> Self::Config;

    /// The dialect for `config`: its statements, made once.
    fn new(config: Self::Config) -> Self;

    /// The settings shared by every database.
    fn settings(&self) -> &SqlSettings;

    /// Whether grants carry fencing tokens (the token
    /// [`try_lock`](Dialect::try_lock) and [`wait`](Dialect::wait) answer
    /// is ignored otherwise).
    fn fences(&self) -> bool {
        true
    }

    /// The server's identifier of `key` in `mode`, under the lock prefix:
    /// a key's plain lock and its read-write lock are different locks.
    fn lock_id(&self, key: &LockKey, mode: Mode) -> Self::Id;

    /// A number that picks the holder session of `id`: every key always
    /// on the same one.
    fn shard(&self, id: &Self::Id) -> u64;

    /// Opens a session whose server ends it after the session timeout
    /// idle, and returns it with the server's identifier of it and its
    /// incarnation (for [`end_session`](Dialect::end_session)).
    fn open(&self)
        -> impl Future<Output = Result<(Self::Conn, ServerSession), sqlx::Error>> + Send;

    /// Creates what the dialect needs on the server (the fencing sequence
    /// or counter), if it is missing, once at connect.
    fn setup(&self, conn: &mut Self::Conn) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// One attempt at `mode` of `id` without waiting: the fencing token if
    /// it was granted, in the same round trip.
    fn try_lock(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
        mode: Mode,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send;

    /// A read attempt, as [`try_lock`](Dialect::try_lock) in
    /// [`Mode::Read`], on a session that may hold `id` shared already (for
    /// another reader of this process): refused while a writer waits for
    /// `id`. A server grants a session more of a lock it holds at once,
    /// ahead of waiting writers, and a busy process's readers would keep a
    /// writer out for good. The default is a plain attempt, for a dialect
    /// whose reads never stack on a session.
    fn try_read_behind_writers(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send {
        self.try_lock(conn, id, Mode::Read)
    }

    /// Blocks on the server until the lock is granted (`Some`) or `limit`
    /// passes (`None`; `None` limit: no limit), in one round trip. The
    /// session must be as before when the limit passes.
    fn wait(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
        mode: Mode,
        limit: Option<Duration>,
    ) -> impl Future<Output = Result<Option<Granted>, sqlx::Error>> + Send;

    /// Releases the session's hold of `mode` of `id`: whether it held it.
    fn unlock(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
        mode: Mode,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Ends session `session` (another one, maybe blocked in a wait),
    /// which releases every lock it holds, only if `conn`'s server has a
    /// session of that identifier and incarnation: checked in the
    /// statement that ends it, so that a session of the same identifier on
    /// another server (behind a virtual IP, after a failover) or after a
    /// restart is left alone. Ending nothing is not an error.
    fn end_session(
        &self,
        conn: &mut Self::Conn,
        session: &ServerSession,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The cheapest statement the server answers, to keep a session busy,
    /// which checks that the connection is still on its server session
    /// ([`Refusal::SessionMoved`] otherwise).
    fn ping(&self, conn: &mut Self::Conn) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Whether `mode` is kept in the dialect's queue table, for a mode the
    /// server has no lock for (a semaphore, or a read-write lock on a
    /// server with exclusive locks only).
    ///
    /// A queued acquisition takes its *entry lock* (a session lock named
    /// for its token) on the key's holder session and adds an entry, live
    /// while that session holds the entry lock. It holds once
    /// [`admitted`](dlock_core::backend::admitted) behind the live entries
    /// ahead, and waits by blocking on the entry lock of the entry whose
    /// leaving may admit it ([`watch`](Dialect::watch)).
    fn queues(&self, mode: Mode) -> bool;

    /// Whether [`enqueue`](Dialect::enqueue) reads the entries ahead
    /// without their liveness, every one as live: cheaper where liveness
    /// costs a scan (PostgreSQL's `pg_locks`). Counting a dead entry as
    /// live can only refuse, never admit too many: an entry refused on such
    /// a read reads them again with [`ahead`](Dialect::ahead) before it
    /// waits.
    fn enqueue_counts_all_as_live(&self) -> bool {
        false
    }

    /// Takes the entry lock of `token` on this session, adds its entry for
    /// `id` in `mode` to the queue table, and reads the entries ahead of it
    /// as [`ahead`](Dialect::ahead) does (or, see
    /// [`enqueue_counts_all_as_live`](Dialect::enqueue_counts_all_as_live),
    /// every one as live), in one round trip: the entry's number, and the
    /// entries ahead.
    fn enqueue(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
        mode: Mode,
        token: &Token,
    ) -> impl Future<Output = Result<(i64, Vec<QueueEntry>), sqlx::Error>> + Send;

    /// The entries of `id` numbered below `number`, oldest first, with
    /// whether each is live; and whether entry `number` itself is still in
    /// the table.
    ///
    /// Numbers must be given in the order entries become visible: an entry
    /// numbered below one already read must never appear later (serialize
    /// the enqueues of one `id`, for example under a lock held until the
    /// insert commits), or two entries could each miss the other.
    fn ahead(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
        number: i64,
    ) -> impl Future<Output = Result<(Vec<QueueEntry>, bool), sqlx::Error>> + Send;

    /// Deletes `token`'s entry and releases its entry lock on this
    /// session (after the delete where the server orders them, so a
    /// watcher that wakes finds the entry gone): whether the entry was
    /// still there.
    fn dequeue(
        &self,
        conn: &mut Self::Conn,
        token: &Token,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Deletes the dead entries numbered `numbers` (their owners' sessions
    /// ended).
    fn remove(
        &self,
        conn: &mut Self::Conn,
        numbers: &[i64],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Blocks until the entry lock `owner` (a [`QueueEntry::owner`]) is
    /// free or `limit` passes (`None`: no limit), and leaves it free:
    /// whether it was seen free.
    fn watch(
        &self,
        conn: &mut Self::Conn,
        owner: &str,
        limit: Option<Duration>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// On the session that holds plain lock `id` for `token`: records the
    /// hold, its `fence` and `value`, in the holders' table, live while
    /// the session holds `token`'s entry lock (taken here unless the
    /// session holds it already: the server's session locks stack, and
    /// [`disclaim`](Dialect::disclaim) releases it once).
    fn proclaim(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
        token: &Token,
        fence: i64,
        value: &[u8],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// On the same session, before the plain lock is released: deletes
    /// the hold's record and releases its entry lock. Harmless when the
    /// hold recorded nothing (a proclaim dropped before it was sent).
    fn disclaim(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
        token: &Token,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Whether plain lock `id` is held, on any session: if so, the fence
    /// and value its holder recorded, if the record is the holder's own
    /// (its session still holds the record's entry lock).
    #[allow(clippy::type_complexity)]
    fn holder(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
    ) -> impl Future<Output = Result<Option<(Option<i64>, Option<Vec<u8>>)>, sqlx::Error>> + Send;

    /// What stops a listing of the keys that start with `prefix`, if
    /// something does, known without asking the server: the listing is
    /// refused before it takes a session. The default cannot list.
    fn list_refused(&self, prefix: &str) -> Option<&'static str> {
        let _ = prefix;
        Some("listing of held locks")
    }

    /// One page of the locks held on the server whose keys start with
    /// `prefix`, after `after`, at most `limit`: `Err` with what stops it
    /// where the dialect cannot list (see [`Backend::list`]). The default
    /// cannot.
    ///
    /// [`Backend::list`]: dlock_core::backend::Backend::list
    #[allow(clippy::type_complexity)]
    fn list(
        &self,
        conn: &mut Self::Conn,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> impl Future<Output = Result<Result<dlock_core::backend::ListPage, &'static str>, sqlx::Error>>
           + Send {
        let _ = (conn, prefix, after, limit);
        std::future::ready(Ok(Err("listing of held locks")))
    }

    /// Ends the server session that holds plain lock `id`, unless it is
    /// `conn`'s own: the server then frees the lock, and every other lock
    /// of that session. `true` if a session was ended.
    fn end_holder(
        &self,
        conn: &mut Self::Conn,
        id: &Self::Id,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// The right [`end_holder`](Dialect::end_holder) lacked, if `error`
    /// is the server refusing it for want of one: named in
    /// [`LockError::PermissionDenied`](dlock_core::LockError::PermissionDenied).
    fn missing_right(&self, error: &sqlx::Error) -> Option<&'static str>;

    /// Whether `error` means the session is gone, with every lock it held:
    /// the connection failed, or the server ended the session.
    fn ends_the_session(&self, error: &sqlx::Error) -> bool;
}

/// The driver's connect options of dialect `D`'s database.
pub type ConnectOptions<D> =
    <<<D as Dialect>::Database as sqlx::Database>::Connection as sqlx::Connection>::Options;
