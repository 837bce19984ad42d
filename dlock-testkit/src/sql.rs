//! The checks every database backend (PostgreSQL, MySQL and MariaDB) runs
//! against real servers of its own, written once over [`SqlServer`]: the
//! fixture of a dialect's server, and the few things its checks do
//! differently (how a test sees dlock's sessions and ends them).
//! [`sql_tests!`](crate::sql_tests) turns them into one `#[tokio::test]`
//! each; [`harness`] is the conformance harness of a server's URL.
//!
//! ```text
//! dlock_testkit::sql_tests!(dlock_testkit::fixture::PostgresServer);
//! ```

use std::{future::Future, sync::Arc, time::Duration};

use dlock_core::{
    backend::{Backend, DynBackend, Mode},
    BackendExt, LockError, LockOptions, Locker,
};
use tokio::time::Instant;

use crate::{
    database_faults,
    fixture::{free_port, FixtureError, TcpProxy, TestCerts},
    session_faults, Harness,
};

/// A database server fixture, and what the checks of [`sql_tests!`]
/// need of its dialect.
///
/// [`sql_tests!`]: crate::sql_tests
pub trait SqlServer: Sized + Send + Sync + 'static {
    /// The backend its URLs connect.
    type Backend: Backend + Clone;
    /// The backend's name, in harness names.
    const NAME: &'static str;
    /// The fixture's password, which no error may show.
    const PASSWORD: &'static str;
    /// The modes the dialect keeps in its queue table.
    const QUEUED: &'static [Mode];
    /// The URL parameter that turns TLS off.
    const NO_TLS: &'static str;
    /// The URL parameters that verify the server's certificate and name
    /// against a CA, whose file's path follows.
    const VERIFY_WITH_CA: &'static str;

    /// Starts a server on a free port.
    ///
    /// # Errors
    ///
    /// When the server does not start.
    fn start() -> Result<Self, FixtureError>;
    /// Starts a server that takes TCP connections over TLS only.
    ///
    /// # Errors
    ///
    /// When the server does not start.
    fn start_tls(certs: &TestCerts) -> Result<Self, FixtureError>;
    /// A URL that logs in over TLS, trusting `certs`' CA.
    fn tls_url(&self, certs: &TestCerts) -> String;
    /// A URL of a login with rights on dlock's database, no query.
    fn url(&self) -> String;
    /// `127.0.0.1:PORT`.
    fn host_port(&self) -> String;
    /// Kills the server and starts it again on the same data.
    ///
    /// # Errors
    ///
    /// When it does not start again.
    fn restart(&mut self) -> Result<(), FixtureError>;
    /// Connects a backend.
    fn connect(url: &str) -> impl Future<Output = Result<Self::Backend, LockError>> + Send;
    /// A backend on the connect options of a pool the application made
    /// from `url`.
    fn from_pool(url: &str) -> impl Future<Output = Result<Self::Backend, LockError>> + Send;
    /// The server's identifiers of dlock's sessions, read from an admin's
    /// connection.
    fn dlock_sessions(&self) -> impl Future<Output = Vec<i64>> + Send;
    /// Ends every one of dlock's sessions from an admin's connection:
    /// how many.
    fn end_dlock_sessions(&self) -> impl Future<Output = usize> + Send;
    /// Pauses (SIGSTOP) the process that runs the session of the last
    /// lock statement (PostgreSQL's session process, MariaDB's whole
    /// server): answers what resumes it.
    fn pause_holder(&mut self) -> impl Future<Output = Resume<Self>> + Send;
    /// How many entries the queue table `dlock_queue` holds.
    fn queue_entries(&self) -> impl Future<Output = i64> + Send;

    /// [`url`](SqlServer::url) through port `port` of this host (a proxy
    /// in front of the server).
    fn url_at(&self, port: u16) -> String {
        let at = format!("127.0.0.1:{port}");
        self.url().replace(&self.host_port(), &at)
    }
}

