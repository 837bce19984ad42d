//! PostgreSQL-specific properties, against a real server: an attempt
//! dropped while the server works on it leaves no lock behind, one
//! session holds 10,000 locks, and bad input or a bad server is a typed
//! error, in bounded time.

use std::time::Duration;

use dlock_core::{BackendExt, LockError, LockOptions, Locker};
use dlock_postgres::PgBackend;
use dlock_testkit::database_faults;
use dlock_testkit::fixture::{PostgresServer, POSTGRES_PASSWORD};
use tokio::time::Instant;

async fn locker(url: &str) -> Locker {
    PgBackend::connect(url)
        .await
        .expect("connect to PostgreSQL")
        .into_locker()
}

/// The server processes of the sessions that `application_name = 'dlock'`
/// opened, from a connection of our own.
async fn dlock_sessions(url: &str) -> Vec<i32> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'dlock' ORDER BY pid",
    )
    .fetch_all(&mut conn)
    .await
    .expect("pg_stat_activity")
}

/// The server process of the dlock session whose last statement took or
/// gave back an advisory lock: the holder session, beside waiter sessions
/// that only pinged.
async fn holder_session(url: &str) -> i32 {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'dlock' \
         AND query LIKE '%advisory%'",
    )
    .fetch_one(&mut conn)
    .await
    .expect("the holder session in pg_stat_activity")
}

fn signal(pid: i32, signal: i32) {
    // SAFETY: kill has no memory preconditions; a stale PID is an error
    // code, checked below.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(rc, 0, "kill({pid}, {signal})");
}

/// An uncontended attempt dropped after it was sent, and before the server
/// answered: the server grants the lock to the holder session once it
/// reads the statement, and nobody would ever release it. The backend
/// unlocks it after the answer; the key is free at once for another
/// client. Made deterministic by pausing the session's server process
/// while the attempt is in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_lock_dropped_in_flight_leaves_no_lock() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let a = locker(&format!("{}?holder_sessions=1", server.url())).await;
    // The attempt's statement is prepared on the session once, so that
    // the one dropped below is sent whole.
    a.try_lock("warm-up")
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    // The holder session, and the idle waiter session that connect
    // opened beside it (to check that connections keep their server
    // sessions): the holder is the one that ran the attempt.
    let sessions = dlock_sessions(&server.url()).await;
    assert_eq!(
        sessions.len(),
        2,
        "a holder and a waiter session: {sessions:?}"
    );
    let holder = holder_session(&server.url()).await;
    signal(holder, libc::SIGSTOP);
    let attempt = tokio::time::timeout(Duration::from_millis(300), a.try_lock("in-flight")).await;
    signal(holder, libc::SIGCONT);
    assert!(attempt.is_err(), "the paused server answered: {attempt:?}");
    let b = locker(&server.url()).await;
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_session_holds_ten_thousand_locks() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let (a, b) = (locker(&server.url()).await, locker(&server.url()).await);
    let mut guards = Vec::with_capacity(10_000);
    for i in 0..10_000 {
        let guard = a.try_lock(format!("many:{i}")).await.unwrap();
        guards.push(guard.unwrap_or_else(|| panic!("many:{i} was refused")));
    }
    let sessions = dlock_sessions(&server.url()).await.len();
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_servers_and_logins_are_typed_errors() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let port = server.host_port().rsplit(':').next().unwrap().to_owned();
    let other_port = database_faults::garbage_speaker().await;
    let closed = dlock_testkit::fixture::free_port().unwrap();
    let cases = [
        (
            "wrong password",
            format!("postgres://postgres:wrong@127.0.0.1:{port}/postgres"),
        ),
        (
            "missing database",
            format!("postgres://postgres:{POSTGRES_PASSWORD}@127.0.0.1:{port}/nope"),
        ),
        (
            "nothing listening",
            format!("postgres://postgres@127.0.0.1:{closed}/postgres"),
        ),
        (
            "another protocol",
            format!("postgres://postgres@127.0.0.1:{other_port}/postgres"),
        ),
    ];
    database_faults::check_bad_servers_are_typed_errors(
        |url| async move { PgBackend::connect(&url).await },
        &cases,
        POSTGRES_PASSWORD,
    )
    .await;
}

