//! MySQL's properties, against a real MariaDB server: the checks every
//! database backend runs (see `dlock_testkit::sql`: an attempt dropped
//! while the server works on it leaves no lock behind, one session holds
//! 10,000 locks, bad input or a bad server is a typed error, in bounded
//! time), and MySQL's own: names keep keys apart that the server's
//! case-blind compare or its 64-character limit would merge, the two
//! fencing sources never mix, queue numbers and fences survive an
//! emptied table, and the stored function is used only where it is safe.

use std::time::Duration;

use dlock_core::{BackendExt, LockError, LockOptions, Locker};
use dlock_mysql::MySqlBackend;
use dlock_testkit::{
    fixture::{MariaDbServer, MARIADB_PASSWORD},
    sql::check_forcing_a_release_needs_the_right,
};

dlock_testkit::sql_tests!(MariaDbServer);

async fn locker(url: &str) -> Locker {
    MySqlBackend::connect(url)
        .await
        .expect("connect to MariaDB")
        .into_locker()
}

/// A connection of the server's admin, who may do anything.
async fn admin(server: &MariaDbServer) -> sqlx::MySqlConnection {
    use sqlx::Connection;
    sqlx::MySqlConnection::connect(&server.admin_url())
        .await
        .expect("an admin's connection")
}

/// Long keys that share their first 64 characters are distinct locks (a
/// name keeps a hash of the whole key), as are keys that differ only in
/// case or beyond ASCII: two clients hold each pair at once. (MariaDB 10.11
/// compares names with case, MySQL without: the unit test of the names
/// checks that they differ without case too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_keys_and_case_are_distinct_locks() {
    let server = MariaDbServer::start().expect("start MariaDB");
    let (a, b) = (locker(&server.url()).await, locker(&server.url()).await);
    let long = "k".repeat(100);
    for (one, other) in [
        ("Order:1".to_owned(), "order:1".to_owned()),
        (format!("{long}1"), format!("{long}2")),
        ("caf\u{e9}".to_owned(), "CAF\u{c9}".to_owned()),
    ] {
        let first = a.try_lock(&one).await.unwrap().expect("first key");
        let second = b.try_lock(&other).await.unwrap();
        assert!(second.is_some(), "`{one}` and `{other}` share a lock");
        assert!(
            b.try_lock(&one).await.unwrap().is_none(),
            "`{one}` is held twice"
        );
        first.release().await.unwrap();
        second.unwrap().release().await.unwrap();
    }
}