/// What resumes a paused process of server `S`.
pub type Resume<S> = Box<dyn FnOnce(&mut S) + Send>;

/// The conformance harness of clients of `url` (which may have a query),
/// with a short session timeout, so that crashed clients let others in
/// quickly.
pub fn harness<S: SqlServer>(name: &str, url: &str) -> Harness {
    let session = Duration::from_secs(2);
    let glue = if url.contains('?') { '&' } else { '?' };
    let url = format!("{url}{glue}session_timeout={}ms", session.as_millis());
    Harness::new(name, move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(S::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
    .disconnect_releases()
}

/// [`harness`] over TLS, on a server that takes TLS only, with
/// certificates made here.
pub fn tls_harness<S: SqlServer>() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let server = S::start_tls(&certs).expect("start the server with TLS");
    let name = format!("{} over TLS", S::NAME);
    harness::<S>(&name, &server.tls_url(&certs)).keep_alive((server, certs))
}

async fn locker<S: SqlServer>(url: &str) -> Locker {
    let backend = S::connect(url).await;
    backend.expect("connect to the server").into_locker()
}

/// An uncontended attempt dropped after it was sent, and before the server
/// answered: the server grants the lock to the holder session once it
/// reads the statement, and nobody would ever release it. The backend
/// unlocks it after the answer; the key is free at once for another
/// client. Made deterministic by pausing the process that runs the holder
/// session while the attempt is in flight.
pub async fn a_try_lock_dropped_in_flight_leaves_no_lock<S: SqlServer>() {
    let mut server = S::start().expect("start the server");
    let a = locker::<S>(&format!("{}?holder_sessions=1", server.url())).await;
    // The attempt's statement is prepared on the session once, so that
    // the one dropped below is sent whole.
    let warm = a.try_lock("warm-up").await.unwrap().unwrap();
    warm.release().await.unwrap();
    // The holder session, and the idle waiter session that connect
    // opened beside it (to check that connections keep their server
    // sessions).
    let sessions = server.dlock_sessions().await;
    assert_eq!(
        sessions.len(),
        2,
        "a holder and a waiter session: {sessions:?}"
    );
    let resume = server.pause_holder().await;
    let attempt = tokio::time::timeout(Duration::from_millis(300), a.try_lock("in-flight")).await;
    resume(&mut server);
    assert!(attempt.is_err(), "the paused server answered: {attempt:?}");
    let b = locker::<S>(&server.url()).await;
    let started = Instant::now();
    let taken = b
        .lock_with("in-flight", LockOptions::new().wait(Duration::from_secs(5)))
        .await
        .expect("the dropped attempt's lock was never released");
    assert!(started.elapsed() < Duration::from_secs(2));
    taken.release().await.unwrap();
}

/// A few sessions (4 holder sessions per client) hold 10,000 locks at
/// once, each exclusive, and give them all back.
pub async fn one_session_holds_ten_thousand_locks<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let (a, b) = (
        locker::<S>(&server.url()).await,
        locker::<S>(&server.url()).await,
    );
    let mut guards = Vec::with_capacity(10_000);
    for i in 0..10_000 {
        let guard = a.try_lock(format!("many:{i}")).await.unwrap();
        guards.push(guard.unwrap_or_else(|| panic!("many:{i} was refused")));
    }
    let sessions = server.dlock_sessions().await.len();
    assert!(
        sessions <= 8,
        "{sessions} sessions: more than 4 holder sessions each"
    );
    for i in [0, 4_999, 9_999] {
        assert!(b.try_lock(format!("many:{i}")).await.unwrap().is_none());
    }
    assert!(guards.iter().all(|g| !g.is_lost()));
    for guard in guards {
        guard.release().await.unwrap();
    }
    for i in [0, 4_999, 9_999] {
        assert!(b.try_lock(format!("many:{i}")).await.unwrap().is_some());
    }
}