/// A server restart (SIGKILL, then crash recovery on the same data) ends
/// every session, and their locks go at once: every guard on them reports
/// lost at its session's next ping, within a third of the session timeout
/// (the window in which the server has already let the key go, as after a
/// Redis restart without persistence), and fencing tokens keep growing (the
/// sequence is data the server keeps), so the next owner's token is above
/// every earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_loses_every_guard_and_keeps_fencing() {
    let mut server = PostgresServer::start().expect("start PostgreSQL");
    let url = format!("{}?session_timeout=3s", server.url());
    let (holder, other) = (locker(&url).await, locker(&url).await);
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandon_gives_up_the_session() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    // One holder session, so that both guards are on the session given up.
    let url = format!("{}?session_timeout=2s&holder_sessions=1", server.url());
    let backend = PgBackend::connect(&url).await.unwrap();
    let holder = backend.clone().into_locker();
    let other = locker(&url).await;
    dlock_testkit::session_faults::check_abandon_gives_up_the_session(
        &backend,
        &holder,
        &other,
        Duration::from_secs(2),
    )
    .await;
}

/// A connection cut under a held lock (a proxy that resets it, as a
/// restarted connection pooler or load balancer does): the server ends the
/// session and gives the key to the next client at once. The cut client's
/// guard learns it at its session's next ping, within a third of the
/// session timeout; meanwhile the next owner's fencing token is greater,
/// so a store that checks tokens refuses the cut client's late writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_hands_the_key_on_and_the_guard_learns_it() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let proxy = dlock_testkit::fixture::TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let through_proxy = format!(
        "postgres://postgres:{POSTGRES_PASSWORD}@127.0.0.1:{}/postgres?session_timeout=3s",
        proxy.port()
    );
    let cut = locker(&through_proxy).await;
    let other = locker(&format!("{}?session_timeout=3s", server.url())).await;
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_outlives_a_server_restart() {
    let mut server = PostgresServer::start().expect("start PostgreSQL");
    let url = format!("{}?session_timeout=3s", server.url());
    let (holder, waiter) = (locker(&url).await, locker(&url).await);
    database_faults::check_wait_outlives_a_restart(&holder, waiter, || server.restart()).await;
}

/// A backend on the connect options of the application's own pool locks
/// the same keys as one built from a URL: each excludes the other, and
/// fencing tokens grow across both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_from_the_applications_pool_shares_the_locks() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let pool = dlock_postgres::sqlx::PgPool::connect(&server.url())
        .await
        .expect("the application's pool");
    let own = PgBackend::from_pool(&pool)
        .await
        .expect("a backend from the pool")
        .into_locker();
    let by_url = locker(&server.url()).await;
    dlock_testkit::assert_locks_are_shared(&own, &by_url).await;
}

/// Every client session ended by the server (`pg_terminate_backend`)
/// while one client holds a 1-permit semaphore and another waits for it:
/// the waiter gets the permit once the holder's session is gone, and the
/// key is not wedged for a third client (see
/// `check_a_queued_wait_outlives_ended_sessions`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_wait_outlives_ended_sessions() {
    use sqlx::Connection;
    let server = PostgresServer::start().expect("start PostgreSQL");
    let url = format!("{}?session_timeout=3s", server.url());
    let (holder, waiter, third) = (locker(&url).await, locker(&url).await, locker(&url).await);
    let admin = server.url();
    let end_sessions = async move {
        let mut conn = sqlx::PgConnection::connect(&admin).await.expect("connect");
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'dlock' AND pid <> pg_backend_pid()",
        )
        .fetch_all(&mut conn)
        .await
        .expect("pg_terminate_backend");
        assert!(ended.len() >= 3, "only {} sessions to end", ended.len());
    };
    database_faults::check_a_queued_wait_outlives_ended_sessions(
        &holder,
        waiter,
        &third,
        dlock_core::backend::Mode::Permits { count: 1, limit: 1 },
        end_sessions,
    )
    .await;
}

/// A lock won by waiting frees its waiter slot at the grant: with
/// `max_waiters=1`, a client that holds such a lock can still wait for
/// another key (see `check_a_lock_won_by_waiting_frees_its_waiter_slot`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_won_by_waiting_frees_its_waiter_slot() {
    let server = PostgresServer::start().expect("start the server");
    let waits = locker(&format!("{}?max_waiters=1", server.url())).await;
    let other = locker(&server.url()).await;
    database_faults::check_a_lock_won_by_waiting_frees_its_waiter_slot(&waits, &other).await;
}

