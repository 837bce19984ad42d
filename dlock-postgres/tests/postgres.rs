//! PostgreSQL's properties, against a real server: the checks every
//! database backend runs (see `dlock_testkit::sql`: an attempt dropped
//! while the server works on it leaves no lock behind, one session holds
//! 10,000 locks, bad input or a bad server is a typed error, in bounded
//! time), and PostgreSQL's own: schemas, `pg_locks` scans, locks on the
//! caller's transaction and connection, and the right to force a release.

use std::time::Duration;

use dlock_core::{BackendExt, LockOptions, Locker};
use dlock_postgres::PgBackend;
use dlock_testkit::{fixture::PostgresServer, sql::check_forcing_a_release_needs_the_right};

dlock_testkit::sql_tests!(PostgresServer);

async fn locker(url: &str) -> Locker {
    PgBackend::connect(url)
        .await
        .expect("connect to PostgreSQL")
        .into_locker()
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

/// `force_release` by a role that may not end the holder's session (not
/// the holder's role, not a member of `pg_signal_backend`) is
/// `PermissionDenied`, naming the right, and the lock stays held. Given
/// `pg_signal_backend`, the same call frees it, and the holder's guard is
/// told (see `check_forcing_a_release_needs_the_right`). That role may
/// use the tables another role made, without owning them or the right to
/// create any.
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
    let operator = locker(&as_role("operator")).await;
    let given_the_right = async {
        admin
            .execute("GRANT pg_signal_backend TO operator")
            .await
            .unwrap();
        operator.clone()
    };
    check_forcing_a_release_needs_the_right(
        &worker,
        &operator,
        "pg_signal_backend",
        given_the_right,
    )
    .await;
}