/// Wrong password, missing database, nothing listening, and a server that
/// speaks another protocol: each a typed error, within the connect
/// timeout, with no panic.
pub async fn bad_servers_and_logins_are_typed_errors<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let url = server.url();
    let no_password = |port| {
        server
            .url_at(port)
            .replace(&format!(":{}@", S::PASSWORD), "@")
    };
    let (database_at, _) = url.rsplit_once('/').expect("a database");
    let cases = [
        ("wrong password", url.replace(S::PASSWORD, "wrong")),
        ("missing database", format!("{database_at}/nope")),
        ("nothing listening", no_password(free_port().unwrap())),
        (
            "another protocol",
            no_password(database_faults::garbage_speaker().await),
        ),
    ];
    database_faults::check_bad_servers_are_typed_errors(
        |url| async move { S::connect(&url).await },
        &cases,
        S::PASSWORD,
    )
    .await;
}

/// A server restart (SIGKILL, then crash recovery on the same data) ends
/// every session, and their locks go at once: every guard on them reports
/// lost at its session's next ping, within a third of the session timeout
/// (the window in which the server has already let the key go, as after a
/// Redis restart without persistence), and fencing tokens keep growing
/// (the sequence or counter rows are data the server keeps), so the next
/// owner's token is above every earlier one.
pub async fn a_restart_loses_every_guard_and_keeps_fencing<S: SqlServer>() {
    let mut server = S::start().expect("start the server");
    let url = format!("{}?session_timeout=3s", server.url());
    let (holder, other) = (locker::<S>(&url).await, locker::<S>(&url).await);
    database_faults::check_restart_loses_every_guard(
        &holder,
        &other,
        Duration::from_secs(3),
        || server.restart(),
    )
    .await;
}

/// Ends the session that holds an abandoned token: both guards on it are
/// lost, the key goes within the session timeout (at once here: the
/// connection closes), and later locks use a new session.
pub async fn abandon_gives_up_the_session<S: SqlServer>() {
    let server = S::start().expect("start the server");
    // One holder session, so that both guards are on the session given up.
    let url = format!("{}?session_timeout=2s&holder_sessions=1", server.url());
    let backend = S::connect(&url).await.unwrap();
    let holder = backend.clone().into_locker();
    let other = locker::<S>(&url).await;
    session_faults::check_abandon_gives_up_the_session(
        &backend,
        &holder,
        &other,
        Duration::from_secs(2),
    )
    .await;
}

/// A proxy in front of `server`, and a locker through it with `options`.
async fn through_a_proxy<S: SqlServer>(server: &S, options: &str) -> (TcpProxy, Locker) {
    let proxy = TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let through = locker::<S>(&format!("{}?{options}", server.url_at(proxy.port()))).await;
    (proxy, through)
}

/// A connection cut under a held lock (a proxy that resets it, as a
/// restarted connection pooler or load balancer does): the server ends the
/// session and gives the key to the next client at once. The cut client's
/// guard learns it at its session's next ping, within a third of the
/// session timeout; meanwhile the next owner's fencing token is greater,
/// so a store that checks tokens refuses the cut client's late writes.
pub async fn a_cut_connection_hands_the_key_on_and_the_guard_learns_it<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let (proxy, cut) = through_a_proxy(&server, "session_timeout=3s").await;
    let other = locker::<S>(&format!("{}?session_timeout=3s", server.url())).await;
    database_faults::check_cut_connection_hands_the_key_on(
        &cut,
        &other,
        &proxy,
        Duration::from_secs(3),
    )
    .await;
}

/// A waiter whose wait the server cut short by restarting waits again on
/// a new session, within its wait limit, and gets the key (its holder's
/// session went with the restart), with a token above the holder's.
pub async fn a_wait_outlives_a_server_restart<S: SqlServer>() {
    let mut server = S::start().expect("start the server");
    let url = format!("{}?session_timeout=3s", server.url());
    let (holder, waiter) = (locker::<S>(&url).await, locker::<S>(&url).await);
    database_faults::check_wait_outlives_a_restart(&holder, waiter, || server.restart()).await;
}