/// A connection whose traffic is dropped, not refused, under a held lock:
/// the guard reports lost within the session timeout and before another
/// client gets the key, and lock calls through it answer in bounded time
/// (see `check_a_black_holed_connection_is_bounded`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_connection_is_bounded() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let proxy = dlock_testkit::fixture::TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let session = Duration::from_secs(3);
    let options = "session_timeout=3s&connect_timeout=2s&holder_sessions=1";
    let holed = locker(&format!(
        "postgres://postgres:{POSTGRES_PASSWORD}@127.0.0.1:{}/postgres?{options}",
        proxy.port()
    ))
    .await;
    let other = locker(&format!("{}?{options}", server.url())).await;
    // A ping's wait, the statement's own deadline, and a connect attempt.
    let bound = 2 * session + Duration::from_secs(3);
    database_faults::check_a_black_holed_connection_is_bounded(
        &holed, &other, &proxy, session, bound,
    )
    .await;
}

/// Two applications whose tables live in different schemas (their
/// `search_path`) keep apart locks of the same key: advisory locks span
/// the database, so the schema is part of every lock's identifier. Each
/// holds the key, and each one's 1-permit semaphore admits one holder of
/// its own, and only one. A lock on the caller's own transaction, whose
/// connection searches another schema, is the backend's schema's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_keep_locks_of_one_key_apart() {
    use dlock_core::backend::Mode;
    use sqlx::{Connection, Executor};
    let server = PostgresServer::start().expect("start PostgreSQL");
    let mut admin = sqlx::PgConnection::connect(&server.url())
        .await
        .expect("connect");
    admin
        .execute("CREATE SCHEMA app_one; CREATE SCHEMA app_two")
        .await
        .expect("create the schemas");
    let in_schema = |schema: &str| {
        format!(
            "{}?options=-c%20search_path%3D{schema}&session_timeout=5s",
            server.url()
        )
    };
    let (one, two) = (
        locker(&in_schema("app_one")).await,
        locker(&in_schema("app_two")).await,
    );
    let one_more = locker(&in_schema("app_one")).await;
    let held = one
        .try_lock("shared-key")
        .await
        .unwrap()
        .expect("app one's lock");
    let theirs = two
        .try_lock("shared-key")
        .await
        .unwrap()
        .expect("app two's lock of the same key, in its own schema");
    assert!(
        one_more.try_lock("shared-key").await.unwrap().is_none(),
        "two holders of one key in one schema"
    );
    let permit = Mode::Permits { count: 1, limit: 1 };
    let options = dlock_core::LockOptions::new;
    let a = one.try_lock_mode("sem", permit, options()).await.unwrap();
    let b = two.try_lock_mode("sem", permit, options()).await.unwrap();
    assert!(
        a.is_some() && b.is_some(),
        "each schema's semaphore admits one"
    );
    assert!(
        one_more
            .try_lock_mode("sem", permit, options())
            .await
            .unwrap()
            .is_none(),
        "a 1-permit semaphore admitted two in one schema"
    );
    for guard in [held, theirs, a.unwrap(), b.unwrap()] {
        guard.release().await.expect("release");
    }

    // The caller's own transaction, on a pool that searches only
    // `public`, locks app one's key through app one's backend: app one's
    // identifier, and a fence from app one's sequence.
    let before = one.lock("shared-key").await.unwrap();
    let before_fence = before.fencing_token().expect("a fence");
    before.release().await.unwrap();
    let backend = PgBackend::connect(&in_schema("app_one")).await.unwrap();
    let pool = sqlx::PgPool::connect(&server.url()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let lock = backend
        .lock_in(&mut tx, "shared-key")
        .await
        .expect("a transaction lock through app one's backend");
    assert!(
        lock.fencing_token() > before_fence,
        "{} after {before_fence}",
        lock.fencing_token()
    );
    assert!(
        one_more.try_lock("shared-key").await.unwrap().is_none(),
        "app one's locker took a key app one's transaction holds"
    );
    let theirs = two.try_lock("shared-key").await.unwrap();
    assert!(
        theirs.is_some(),
        "app one's transaction lock held app two's key"
    );
    tx.rollback().await.unwrap();
    let after = one_more.try_lock("shared-key").await.unwrap();
    assert!(after.is_some(), "the rollback did not free app one's key");
}

