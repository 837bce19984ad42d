//! The etcd listing where the conformance suite does not look: a queue
//! longer than a page's read, shared holders and their waiters, and the
//! etcdctl layout's refusal.

use std::time::Duration;

use dlock_core::{BackendExt, LockError, LockOptions, Locker};
use dlock_etcd::EtcdBackend;
use dlock_testkit::fixture::EtcdServer;

async fn locker(url: &str) -> Locker {
    EtcdBackend::connect(url)
        .await
        .expect("connect")
        .into_locker()
}

/// Every lock under `prefix`, page by page.
async fn all(locker: &Locker, prefix: &str, page: usize) -> Vec<dlock_core::backend::HeldLock> {
    let mut listing = locker.list(prefix).page_size(page);
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
async fn long_queues_and_shared_holders_are_listed_whole() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/list-test", server.endpoint());
    let holder = locker(&url).await;
    let busy = holder.lock("q/busy").await.expect("lock");
    // 30 waiters: more entries than a page of one queue reads at once.
    let waiters = locker(&url).await;
    let patient = LockOptions::new().wait(Duration::from_secs(60));
    let waits: Vec<_> = (0..30)
        .map(|_| {
            let (waiters, patient) = (waiters.clone(), patient);
            tokio::spawn(async move { waiters.lock_with("q/busy", patient).await })
        })
        .collect();
    let _after = holder.lock("q/next").await.expect("lock");
    let readers = dlock_core::DistRwLock::new(&holder, "q/shared", ());
    let (_r1, _r2) = (
        readers.read().await.expect("read"),
        readers.read().await.expect("read"),
    );
    let writer = dlock_core::DistRwLock::new(&waiters, "q/shared", ());
    let writing = tokio::spawn(async move { writer.write().await.map(drop) });
    let lister = locker(&url).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let locks = loop {
        let locks = all(&lister, "q/", 1).await;
        let counted = |key: &str| {
            locks
                .iter()
                .find(|l| l.key().name() == Some(key))
                .and_then(|l| l.waiters())
        };
        if counted("q/busy") == Some(30) && counted("q/shared") == Some(1) {
            break locks;
        }
        assert!(tokio::time::Instant::now() < deadline, "{locks:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let keys: Vec<_> = locks.iter().map(|l| l.key().to_string()).collect();
    assert_eq!(keys, ["q/busy", "q/next", "q/shared"]);
    assert_eq!(locks[0].holders().len(), 1);
    assert_eq!(locks[0].holders()[0].fence(), busy.fencing_token());
    assert!(locks[0].holders()[0].lease_left().is_some());
    assert_eq!(locks[2].holders().len(), 2, "both readers hold");
    assert!(locks[2]
        .holders()
        .iter()
        .all(|h| h.mode() == Some(dlock_core::backend::Mode::Read)));
    for wait in waits {
        wait.abort();
    }
    writing.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcdctl_layout_refuses_to_list() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/list-test?layout=etcdctl", server.endpoint());
    let locker = locker(&url).await;
    match locker.list("").next_page().await {
        Err(LockError::Unsupported { .. }) => {}
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// A key under the prefix that is not UTF-8 (another tool's, or damaged)
/// does not end the listing where a page ends after it: the locks after
/// it are listed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_utf8_does_not_end_the_listing() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/list-bytes", server.endpoint());
    let holder = locker(&url).await;
    let _a = holder.lock("a").await.expect("lock a");
    let _c = holder.lock("c").await.expect("lock c");
    let mut raw = dlock_etcd::etcd_client::Client::connect([server.endpoint()], None)
        .await
        .expect("connect etcd");
    raw.put(&b"list-bytes/b\xff/entry"[..], "x", None)
        .await
        .expect("put a key that is not UTF-8");
    let locks = all(&holder, "", 1).await;
    let keys: Vec<_> = locks.iter().map(|l| l.key().to_string()).collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert_eq!((keys[0].as_str(), keys[2].as_str()), ("a", "c"), "{keys:?}");
}