/// A backend on the connect options of the application's own pool locks
/// the same keys as one built from a URL: each excludes the other, and
/// fencing tokens grow across both.
pub async fn a_backend_from_the_applications_pool_shares_the_locks<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let own = S::from_pool(&server.url())
        .await
        .expect("a backend from the pool")
        .into_locker();
    let by_url = locker::<S>(&server.url()).await;
    crate::assert_locks_are_shared(&own, &by_url).await;
}

/// Every client session ended by the server while one client holds a lock
/// kept in the queue table (each of [`SqlServer::QUEUED`]) and another
/// waits for it: the waiter gets it once the holder's session is gone,
/// and the key is not wedged for a third client (see
/// [`check_a_queued_wait_outlives_ended_sessions`](database_faults::check_a_queued_wait_outlives_ended_sessions)).
pub async fn a_queued_wait_outlives_ended_sessions<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let url = format!("{}?session_timeout=3s", server.url());
    for &mode in S::QUEUED {
        let (holder, waiter) = (locker::<S>(&url).await, locker::<S>(&url).await);
        let third = locker::<S>(&url).await;
        let end_sessions = async {
            let ended = server.end_dlock_sessions().await;
            assert!(ended >= 3, "only {ended} sessions to end");
        };
        database_faults::check_a_queued_wait_outlives_ended_sessions(
            &holder,
            waiter,
            &third,
            mode,
            end_sessions,
        )
        .await;
    }
}

/// A lock won by waiting frees its waiter slot at the grant: with
/// `max_waiters=1`, a client that holds such a lock can still wait for
/// another key (see
/// [`check_a_lock_won_by_waiting_frees_its_waiter_slot`](database_faults::check_a_lock_won_by_waiting_frees_its_waiter_slot)).
pub async fn a_lock_won_by_waiting_frees_its_waiter_slot<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let waits = locker::<S>(&format!("{}?max_waiters=1", server.url())).await;
    let other = locker::<S>(&server.url()).await;
    database_faults::check_a_lock_won_by_waiting_frees_its_waiter_slot(&waits, &other).await;
}

/// A connection whose traffic is dropped, not refused, under a held lock:
/// the guard reports lost within the session timeout and before another
/// client gets the key, and lock calls through it answer in bounded time
/// (see
/// [`check_a_black_holed_connection_is_bounded`](database_faults::check_a_black_holed_connection_is_bounded)).
pub async fn a_black_holed_connection_is_bounded<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let session = Duration::from_secs(3);
    let options = "session_timeout=3s&connect_timeout=2s&holder_sessions=1";
    let (proxy, holed) = through_a_proxy(&server, options).await;
    let other = locker::<S>(&format!("{}?{options}", server.url())).await;
    // A ping's wait, the statement's own deadline, and a connect attempt.
    let bound = 2 * session + Duration::from_secs(3);
    database_faults::check_a_black_holed_connection_is_bounded(
        &holed, &other, &proxy, session, bound,
    )
    .await;
}

/// A queue entry (of each of [`SqlServer::QUEUED`]) whose session ended
/// stays in the table until the next enqueue of its key reads it as dead;
/// for a key nobody locks again, the next connect deletes it.
pub async fn dead_queue_entries_are_reaped_at_connect<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let url = format!("{}?session_timeout=3s", server.url());
    for &mode in S::QUEUED {
        let held = locker::<S>(&url)
            .await
            .lock_mode("reaped", mode, LockOptions::new())
            .await
            .expect("a queued lock");
        assert_eq!(server.queue_entries().await, 1, "{mode:?}: the entry");
        server.end_dlock_sessions().await;
        tokio::time::timeout(Duration::from_secs(5), held.lost())
            .await
            .expect("the lock's guard learned its session ended");
        let dead = server.queue_entries().await;
        assert_eq!(dead, 1, "{mode:?}: the dead entry stays");
        let _next = locker::<S>(&url).await;
        let reaped = server.queue_entries().await;
        assert_eq!(reaped, 0, "{mode:?}: the dead entry was not reaped");
    }
}

