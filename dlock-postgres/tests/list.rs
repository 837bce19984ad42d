//! Listing on PostgreSQL: the server keeps only a hash of each key, so
//! every held lock is listed by its advisory lock id, with its mode and
//! waiters, and a key prefix is refused.

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