/// A queue entry whose session ended stays in the table until the next
/// enqueue of its key reads it as dead; for a key nobody locks again, the
/// next connect deletes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_queue_entries_are_reaped_at_connect() {
    use dlock_core::backend::Mode;
    use sqlx::Connection;
    let server = PostgresServer::start().expect("start PostgreSQL");
    let url = format!("{}?session_timeout=3s", server.url());
    let held = locker(&url)
        .await
        .lock_mode(
            "reaped",
            Mode::Permits { count: 1, limit: 1 },
            LockOptions::new(),
        )
        .await
        .expect("a permit");
    let mut admin = sqlx::PgConnection::connect(&server.url())
        .await
        .expect("connect");
    async fn count(admin: &mut sqlx::PgConnection) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM dlock_queue")
            .fetch_one(admin)
            .await
            .expect("count the queue's entries")
    }
    assert_eq!(count(&mut admin).await, 1, "the permit's entry");
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = 'dlock'",
    )
    .execute(&mut admin)
    .await
    .expect("end the sessions");
    tokio::time::timeout(Duration::from_secs(5), held.lost())
        .await
        .expect("the permit's guard learned its session ended");
    assert_eq!(count(&mut admin).await, 1, "the dead entry stays");
    let _next = locker(&url).await;
    assert_eq!(count(&mut admin).await, 0, "the dead entry was not reaped");
}

/// Fixed leases that were released leave no task behind (see
/// `check_released_fixed_leases_leave_no_tasks`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_fixed_leases_leave_no_timer_tasks_behind() {
    let server = PostgresServer::start().expect("start the server");
    let locker = locker(&server.url()).await;
    dlock_testkit::session_faults::check_released_fixed_leases_leave_no_tasks(&locker).await;
}

/// Uncontended permits and read shares send no `pg_locks` scan (it takes
/// every lock partition of the server): an entry is counted live without
/// one, and only an entry that is refused reads the liveness of those
/// ahead. A contended one does, and still gets its permit once the holder
/// goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncontended_permits_and_reads_scan_no_pg_locks() {
    let server = PostgresServer::start().expect("start the server");
    let (locker, other) = (locker(&server.url()).await, locker(&server.url()).await);
    let semaphore = dlock_core::DistSemaphore::new(&locker, "scan:permits", 2);
    let rw = dlock_core::DistRwLock::new(&locker, "scan:rw", ());
    // The tables exist, and every session is open, before counting.
    semaphore.acquire().await.unwrap().release().await.unwrap();
    let count = server.count_statements().expect("log_statement");
    for _ in 0..10 {
        semaphore.acquire().await.unwrap().release().await.unwrap();
        let read = rw.read().await.unwrap();
        dlock_core::DistRwLockReadGuard::release(read)
            .await
            .unwrap();
    }
    assert!(
        count.so_far().unwrap() >= 20,
        "the statements were not logged"
    );
    assert_eq!(
        count.containing("pg_locks").unwrap(),
        0,
        "uncontended permits and reads scanned pg_locks"
    );
    // Contended: the waiter reads who is alive, and gets its turn.
    let holder = dlock_core::DistSemaphore::new(&other, "scan:one", 1);
    let held = holder.acquire().await.unwrap();
    let waiter = dlock_core::DistSemaphore::new(&locker, "scan:one", 1);
    let waiting = tokio::spawn(async move { waiter.acquire().await.map(drop) });
    tokio::time::sleep(Duration::from_millis(300)).await;
    held.release().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), waiting).await;
    assert!(matches!(got, Ok(Ok(Ok(())))), "the waiter: {got:?}");
    assert!(
        count.containing("pg_locks").unwrap() > 0,
        "the refused entry read no liveness"
    );
}