/// Fixed leases that were released leave no task behind (see
/// [`check_released_fixed_leases_leave_no_tasks`](session_faults::check_released_fixed_leases_leave_no_tasks)).
pub async fn released_fixed_leases_leave_no_timer_tasks_behind<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let locker = locker::<S>(&server.url()).await;
    session_faults::check_released_fixed_leases_leave_no_tasks(&locker).await;
}

/// `Locker::state` follows the sessions: a cut connection ends the
/// holder's session with its lock on it (`Lost`; a session is one
/// connection, so there is no `Suspended`), and the next session opened
/// is `Reconnected`.
pub async fn connection_state_follows_the_sessions<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let (proxy, locker) = through_a_proxy(&server, "session_timeout=3s").await;
    session_faults::check_connection_states(&locker, &proxy, None, Duration::from_secs(10)).await;
}

/// A lock polled once and then parked (a `&mut` future in a `select!`
/// loop) holds up none of the client's other locks on its session: its
/// statement is in flight on the one connection they share, and the next
/// statement reads its answer (see
/// [`check_a_parked_lock_blocks_nothing`](session_faults::check_a_parked_lock_blocks_nothing)).
pub async fn a_parked_lock_holds_up_nothing_on_its_session<S: SqlServer>() {
    let server = S::start().expect("start the server");
    let client = locker::<S>(&format!("{}?holder_sessions=1", server.url())).await;
    let other = locker::<S>(&server.url()).await;
    session_faults::check_a_parked_lock_blocks_nothing(&client, &other).await;
}

/// Without TLS the server refuses the login, and with a CA that did not
/// sign the server's certificate the client refuses the server: typed
/// errors, in bounded time.
pub async fn untrusted_or_plain_connections_are_typed_errors<S: SqlServer>() {
    let certs = TestCerts::generate().expect("certificates");
    let server = S::start_tls(&certs).expect("start the server with TLS");
    let other = TestCerts::generate().expect("a CA the server does not know");
    let url = server.url();
    let cases = [
        ("no TLS", format!("{url}?{}&connect_timeout=5s", S::NO_TLS)),
        (
            "a server signed by a CA the client does not trust",
            format!(
                "{url}?{}{}&connect_timeout=5s",
                S::VERIFY_WITH_CA,
                other.ca().display()
            ),
        ),
    ];
    crate::assert_refused(&cases, |url| async move {
        Ok(S::connect(&url).await?.into_locker())
    })
    .await;
}

/// `force_release` through `without`, a login that may not end the
/// holder's session, of a key `holder` holds: `PermissionDenied` naming
/// `right`, and the lock stays held. Through the locker `with` answers (a
/// login given the right), the same call frees it, and the holder's guard
/// is told.
///
/// # Panics
///
/// When a check fails.
pub async fn check_forcing_a_release_needs_the_right(
    holder: &Locker,
    without: &Locker,
    right: &str,
    with: impl Future<Output = Locker>,
) {
    let guard = holder.lock("stuck").await.unwrap();
    match without.force_release("stuck").await {
        Err(e @ LockError::PermissionDenied { .. }) => {
            assert!(e.to_string().contains(right), "{e}")
        }
        other => panic!("a login without the right forced the release: {other:?}"),
    }
    assert!(!guard.is_lost(), "{:?}", guard.state());
    assert!(
        without.try_lock("stuck").await.unwrap().is_none(),
        "the refused force freed the lock"
    );
    assert!(with.await.force_release("stuck").await.unwrap());
    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the holder's guard was not told");
}