/// A key whose counter row is gone (someone emptied the table) gets a
/// typed error naming the table, never a stale token, and the grant its
/// request took is undone: the key is free for another client at once,
/// after a failed attempt and after a failed wait alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_counter_row_is_a_typed_error_and_leaves_no_lock() {
    let server = MariaDbServer::start().expect("start MariaDB");
    let fenced = locker(&server.url()).await;
    let unfenced = locker(&format!("{}?fence=off", server.url())).await;
    let mut admin = admin(&server).await;
    sqlx::query("DELETE FROM dlock_fence")
        .execute(&mut admin)
        .await
        .unwrap();
    let named = |e: LockError| {
        let text = format!("{e:?}");
        assert!(
            matches!(e, LockError::Backend { .. }) && text.contains("dlock_fence"),
            "{text}"
        );
    };
    named(fenced.try_lock("gone").await.map(drop).unwrap_err());
    let free = unfenced
        .lock_with("gone", LockOptions::new().wait(Duration::from_secs(2)))
        .await
        .expect("the failed attempt kept its lock");
    assert_eq!(free.fencing_token(), None, "fence=off gave a token");
    // A wait granted on the server, then refused its token.
    let waiting = tokio::spawn(async move {
        fenced
            .lock_with("gone", LockOptions::new().wait(Duration::from_secs(10)))
            .await
            .map(drop)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    free.release().await.unwrap();
    named(waiting.await.unwrap().unwrap_err());
    let again = unfenced
        .lock_with("gone", LockOptions::new().wait(Duration::from_secs(2)))
        .await
        .expect("the failed wait's session kept the lock");
    again.release().await.unwrap();
}

/// Queue entries (read-write locks, semaphores) are numbered, and fenced,
/// by a committed counter row, not by the table's `AUTO_INCREMENT`: after
/// an operator empties the queue table (`TRUNCATE`, which resets
/// `AUTO_INCREMENT`, as a restart does on MySQL 5.7 and MariaDB before
/// 10.2.4) and the server restarts, every mode's next fence is still above
/// every fence given before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_fences_survive_an_emptied_table_and_a_restart() {
    use dlock_core::backend::Mode;
    let mut server = MariaDbServer::start().expect("start MariaDB");
    let url = format!("{}?session_timeout=3s", server.url());
    let modes = [
        Mode::Write,
        Mode::Read,
        Mode::Permits { count: 1, limit: 2 },
    ];
    let mut last = 0;
    let a = locker(&url).await;
    for round in 0..3 {
        for mode in modes {
            let guard = a
                .lock_mode(&format!("queued-fence-{round}"), mode, LockOptions::new())
                .await
                .expect("a queued lock");
            let fence = guard.fencing_token().expect("a fence");
            assert!(fence > last, "{mode:?}: fence {fence} after {last}");
            last = fence;
            guard.release().await.expect("release");
        }
    }
    {
        use sqlx::{Connection, Executor};
        let mut conn = sqlx::MySqlConnection::connect(&server.url())
            .await
            .expect("connect");
        conn.execute("TRUNCATE TABLE dlock_queue")
            .await
            .expect("empty the queue table");
    }
    tokio::task::block_in_place(|| server.restart()).expect("restart MariaDB");
    let b = locker(&url).await;
    for mode in modes {
        let guard = b
            .lock_mode("queued-fence-after", mode, LockOptions::new())
            .await
            .expect("a queued lock after the restart");
        let fence = guard.fencing_token().expect("a fence");
        assert!(
            fence > last,
            "{mode:?}: fence {fence} after {last}, across the restart"
        );
        last = fence;
        guard.release().await.expect("release");
    }
}

/// An enqueue held up by the key's enqueue lock (held here from another
/// session for 4 s, longer than a third of the session timeout, and than
/// the session timeout itself) is a wait, not a failure: the write lock is
/// granted once the enqueue lock goes, and the other lock on the same
/// holder session is not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_up_enqueue_waits_and_costs_the_session_nothing() {
    use dlock_core::backend::Mode;
    use sqlx::Connection;
    let server = MariaDbServer::start().expect("start MariaDB");
    let client = locker(&format!(
        "{}?session_timeout=3s&holder_sessions=1",
        server.url()
    ))
    .await;
    let mut admin = sqlx::MySqlConnection::connect(&server.url())
        .await
        .expect("connect");
    let first = client
        .lock_mode("held-up", Mode::Write, LockOptions::new())
        .await
        .expect("a write lock");
    let name: String = sqlx::query_scalar("SELECT lock_id FROM dlock_queue")
        .fetch_one(&mut admin)
        .await
        .expect("the key's queue name");
    first.release().await.expect("release");
    let bystander = client.lock("held-up-bystander").await.expect("a lock");
    let taken: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
        .bind(&name)
        .fetch_one(&mut admin)
        .await
        .expect("GET_LOCK");
    assert_eq!(taken, Some(1), "the key's enqueue lock");
    let waiting = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .lock_mode(
                    "held-up",
                    Mode::Write,
                    LockOptions::new().wait(Duration::from_secs(20)),
                )
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!waiting.is_finished(), "granted past the held enqueue lock");
    let _: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
        .bind(&name)
        .fetch_one(&mut admin)
        .await
        .expect("RELEASE_LOCK");
    let granted = waiting
        .await
        .expect("the waiter's task")
        .expect("the write lock, once the enqueue lock went");
    assert!(
        !bystander.is_lost(),
        "the held-up enqueue cost the session its other lock"
    );
    granted.release().await.expect("release");
    bystander.release().await.expect("release the bystander");
}