/// A lock on the caller's own transaction (`PgBackend::lock_in`) excludes
/// the backend's locks of the key, is freed by commit and by rollback,
/// and two transactions on one key serialize: the second is granted only
/// once the first commits, sees its write, and gets a higher fence. A
/// later statement of the transaction finds it still held: it is the
/// transaction's, not the statement's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_locks_are_freed_by_commit_and_rollback_and_serialize() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let pool = dlock_postgres::sqlx::PgPool::connect(&server.url())
        .await
        .expect("the application's pool");
    sqlx::raw_sql("CREATE TABLE counter (n int NOT NULL); INSERT INTO counter VALUES (0)")
        .execute(&pool)
        .await
        .unwrap();
    let backend = PgBackend::from_pool(&pool).await.unwrap();
    let locker = backend.clone().into_locker();
    let free = |locker: &Locker| {
        let locker = locker.clone();
        async move { locker.try_lock("order:1").await.unwrap().is_some() }
    };
    for end in ["commit", "rollback"] {
        let mut tx = pool.begin().await.unwrap();
        let lock = backend.lock_in(&mut tx, "order:1").await.unwrap();
        assert_eq!(lock.key(), "order:1");
        assert!(
            !free(&locker).await,
            "a locker took a key a transaction holds"
        );
        // A statement later, still held: the transaction's, not the
        // statement's.
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        assert!(!free(&locker).await, "freed before the transaction ended");
        if end == "commit" {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let after = locker
            .lock_with(
                "order:1",
                LockOptions::default().wait(Duration::from_secs(5)),
            )
            .await
            .unwrap_or_else(|e| panic!("{end} did not free the lock: {e}"));
        assert!(
            after.fencing_token() > Some(lock.fencing_token()),
            "{end}: fences went backwards"
        );
        after.release().await.unwrap();
    }
    // The reverse: a locker's hold refuses a transaction.
    let held = locker.lock("order:1").await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(backend
        .try_lock_in(&mut tx, "order:1")
        .await
        .unwrap()
        .is_none());
    held.release().await.unwrap();
    let lock = backend.try_lock_in(&mut tx, "order:1").await.unwrap();
    assert!(lock.is_some(), "a released key refused a transaction");
    tx.rollback().await.unwrap();

    // Two transactions read-modify-write one counter under the lock.
    let mut first = pool.begin().await.unwrap();
    let first_lock = backend.lock_in(&mut first, "order:1").await.unwrap();
    let second = tokio::spawn({
        let (pool, backend) = (pool.clone(), backend.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            let lock = backend.lock_in(&mut tx, "order:1").await.unwrap();
            let n: i32 = sqlx::query_scalar("SELECT n FROM counter")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            sqlx::query("UPDATE counter SET n = $1")
                .bind(n + 1)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            (n, lock.fencing_token())
        }
    });
    let n: i32 = sqlx::query_scalar("SELECT n FROM counter")
        .fetch_one(&mut *first)
        .await
        .unwrap();
    // Long enough for the second to read the old value, were it let in.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the second transaction ran beside the first"
    );
    sqlx::query("UPDATE counter SET n = $1")
        .bind(n + 1)
        .execute(&mut *first)
        .await
        .unwrap();
    first.commit().await.unwrap();
    let (seen, second_fence) = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the second transaction was never granted")
        .unwrap();
    assert_eq!(seen, n + 1, "the second did not see the first's write");
    assert!(second_fence > first_lock.fencing_token());
    let total: i32 = sqlx::query_scalar("SELECT n FROM counter")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(total, n + 2);
}

/// A lock on the caller's own connection (`PgBackend::lock_on`) excludes
/// the backend's locks, outlives a commit on the connection, and
/// `release` hands the connection back unlocked. A pooled connection
/// whose `lock_on` is dropped while it waits is closed, not returned to
/// its pool still waiting: the key is free once the holder lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_locks_release_and_a_dropped_wait_leaves_nothing_behind() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let pool = dlock_postgres::sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&server.url())
        .await
        .expect("the application's pool");
    let backend = PgBackend::from_pool(&pool).await.unwrap();
    let locker = backend.clone().into_locker();

    let mut lock = backend
        .lock_on(pool.acquire().await.unwrap(), "migrations")
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN; CREATE TABLE t (id int); COMMIT")
        .execute(&mut *lock)
        .await
        .unwrap();
    assert!(
        locker.try_lock("migrations").await.unwrap().is_none(),
        "a commit freed a session lock, or a locker ignored it"
    );
    let fence = lock.fencing_token();
    let conn = lock.release().await.unwrap();
    let after = locker.lock("migrations").await.unwrap();
    assert!(after.fencing_token() > Some(fence));
    // Refused while held, and the connection comes back.
    let conn = match backend.try_lock_on(conn, "migrations").await.unwrap() {
        Ok(lock) => panic!("granted beside a holder: {lock:?}"),
        Err(conn) => conn,
    };
    drop(conn);

    // A wait dropped while the holder holds.
    let waiting = backend.lock_on(pool.acquire().await.unwrap(), "migrations");
    let dropped = tokio::time::timeout(Duration::from_millis(300), waiting).await;
    assert!(dropped.is_err(), "granted beside a holder: {dropped:?}");
    after.release().await.unwrap();
    let free = locker
        .lock_with(
            "migrations",
            LockOptions::default().wait(Duration::from_secs(5)),
        )
        .await;
    assert!(
        free.is_ok(),
        "the dropped wait's session took the key and kept it: {free:?}"
    );
    // The pool still lends connections: the closed one was taken out.
    let mut again = tokio::time::timeout(Duration::from_secs(5), pool.acquire())
        .await
        .expect("the pool lends a connection")
        .unwrap();
    sqlx::query("SELECT 1").execute(&mut *again).await.unwrap();
}

