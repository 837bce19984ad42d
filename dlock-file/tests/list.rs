//! The file backend's listing where the conformance suite does not look:
//! waiters counted from `/proc/locks`, and a key too long for a file name.

use std::time::Duration;

use dlock_core::{backend::ListedKey, BackendExt, LockOptions, Locker};
use dlock_file::FileBackend;

fn locker(dir: &std::path::Path) -> Locker {
    FileBackend::open(dir).expect("open").into_locker()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_counted_and_long_keys_say_they_are_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, lister) = (locker(dir.path()), locker(dir.path()), locker(dir.path()));
    let _held = a.lock("busy").await.expect("lock");
    let long = "k".repeat(300);
    let _long = a.lock(&long).await.expect("lock a long key");
    let waiting = tokio::spawn(async move {
        b.lock_with("busy", LockOptions::new().wait(Duration::from_secs(30)))
            .await
            .map(drop)
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let locks = loop {
        let locks = lister
            .list("")
            .next_page()
            .await
            .expect("list")
            .unwrap_or_default();
        if locks.iter().any(|l| l.waiters() == Some(1)) {
            break locks;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no waiter counted: {locks:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(locks.len(), 2, "{locks:#?}");
    assert_eq!(locks[0].key(), &ListedKey::Named("busy".into()));
    assert_eq!(locks[0].waiters(), Some(1));
    assert!(
        matches!(locks[1].key(), ListedKey::Hashed(id) if id.contains('#')),
        "{:?}",
        locks[1].key()
    );
    waiting.abort();
}