/// An enqueue whose request fails half-way (here its insert meets a
/// duplicate number: an operator set the queue's counter row back) gives
/// back the key's enqueue lock: the next client's enqueue of the key is
/// not answered busy until its limit, and gets the lock once its holder
/// goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_enqueue_leaves_the_key_to_the_next() {
    use dlock_core::backend::Mode;
    use sqlx::{Connection, Executor};
    let server = MariaDbServer::start().expect("start MariaDB");
    let url = format!("{}?session_timeout=3s", server.url());
    let (a, b, c) = (locker(&url).await, locker(&url).await, locker(&url).await);
    let held = a
        .lock_mode("failed-enqueue", Mode::Write, LockOptions::new())
        .await
        .expect("a write lock");
    let mut admin = sqlx::MySqlConnection::connect(&server.url())
        .await
        .expect("connect");
    admin
        .execute("UPDATE dlock_fence SET v = v - 1 WHERE shard = 64")
        .await
        .expect("set the queue's counter back");
    let failed = b
        .lock_mode(
            "failed-enqueue",
            Mode::Write,
            LockOptions::new().wait(Duration::from_secs(1)),
        )
        .await;
    assert!(
        failed.is_err(),
        "an enqueue on a duplicate number: {failed:?}"
    );
    let waiting = tokio::spawn({
        let c = c.clone();
        async move {
            c.lock_mode(
                "failed-enqueue",
                Mode::Write,
                LockOptions::new().wait(Duration::from_secs(5)),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    held.release().await.expect("release");
    let next = waiting
        .await
        .expect("the waiter's task")
        .expect("the key, once its holder went");
    next.release().await.expect("release");
}

/// dlock's sessions commit each statement (`autocommit = 1` is set on
/// them) even on a server whose default is `autocommit = 0`: a grant's
/// fencing token is a committed write at once, seen by another session,
/// and the counter row is not left locked by an open transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_are_committed_whatever_the_servers_autocommit() {
    use sqlx::Executor;
    let server = MariaDbServer::start().expect("start MariaDB");
    let mut admin = admin(&server).await;
    admin
        .execute("SET GLOBAL autocommit = 0")
        .await
        .expect("turn autocommit off for new sessions");
    let client = locker(&format!("{}?session_timeout=5s", server.url())).await;
    let guard = client.lock("committed").await.expect("lock");
    let fence = guard.fencing_token().expect("a fence") as i64;
    let mut reader = self::admin(&server).await;
    reader
        .execute("SET SESSION autocommit = 1, innodb_lock_wait_timeout = 2")
        .await
        .expect("set the reader up");
    let committed: i64 = sqlx::query_scalar("SELECT CAST(MAX(v) AS SIGNED) FROM dlock.dlock_fence")
        .fetch_one(&mut reader)
        .await
        .expect("read the counters");
    assert!(
        committed >= fence,
        "the grant's token {fence} is not committed: {committed}"
    );
    guard.release().await.expect("release");
    admin
        .execute("SET GLOBAL autocommit = 1")
        .await
        .expect("autocommit back on");
}

/// `force_release` by a user that may not end the holder's connection
/// (another user's, without `CONNECTION ADMIN`) is `PermissionDenied`,
/// naming the right, and the lock stays held. A user with every right
/// frees it, and the holder's guard is told (see
/// `check_forcing_a_release_needs_the_right`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forcing_a_release_without_the_right_is_permission_denied() {
    let server = MariaDbServer::start().expect("start MariaDB");
    let admin = locker(&server.admin_url()).await;
    let plain = locker(&server.url()).await;
    let admin_url = server.admin_url();
    let operator = locker(&admin_url);
    check_forcing_a_release_needs_the_right(&admin, &plain, "CONNECTION ADMIN", operator).await;
}

/// Whether the stored function `dlock_take_v1` is in the database.
async fn take_function_exists(admin: &mut sqlx::MySqlConnection, database: &str) -> bool {
    sqlx::query_scalar::<_, i64>(
        "SELECT COUNT(*) FROM information_schema.ROUTINES \
         WHERE ROUTINE_SCHEMA = ? AND ROUTINE_NAME = 'dlock_take_v1'",
    )
    .bind(database)
    .fetch_one(admin)
    .await
    .expect("read the routines")
        == 1
}

/// Whether `locker`'s attempts call the stored function: one `try_lock`
/// and its release, read in the server's general log.
async fn calls_the_function(server: &MariaDbServer, locker: &Locker) -> bool {
    let count = server.count_statements().expect("the general log");
    let guard = locker
        .try_lock("which-path")
        .await
        .expect("try_lock")
        .expect("a free key");
    guard.release().await.expect("release");
    count.containing("_take_v1").expect("the general log") > 0
}

/// `taker` takes the free key `shared` with a fence above `last`, and
/// `other` is refused it meanwhile; answers the fence.
async fn take_shared(who: &str, taker: &Locker, other: &Locker, last: u64) -> u64 {
    let guard = taker
        .try_lock("shared")
        .await
        .unwrap_or_else(|e| panic!("{who}: {e}"))
        .unwrap_or_else(|| panic!("{who}: the free key was refused"));
    let fence = guard.fencing_token().expect("a fence");
    assert!(fence > last, "{who}: fence {fence} after {last}");
    assert!(
        other.try_lock("shared").await.unwrap().is_none(),
        "{who}'s lock was granted to another client beside it"
    );
    guard.release().await.unwrap();
    fence
}

/// Tokens from the stored function `dlock_take_v1` and from the text request
/// come from the same counter rows. A login that may neither make nor run
/// the function connects and locks, with tokens above those of a login
/// that uses it, and each excludes the other; a function dropped while a
/// client runs is given up at its next attempt, with nothing held twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_with_and_without_the_stored_function_share_keys_and_fences() {
    check_both_paths_share_keys_and_fences("dlock", None).await;
}