/// Generates the tests of this module for a [`SqlServer`] fixture type.
///
/// - `sql_tests!(Server)`: one `#[tokio::test]` per check, each on a
///   server of its own.
/// - `sql_tests!(tls Server)`: the whole conformance suite over TLS
///   (`whole_suite_over_tls`, see [`tls_harness`]), and
///   `untrusted_or_plain_connections_are_typed_errors`.
#[macro_export]
macro_rules! sql_tests {
    (tls $server:ty) => {
        $crate::conformance_tests!(suite whole_suite_over_tls, $crate::sql::tls_harness::<$server>());
        $crate::sql_tests!(@each $server, untrusted_or_plain_connections_are_typed_errors);
    };
    ($server:ty) => {
        $crate::sql_tests!(@each $server,
            a_try_lock_dropped_in_flight_leaves_no_lock,
            one_session_holds_ten_thousand_locks,
            bad_servers_and_logins_are_typed_errors,
            a_restart_loses_every_guard_and_keeps_fencing,
            abandon_gives_up_the_session,
            a_cut_connection_hands_the_key_on_and_the_guard_learns_it,
            a_wait_outlives_a_server_restart,
            a_backend_from_the_applications_pool_shares_the_locks,
            a_queued_wait_outlives_ended_sessions,
            a_lock_won_by_waiting_frees_its_waiter_slot,
            a_black_holed_connection_is_bounded,
            dead_queue_entries_are_reaped_at_connect,
            released_fixed_leases_leave_no_timer_tasks_behind,
            connection_state_follows_the_sessions,
            a_parked_lock_holds_up_nothing_on_its_session,
        );
    };
    (@each $server:ty, $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                $crate::sql::$check::<$server>().await;
            }
        )*
    };
}

/// The [`SqlServer`] methods a fixture has of its own, and the backend's
/// constructors (`$pool` is the driver's pool, for `from_pool`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! fixture_and_backend {
    ($fixture:ident, $backend:ident, $pool:ty) => {
        fn start() -> Result<Self, FixtureError> {
            $fixture::start()
        }
        fn start_tls(certs: &TestCerts) -> Result<Self, FixtureError> {
            $fixture::start_tls(certs)
        }
        fn tls_url(&self, certs: &TestCerts) -> String {
            $fixture::tls_url(self, certs)
        }
        fn url(&self) -> String {
            $fixture::url(self)
        }
        fn host_port(&self) -> String {
            $fixture::host_port(self)
        }
        fn restart(&mut self) -> Result<(), FixtureError> {
            $fixture::restart(self)
        }
        async fn connect(url: &str) -> Result<$backend, LockError> {
            $backend::connect(url).await
        }
        async fn from_pool(url: &str) -> Result<$backend, LockError> {
            let pool = <$pool>::connect(url).await.expect("the application's pool");
            $backend::from_pool(&pool).await
        }
    };
}

#[cfg(feature = "postgres")]
mod postgres {
    use dlock::postgres::{sqlx, PgBackend};
    use dlock_core::{backend::Mode, LockError};
    use sqlx::Connection;

    use super::{Resume, SqlServer};
    use crate::fixture::{FixtureError, PostgresServer, TestCerts, POSTGRES_PASSWORD};

