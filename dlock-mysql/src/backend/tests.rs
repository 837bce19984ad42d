//! Unit tests of the dialect's statements, on a real server.

use super::*;
use std::time::Duration;

use dlock_core::{backend::Mode, LockKey};
use dlock_sql::Dialect;
use dlock_testkit::fixture::MariaDbServer;

/// With the session's recorded connection id changed, as if a proxy
/// had moved the connection to another server session, the ping and
/// every statement that takes or gives back a lock answer
/// `SessionMoved`, and take nothing: no named lock, no queue entry, no
/// fencing token, no holder record.
#[tokio::test]
async fn statements_off_their_session_take_nothing() {
    let server = MariaDbServer::start().expect("start MariaDB");
    let (dialect, mut session) = dlock_sql::testing::set_up::<MySqlDialect>(&server.url()).await;
    let plain = dialect.lock_id(&LockKey::new("moved").unwrap(), Mode::Exclusive);
    session.id += 1;
    dlock_sql::testing::statements_off_their_session_answer_moved(&dialect, &mut session).await;
    let (used, entries, fences, records): (Option<i64>, i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT CAST(IS_USED_LOCK(?) AS SIGNED), (SELECT COUNT(*) FROM {}), \
         (SELECT CAST(SUM(v) AS SIGNED) FROM {}), (SELECT COUNT(*) FROM {})",
        dialect.queue, dialect.table, dialect.holders
    ))
    .bind(&plain)
    .fetch_one(&mut session.conn)
    .await
    .unwrap();
    assert_eq!((used, entries, fences, records), (None, 0, 0, 0));
}

/// Whether the server of `conn` has connection `id`, asked until it
/// has not, for at most 5 s.
async fn session_gone(conn: &mut MySqlSession, id: u64) -> bool {
    for _ in 0..50 {
        let n: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
                .bind(id)
                .fetch_one(&mut conn.conn)
                .await
                .expect("the process list");
        if n == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// See [`dlock_sql::testing::ending_a_session_by_id_ends_nothing_on_another_server`].
#[tokio::test]
async fn ending_a_session_by_id_ends_nothing_on_another_server() {
    let (a, b) = (
        MariaDbServer::start().expect("start MariaDB A"),
        MariaDbServer::start().expect("start MariaDB B"),
    );
    dlock_sql::testing::ending_a_session_by_id_ends_nothing_on_another_server::<MySqlDialect>(
        &a.url(),
        &b.url(),
    )
    .await;
}

/// `force_release` (`end_holder`) reads a key's holder and ends its
/// connection in one request, on one server session: no round trip
/// between the read and the `KILL` in which the holder could let go and
/// be ended all the same, and no second request that a proxy could send
/// to another server, where the id names someone else. The holder's
/// connection ends; a key nobody holds, or only this connection, ends
/// nothing.
#[tokio::test]
async fn ending_a_keys_holder_is_one_request() {
    let server = MariaDbServer::start().expect("start MariaDB");
    let (dialect, mut operator) =
        dlock_sql::testing::set_up::<MySqlDialect>(&server.admin_url()).await;
    let (mut holder, held) = dialect.open().await.expect("the holder's session");
    let id = dialect.lock_id(&LockKey::new("stuck 'key'").unwrap(), Mode::Exclusive);
    let taken = dialect.try_lock(&mut holder, &id, Mode::Exclusive).await;
    assert!(taken.unwrap().is_some(), "the holder takes the free key");

    let count = server.count_statements().expect("count requests");
    let ended = dialect.end_holder(&mut operator, &id).await.unwrap();
    let requests = count.so_far().expect("the request count");
    drop(count);
    assert!(ended, "the holder was not ended");
    assert_eq!(
        requests, 1,
        "the holder was read and ended in {requests} requests"
    );
    assert!(
        session_gone(&mut operator, held.id).await,
        "the holder lives on"
    );

    for (what, by) in [("nobody", None), ("the operator", Some(()))] {
        if by.is_some() {
            let own = dialect.try_lock(&mut operator, &id, Mode::Exclusive).await;
            assert!(own.unwrap().is_some(), "the operator takes the key");
        }
        let ended = dialect.end_holder(&mut operator, &id).await.unwrap();
        assert!(!ended, "a key held by {what} ended a session");
        dialect
            .ping(&mut operator)
            .await
            .expect("the operator lives");
    }
}
