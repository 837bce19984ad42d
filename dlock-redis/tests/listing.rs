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

/// A listing's cursor names the nodes it scans: resumed where they are
/// not the same (a cluster whose masters changed between pages, here
/// another deployment), the page is refused, typed, instead of resuming
/// another node's scan (keys skipped or listed twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_resumed_on_other_nodes_is_refused() {
    use dlock_core::backend::{Backend, ListRequest};
    let servers = RedisServer::start_many(2).expect("redis-server");
    let (one, other) = (
        RedisBackend::connect(&servers[0].url())
            .await
            .expect("connect"),
        RedisBackend::connect(&servers[1].url())
            .await
            .expect("connect"),
    );
    let holder = one.clone().into_locker();
    let mut guards = Vec::new();
    for i in 0..3 {
        guards.push(holder.lock(&format!("moved/{i}")).await.unwrap());
    }
    let first = one.list(ListRequest::new("moved/", 1)).await.unwrap();
    let cursor = first.next.expect("more than one page");
    let same = one.list(ListRequest::new("moved/", 1).after(&cursor)).await;
    assert_eq!(same.unwrap().locks.len(), 1, "the same nodes resume");
    match other
        .list(ListRequest::new("moved/", 1).after(&cursor))
        .await
    {
        Err(dlock_core::LockError::Backend { .. }) => {}
        other => panic!("a cursor of other nodes: {other:?}"),
    }
    drop(guards);
}

/// With fences, a held key whose fence counter is gone (evicted, deleted
/// by hand) is listed without a fence, so that it does not fail every
/// page after it; `holder` still says the counter is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_without_its_fence_counter_is_listed_without_a_fence() {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let holder = locker(&url).await;
    let guards = [
        holder.lock("counted/a").await.unwrap(),
        holder.lock("counted/b").await.unwrap(),
    ];
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let counters: Vec<String> = redis::cmd("KEYS")
        .arg("*counted/a*:fence")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(counters.len(), 1, "{counters:?}");
    let _: () = redis::cmd("DEL")
        .arg(&counters[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    let locks = listed(&locker(&url).await, "counted/", 1).await;
    let fences: Vec<_> = locks.iter().map(|l| l.holders()[0].fence()).collect();
    assert_eq!(fences.len(), 2, "{locks:?}");
    assert!(fences[0].is_none() && fences[1].is_some(), "{fences:?}");
    assert!(holder.holder("counted/a").await.is_err());
    drop(guards);
}