/// The same in a database whose character set is UTF-16: the function's
/// name parameter is ASCII, so it locks the same bytes as the text
/// request; in the database's own character set the two paths would hold
/// one key twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_utf16_database_both_paths_lock_the_same_key() {
    check_both_paths_share_keys_and_fences("wide", Some("utf16")).await;
}

/// A login with the tables' rights only (the text request) and one that
/// may make the stored function, on `database` (made with `charset` if
/// given), take one key in turn: rising fences, and each refused while the
/// other holds it; then the function is dropped, and the locks go on.
async fn check_both_paths_share_keys_and_fences(database: &str, charset: Option<&str>) {
    use sqlx::Executor;
    let server = MariaDbServer::start().expect("start MariaDB");
    let mut admin = admin(&server).await;
    if let Some(charset) = charset {
        admin
            .execute(
                format!(
                    "CREATE DATABASE {database} CHARACTER SET {charset}; \
                     GRANT ALL ON {database}.* TO 'dlock'@'127.0.0.1'"
                )
                .as_str(),
            )
            .await
            .expect("a database in another character set");
    }
    admin
        .execute(
            format!(
                "CREATE USER 'plain'@'127.0.0.1' IDENTIFIED BY '{MARIADB_PASSWORD}'; \
                 GRANT SELECT, INSERT, UPDATE, DELETE, CREATE ON {database}.* \
                 TO 'plain'@'127.0.0.1'"
            )
            .as_str(),
        )
        .await
        .expect("a login with the tables' rights only");
    let plain = locker(&format!(
        "mysql://plain:{MARIADB_PASSWORD}@{}/{database}",
        server.host_port()
    ))
    .await;
    assert!(
        !take_function_exists(&mut admin, database).await,
        "made without the right"
    );
    let full = locker(&format!(
        "mysql://dlock:{MARIADB_PASSWORD}@{}/{database}",
        server.host_port()
    ))
    .await;
    assert!(
        take_function_exists(&mut admin, database).await,
        "not made with the right"
    );
    assert!(calls_the_function(&server, &full).await, "made, not used");
    assert!(
        !calls_the_function(&server, &plain).await,
        "used without the right"
    );
    let mut last = 0;
    for _ in 0..3 {
        last = take_shared("plain", &plain, &full, last).await;
        last = take_shared("full", &full, &plain, last).await;
    }
    admin
        .execute(format!("DROP FUNCTION {database}.dlock_take_v1").as_str())
        .await
        .expect("drop the function");
    for _ in 0..2 {
        last = take_shared("full, its function dropped", &full, &plain, last).await;
    }
}

