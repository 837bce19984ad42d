//! Listing on PostgreSQL: the server keeps only a hash of each key, so
//! every held lock is listed by its advisory lock id, with its mode and
//! waiters, and a key prefix is refused. Reads of who holds what run on
//! sessions that hold no lock.

use std::time::Duration;

use dlock_core::{
    backend::{HeldLock, ListedKey, Mode},
    BackendExt, DistRwLock, LockError, LockOptions, Locker,
};
use dlock_postgres::PgBackend;
use dlock_testkit::fixture::PostgresServer;

async fn locker(url: &str) -> Locker {
    PgBackend::connect(url)
        .await
        .expect("connect")
        .into_locker()
}

async fn all(locker: &Locker, page: usize) -> Vec<HeldLock> {
    let mut listing = locker.list("").page_size(page);
    let mut locks = Vec::new();
    for _ in 0..100 {
        match listing.next_page().await.expect("list") {
            Some(page) => locks.extend(page),
            None => return locks,
        }
    }
    panic!("the listing never ended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_locks_are_listed_by_their_ids() {
    let server = PostgresServer::start().expect("start postgres");
    let url = server.url();
    let (a, b, lister) = (locker(&url).await, locker(&url).await, locker(&url).await);
    let mut guards = Vec::new();
    for i in 0..5 {
        guards.push(a.lock(format!("plain/{i}")).await.expect("lock"));
    }
    let waiting = tokio::spawn({
        let b = b.clone();
        async move {
            b.lock_with("plain/0", LockOptions::new().wait(Duration::from_secs(30)))
                .await
                .map(drop)
        }
    });
    // Readers of two clients: each its own shared lock on the server.
    let other = locker(&url).await;
    let (rw, rw2) = (
        DistRwLock::new(&a, "shared", ()),
        DistRwLock::new(&other, "shared", ()),
    );
    let (_r1, _r2) = (
        rw.read().await.expect("read"),
        rw2.read().await.expect("read"),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let locks = loop {
        let locks = all(&lister, 2).await;
        if locks.iter().any(|l| l.waiters() == Some(1)) {
            break locks;
        }
        assert!(tokio::time::Instant::now() < deadline, "{locks:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        locks.len(),
        6,
        "5 plain locks and a read-write lock: {locks:#?}"
    );
    assert!(locks
        .iter()
        .all(|l| matches!(l.key(), ListedKey::Hashed(_))));
    let modes = |mode| {
        locks
            .iter()
            .filter(|l| l.holders().iter().all(|h| h.mode() == Some(mode)))
            .count()
    };
    assert_eq!(modes(Mode::Exclusive), 5);
    let shared: Vec<_> = locks.iter().filter(|l| l.holders().len() == 2).collect();
    assert_eq!(shared.len(), 1, "{locks:#?}");
    assert!(shared[0]
        .holders()
        .iter()
        .all(|h| h.mode() == Some(Mode::Read)));
    match lister.list("plain/").next_page().await {
        Err(LockError::Unsupported { .. }) => {}
        other => panic!("a prefix: expected Unsupported, got {other:?}"),
    }
    waiting.abort();
}

/// A server, a locker on it with one holder session and a 1 s session
/// timeout, a lock it holds, and an admin's open transaction that holds
/// `table` exclusively (reads of it wait until the admin commits).
async fn held_behind_a_locked_table(
    table: &str,
) -> (
    PostgresServer,
    Locker,
    dlock_core::LockGuard,
    dlock_postgres::sqlx::PgConnection,
) {
    use dlock_postgres::sqlx::{Connection, Executor, PgConnection};

    let server = PostgresServer::start().expect("start postgres");
    let locker = locker(&format!(
        "{}?session_timeout=1s&holder_sessions=1",
        server.url()
    ))
    .await;
    let held = locker.lock("held").await.expect("lock");
    let mut admin = PgConnection::connect(&server.url())
        .await
        .expect("admin connection");
    admin.execute("BEGIN").await.expect("begin");
    admin
        .execute(format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE").as_str())
        .await
        .expect("lock the table");
    (server, locker, held, admin)
}

/// A page the server is slow to answer (held up here behind a lock on
/// the queue table, which the listing reads) runs on a session that holds
/// no lock: past the session timeout, the held guard is not lost, and an
/// acquire on the one holder session is answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_page_neither_loses_nor_delays_held_locks() {
    use dlock_postgres::sqlx::Executor;

    let timeout = Duration::from_secs(1);
    let (_server, locker, held, mut admin) = held_behind_a_locked_table("dlock_queue").await;
    let page = tokio::spawn({
        let locker = locker.clone();
        async move { locker.list("").next_page().await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let other = tokio::time::timeout(timeout / 2, locker.try_lock("other"))
        .await
        .expect("an acquire waited behind the page")
        .expect("try_lock")
        .expect("free");
    tokio::time::sleep(timeout * 2).await;
    assert!(!held.is_lost(), "a slow page lost a held lock");
    assert!(!other.is_lost(), "a slow page lost a held lock");
    admin.execute("COMMIT").await.expect("commit");
    // The slow page failed alone (no answer within the session timeout),
    // or was answered once the table was free.
    let _ = tokio::time::timeout(Duration::from_secs(10), page)
        .await
        .expect("the page ended");
    let locks = all(&locker, 1000).await;
    assert_eq!(locks.len(), 2, "{locks:#?}");
    held.release().await.expect("release");
    other.release().await.expect("release");
}

/// A holder read the server is slow to answer (held up here behind a
/// lock on the holders' table) runs on a session that holds no lock: past
/// the session timeout, the held guard is not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_holder_read_loses_no_held_lock() {
    use dlock_postgres::sqlx::Executor;

    let timeout = Duration::from_secs(1);
    let (_server, locker, held, mut admin) = held_behind_a_locked_table("dlock_holder").await;
    let read = tokio::spawn({
        let locker = locker.clone();
        async move { locker.holder("held").await.map(drop) }
    });
    tokio::time::sleep(timeout * 2 + Duration::from_millis(200)).await;
    assert!(!held.is_lost(), "a slow holder read lost a held lock");
    admin.execute("COMMIT").await.expect("commit");
    let _ = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the read ended");
    let holder = locker.holder("held").await.expect("holder");
    assert!(holder.is_some(), "the held lock shows no holder");
    held.release().await.expect("release");
}
