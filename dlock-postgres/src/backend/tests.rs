//! Unit tests of the dialect's statements, on a real server.

use super::*;
use std::time::Duration;

use dlock_core::{backend::Mode, LockKey};
use dlock_sql::{testing::set_up, Dialect};
use dlock_testkit::fixture::PostgresServer;

/// With the session's recorded process id changed, as if a pooler had
/// moved the connection to another server session, the ping and every
/// statement that takes or gives back a lock answer `SessionMoved`,
/// and take nothing: no advisory lock, no queue entry, no fencing
/// token, no holder record.
#[tokio::test]
async fn statements_off_their_session_take_nothing() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let (dialect, mut session) = set_up::<PgDialect>(&server.url()).await;
    session.id += 1;
    dlock_sql::testing::statements_off_their_session_answer_moved(&dialect, &mut session).await;
    let (locks, entries, fenced, records): (i64, i64, bool, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'), \
         (SELECT count(*) FROM dlock_queue), \
         (SELECT is_called FROM dlock_fence), (SELECT count(*) FROM dlock_holder)",
    )
    .fetch_one(&mut session.conn)
    .await
    .unwrap();
    assert_eq!((locks, entries, fenced, records), (0, 0, false, 0));
}

async fn lock_timeout(conn: &mut sqlx::PgConnection) -> String {
    sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(conn)
        .await
        .expect("SHOW lock_timeout")
}

/// A wait's limit is the server's `lock_timeout` while it waits, and
/// nothing after: a wait that ran out leaves the session's setting as
/// it was, and a granted one lifts it before its token, so that no
/// later statement on the session times out.
#[tokio::test]
async fn a_wait_limits_only_itself() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let (dialect, mut holder) = set_up::<PgDialect>(&server.url()).await;
    let (mut waiter, _) = dialect.open().await.expect("open a session");
    let id = dialect.lock_id(&LockKey::new("limited").unwrap(), Mode::Exclusive);
    let held = dialect.try_lock(&mut holder, &id, Mode::Exclusive).await;
    assert!(held.unwrap().is_some(), "the holder takes the free key");
    let limit = Some(Duration::from_millis(100));
    let waited = tokio::time::timeout(
        Duration::from_secs(10),
        dialect.wait(&mut waiter, &id, Mode::Exclusive, limit),
    )
    .await
    .expect("the server ends the wait at its limit");
    assert_eq!(waited.unwrap(), None, "not granted while held");
    assert_eq!(lock_timeout(&mut waiter.conn).await, "0");
    dialect
        .unlock(&mut holder, &id, Mode::Exclusive)
        .await
        .unwrap();
    let limit = Some(Duration::from_secs(5));
    let granted = dialect.wait(&mut waiter, &id, Mode::Exclusive, limit).await;
    assert!(granted.unwrap().is_some_and(|g| g.fence > 0));
    assert_eq!(lock_timeout(&mut waiter.conn).await, "0");
}

/// See [`dlock_sql::testing::ending_a_session_by_id_ends_nothing_on_another_server`].
#[tokio::test]
async fn ending_a_session_by_id_ends_nothing_on_another_server() {
    let (a, b) = (
        PostgresServer::start().expect("start PostgreSQL A"),
        PostgresServer::start().expect("start PostgreSQL B"),
    );
    dlock_sql::testing::ending_a_session_by_id_ends_nothing_on_another_server::<PgDialect>(
        &a.url(),
        &b.url(),
    )
    .await;
}