/// A stored function of dlock's name that is not dlock's (another
/// version's, or someone else's) fails the probe at connect: the client
/// sends the text request instead, with rising fences, and excludes a
/// client that does the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_function_of_dlocks_name_that_is_not_dlocks_is_left_alone() {
    use sqlx::Executor;
    let server = MariaDbServer::start().expect("start MariaDB");
    let mut admin = admin(&server).await;
    admin
        .execute(
            "CREATE FUNCTION dlock.dlock_take_v1(s BIGINT, n VARCHAR(64), t DOUBLE, \
             sh SMALLINT) RETURNS BIGINT NO SQL RETURN 7",
        )
        .await
        .expect("an impostor");
    let one = locker(&server.url()).await;
    let two = locker(&server.url()).await;
    assert!(
        !calls_the_function(&server, &one).await,
        "the impostor is called"
    );
    let body: String = sqlx::query_scalar(
        "SELECT ROUTINE_DEFINITION FROM information_schema.ROUTINES \
         WHERE ROUTINE_SCHEMA = 'dlock' AND ROUTINE_NAME = 'dlock_take_v1'",
    )
    .fetch_one(&mut admin)
    .await
    .expect("the impostor's body");
    assert_eq!(body, "RETURN 7", "the impostor was replaced");
    let mut last = 0;
    for _ in 0..3 {
        last = take_shared("one", &one, &two, last).await;
        last = take_shared("two", &two, &one, last).await;
    }
}

/// With a binary log in `STATEMENT` format a replica would replay the
/// stored function's call, `GET_LOCK` included: the client leaves the
/// function out (the text request logs its `UPDATE` alone), and locks as
/// well. In `ROW` format it makes the function and uses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_binary_log_leaves_the_stored_function_out() {
    let server = MariaDbServer::start_with_binary_log("STATEMENT").expect("start MariaDB");
    let mut admin = admin(&server).await;
    let one = locker(&server.url()).await;
    assert!(
        !take_function_exists(&mut admin, "dlock").await,
        "made with a statement-based binary log"
    );
    server
        .admin("SET GLOBAL binlog_format = 'ROW'")
        .expect("binary log in ROW format");
    let two = locker(&server.url()).await;
    assert!(
        take_function_exists(&mut admin, "dlock").await,
        "not made with a row-based binary log"
    );
    // A client that finds the function made, under a statement log.
    server
        .admin("SET GLOBAL binlog_format = 'STATEMENT'")
        .expect("binary log in STATEMENT format");
    let three = locker(&server.url()).await;
    assert!(
        !calls_the_function(&server, &one).await,
        "called under STATEMENT"
    );
    assert!(
        calls_the_function(&server, &two).await,
        "not called under ROW"
    );
    assert!(
        !calls_the_function(&server, &three).await,
        "called under STATEMENT, made"
    );
    let mut last = 0;
    for _ in 0..3 {
        last = take_shared("statement", &one, &two, last).await;
        last = take_shared("row", &two, &three, last).await;
        last = take_shared("statement, made", &three, &one, last).await;
    }
}