    /// The integers `sql` answers, from a connection of the server's admin.
    async fn ints(server: &PostgresServer, sql: &str) -> Vec<i64> {
        let mut conn = sqlx::PgConnection::connect(&server.url())
            .await
            .expect("connect");
        sqlx::query_scalar(sql)
            .fetch_all(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// dlock's sessions are those of `application_name = 'dlock'`; the
    /// holder's process is the one whose last statement took or gave back
    /// an advisory lock, beside waiter sessions that only pinged.
    impl SqlServer for PostgresServer {
        type Backend = PgBackend;
        const NAME: &'static str = "postgres";
        const PASSWORD: &'static str = POSTGRES_PASSWORD;
        const QUEUED: &'static [Mode] = &[Mode::Permits { count: 1, limit: 1 }];
        const NO_TLS: &'static str = "sslmode=disable";
        const VERIFY_WITH_CA: &'static str = "sslmode=verify-full&sslrootcert=";

        fixture_and_backend!(PostgresServer, PgBackend, sqlx::PgPool);
        async fn dlock_sessions(&self) -> Vec<i64> {
            let sql = "SELECT pid::bigint FROM pg_stat_activity \
                       WHERE application_name = 'dlock' ORDER BY pid";
            ints(self, sql).await
        }
        async fn end_dlock_sessions(&self) -> usize {
            let sql = "SELECT pg_terminate_backend(pid)::int::bigint FROM pg_stat_activity \
                       WHERE application_name = 'dlock'";
            ints(self, sql).await.len()
        }
        async fn pause_holder(&mut self) -> Resume<Self> {
            let sql = "SELECT pid::bigint FROM pg_stat_activity \
                       WHERE application_name = 'dlock' AND query LIKE '%advisory%'";
            let pids = ints(self, sql).await;
            assert_eq!(pids.len(), 1, "the holder session: {pids:?}");
            let pid = pids[0] as libc::pid_t;
            let signal = move |signal| {
                // SAFETY: kill has no memory preconditions; a stale PID is
                // an error code, checked below.
                let rc = unsafe { libc::kill(pid, signal) };
                assert_eq!(rc, 0, "kill({pid}, {signal})");
            };
            signal(libc::SIGSTOP);
            Box::new(move |_| signal(libc::SIGCONT))
        }
        async fn queue_entries(&self) -> i64 {
            ints(self, "SELECT count(*) FROM dlock_queue").await[0]
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use dlock::mysql::{sqlx, MySqlBackend};
    use dlock_core::{backend::Mode, LockError};
    use sqlx::{Connection, Executor};

    use super::{Resume, SqlServer};
    use crate::fixture::{FixtureError, MariaDbServer, TestCerts, MARIADB_PASSWORD};

    /// A connection of the server's admin, who may do anything.
    async fn admin(server: &MariaDbServer) -> sqlx::MySqlConnection {
        sqlx::MySqlConnection::connect(&server.admin_url())
            .await
            .expect("an admin's connection")
    }

    /// The integers `sql` answers, from an admin's connection.
    async fn ints(server: &MariaDbServer, sql: &str) -> Vec<i64> {
        sqlx::query_scalar(sql)
            .fetch_all(&mut admin(server).await)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// dlock's sessions are those of user `dlock`; a pause stops the
    /// whole server.
    impl SqlServer for MariaDbServer {
        type Backend = MySqlBackend;
        const NAME: &'static str = "mysql";
        const PASSWORD: &'static str = MARIADB_PASSWORD;
        const QUEUED: &'static [Mode] = &[Mode::Write, Mode::Permits { count: 1, limit: 1 }];
        const NO_TLS: &'static str = "ssl-mode=DISABLED";
        const VERIFY_WITH_CA: &'static str = "ssl-mode=VERIFY_IDENTITY&ssl-ca=";

        fixture_and_backend!(MariaDbServer, MySqlBackend, sqlx::MySqlPool);
        async fn dlock_sessions(&self) -> Vec<i64> {
            let sql = "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST \
                       WHERE USER = 'dlock' ORDER BY ID";
            ints(self, sql).await
        }
        async fn end_dlock_sessions(&self) -> usize {
            let ids = self.dlock_sessions().await;
            let mut admin = admin(self).await;
            for id in &ids {
                // A session may end on its own meanwhile.
                let _ = admin
                    .execute(format!("KILL CONNECTION {id}").as_str())
                    .await;
            }
            ids.len()
        }
        async fn pause_holder(&mut self) -> Resume<Self> {
            self.process().pause().expect("pause the server");
            Box::new(|server: &mut Self| server.process().resume().expect("resume the server"))
        }
        async fn queue_entries(&self) -> i64 {
            ints(self, "SELECT COUNT(*) FROM dlock_queue").await[0]
        }
    }
}