/// `Locker::state` follows the sessions: a cut connection ends the
/// holder's session with its lock on it (`Lost`; a session is one
/// connection, so there is no `Suspended`), and the next session opened
/// is `Reconnected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_state_follows_the_sessions() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let proxy = dlock_testkit::fixture::TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let locker = locker(&format!(
        "postgres://postgres:{POSTGRES_PASSWORD}@127.0.0.1:{}/postgres?session_timeout=3s",
        proxy.port()
    ))
    .await;
    dlock_testkit::session_faults::check_connection_states(
        &locker,
        &proxy,
        None,
        Duration::from_secs(10),
    )
    .await;
}

/// `force_release` by a role that may not end the holder's session (not
/// the holder's role, not a member of `pg_signal_backend`) is
/// `PermissionDenied`, naming the right, and the lock stays held. Given
/// `pg_signal_backend`, the same call frees it, and the holder's guard is
/// told. That role may use the tables another role made, without owning
/// them or the right to create any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forcing_a_release_without_the_right_is_permission_denied() {
    use sqlx::{Connection, Executor};
    let server = PostgresServer::start().expect("start PostgreSQL");
    let mut admin = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    admin
        .execute(
            "CREATE ROLE worker LOGIN PASSWORD 'pw'; CREATE ROLE operator LOGIN PASSWORD 'pw'; \
             GRANT CREATE, USAGE ON SCHEMA public TO worker; \
             GRANT USAGE ON SCHEMA public TO operator; \
             ALTER DEFAULT PRIVILEGES FOR ROLE worker IN SCHEMA public \
             GRANT ALL ON TABLES TO operator; \
             ALTER DEFAULT PRIVILEGES FOR ROLE worker IN SCHEMA public \
             GRANT ALL ON SEQUENCES TO operator",
        )
        .await
        .expect("the roles");
    let as_role = |role: &str| {
        format!(
            "postgres://{role}:pw@{}/postgres?session_timeout=5s",
            server.host_port()
        )
    };
    let worker = locker(&as_role("worker")).await;
    let guard = worker.lock("stuck").await.unwrap();
    let operator = locker(&as_role("operator")).await;
    match operator.force_release("stuck").await {
        Err(e @ LockError::PermissionDenied { .. }) => {
            assert!(e.to_string().contains("pg_signal_backend"), "{e}")
        }
        other => panic!("a role without the right forced the release: {other:?}"),
    }
    assert!(!guard.is_lost(), "{:?}", guard.state());
    assert!(
        operator.try_lock("stuck").await.unwrap().is_none(),
        "the refused force freed the lock"
    );
    admin
        .execute("GRANT pg_signal_backend TO operator")
        .await
        .unwrap();
    assert!(operator.force_release("stuck").await.unwrap());
    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the holder's guard was not told");
}

/// A lock polled once and then parked (a `&mut` future in a `select!`
/// loop) holds up none of the client's other locks on its session: its
/// statement is in flight on the one connection they share, and the next
/// statement reads its answer (see `check_a_parked_lock_blocks_nothing`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_lock_holds_up_nothing_on_its_session() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let client = locker(&format!("{}?holder_sessions=1", server.url())).await;
    let other = locker(&server.url()).await;
    dlock_testkit::session_faults::check_a_parked_lock_blocks_nothing(&client, &other).await;
}
