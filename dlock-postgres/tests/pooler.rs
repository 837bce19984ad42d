//! PostgreSQL behind a pooler, PgBouncer (the Debian package), started by
//! the fixtures in front of a real server: transaction pooling moves a
//! client's statements between server sessions, so a session-level lock
//! would sit on a session the client no longer talks to; dlock refuses it
//! at connect. Session pooling keeps a client on one server session, and
//! the whole conformance suite passes through it.

use std::time::Duration;

use dlock_core::LockError;
use dlock_postgres::PgBackend;
use dlock_testkit::{
    fixture::{PgBouncer, PoolMode, PostgresServer, POSTGRES_PASSWORD},
    sql::harness,
    Harness,
};

/// Transaction pooling is refused at connect with
/// `LockError::UnsafeDeployment`, which says what to configure and shows
/// no password; five connects in a row, each refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_pooling_is_refused_at_connect() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let pooler = PgBouncer::start(&server, PoolMode::Transaction).expect("start PgBouncer");
    for attempt in 0..5 {
        match PgBackend::connect(&pooler.url()).await {
            Err(LockError::UnsafeDeployment { backend, reason }) => {
                assert_eq!(backend, "postgres");
                assert!(reason.contains("pool_mode = session"), "{reason}");
                assert!(!reason.contains(POSTGRES_PASSWORD), "{reason}");
            }
            other => panic!(
                "attempt {attempt}: transaction pooling was not refused: {:?}",
                other.map(|_| "a backend")
            ),
        }
    }
}

/// The whole conformance suite through PgBouncer in session pooling.
fn behind_session_pooling() -> Harness {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let pooler = PgBouncer::start(&server, PoolMode::Session).expect("start PgBouncer");
    let name = "postgres behind PgBouncer (session)";
    harness::<PostgresServer>(name, &pooler.url()).keep_alive((pooler, server))
}

dlock_testkit::conformance_tests!(suite whole_suite_behind_session_pooling, behind_session_pooling());

/// A proxy that moves the client onto a new server session in silence, as
/// one that reconnects does (the old session ends, and its locks with
/// it): the holder's guards report lost at their session's next
/// statement, within the session timeout, and another client then takes
/// the key. Without the check of the server session on every statement,
/// the holder would go on believing it holds the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_reconnect_under_a_held_lock_is_noticed() {
    use dlock_core::{backend::Mode, BackendExt, LockOptions};
    use dlock_testkit::fixture::SwitchingProxy;
    let server = PostgresServer::start_trusting().expect("start PostgreSQL");
    let target = server.host_port().parse().expect("an address");
    let proxy = SwitchingProxy::start(target)
        .await
        .expect("start the proxy");
    let session = Duration::from_secs(3);
    let options = format!(
        "session_timeout={}ms&holder_sessions=1",
        session.as_millis()
    );
    let through = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?{options}",
        proxy.port()
    );
    let holder = PgBackend::connect(&through)
        .await
        .expect("connect through the proxy")
        .into_locker();
    let other = PgBackend::connect(&format!("{}?{options}", server.url()))
        .await
        .expect("connect")
        .into_locker();
    let held = holder.lock("moved").await.expect("lock");
    let reading = holder
        .lock_mode("moved-rw", Mode::Read, LockOptions::new())
        .await
        .expect("read lock");
    proxy.switch();
    assert!(
        proxy.switched(1, Duration::from_secs(5)).await,
        "the proxy moved no connection"
    );
    for (what, guard) in [("lock", &held), ("read lock", &reading)] {
        tokio::time::timeout(session, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("the {what}'s guard never learned its session moved"));
    }
    let taken = other
        .lock_with("moved", LockOptions::new().wait(Duration::from_secs(5)))
        .await
        .expect("the key, free once the old server session ended");
    taken.release().await.expect("release");
}
