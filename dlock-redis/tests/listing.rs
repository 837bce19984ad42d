//! Who holds what on Redis deployments whose harness cannot read holders
//! (`fence=off`, Redlock: `holder` is refused there, as the election
//! checks want): `list` still answers, with every held key once, page by
//! page, each holder's note and lease left, and no fence without fences.

use std::time::Duration;

use dlock_core::{BackendExt, LockOptions, Locker};
use dlock_redis::RedisBackend;
use dlock_testkit::fixture::RedisServer;

async fn locker(url: &str) -> Locker {
    RedisBackend::connect(url)
        .await
        .expect("connect")
        .into_locker()
}

/// Every lock under `prefix`, in pages of `page`, at most 100 pages.
async fn listed(locker: &Locker, prefix: &str, page: usize) -> Vec<dlock_core::backend::HeldLock> {
    let mut listing = locker.list(prefix).page_size(page);
    let mut all = Vec::new();
    for _ in 0..100 {
        match listing.next_page().await.expect("list") {
            Some(locks) => {
                assert!(locks.len() <= page, "a page of {}", locks.len());
                all.extend(locks);
            }
            None => return all,
        }
    }
    panic!("a listing never ended");
}

async fn check(url: &str) {
    let (a, b) = (locker(url).await, locker(url).await);
    let prefix = "listing/";
    let mut guards = Vec::new();
    for i in 0..5 {
        let note = format!("worker-{i} ~+");
        let options = LockOptions::new().holder_note(note);
        guards.push(a.lock_with(&format!("{prefix}{i}"), options).await.unwrap());
    }
    let outside = a.lock("listing-not").await.unwrap();
    let locks = listed(&b, prefix, 2).await;
    let mut keys: Vec<String> = locks.iter().map(|l| l.key().to_string()).collect();
    keys.sort();
    let wanted: Vec<String> = (0..5).map(|i| format!("{prefix}{i}")).collect();
    assert_eq!(keys, wanted, "[{url}] listed keys");
    for lock in &locks {
        let i = lock
            .key()
            .to_string()
            .strip_prefix(prefix)
            .unwrap()
            .to_owned();
        let [holder] = lock.holders() else {
            panic!("[{url}] holders of {}: {:?}", lock.key(), lock.holders());
        };
        assert_eq!(
            holder.note(),
            Some(format!("worker-{i} ~+").as_str()),
            "[{url}] note"
        );
        assert_eq!(holder.fence(), None, "[{url}] a fence without fences");
        let left = holder.lease_left().expect("lease left");
        assert!(
            left > Duration::ZERO && left <= Duration::from_secs(30),
            "{left:?}"
        );
    }
    for guard in guards.drain(..3) {
        guard.release().await.unwrap();
    }
    let locks = listed(&b, prefix, 2).await;
    assert_eq!(locks.len(), 2, "[{url}] after three releases: {locks:?}");
    for guard in guards {
        guard.release().await.unwrap();
    }
    outside.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfenced_and_redlock_list_held_locks_with_their_notes() {
    let server = RedisServer::start().expect("redis-server");
    check(&format!("{}?fence=off", server.url())).await;
    let servers = RedisServer::start_many(3).expect("redis-server");
    check(&RedisServer::redlock_url(&servers)).await;
    check(&format!(
        "{}?fair=false",
        RedisServer::redlock_url(&servers)
    ))
    .await;
}
