//! Unfair locking (`?fair=false`, `LockOptions::fair(false)`) against real
//! `redis-server` processes: a waiter takes no place in the key's line,
//! an uncontended lock is the plain attempt alone, and the release (not the
//! holder's lease) wakes the waiters.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::LockOptions;
use dlock_redis::redis;
use dlock_testkit::fixture::RedisServer;
use tokio::time::Instant;

mod common;

use common::{calls, client};

/// The value of `name` on `server`, and whether the line's names exist.
async fn value_and_line(server: &RedisServer, key: &str) -> (Option<String>, u64) {
    let mut conn = server.connection().await;
    let value: Option<String> = redis::cmd("GET")
        .arg(format!("dlock:{{{key}}}"))
        .query_async(&mut conn)
        .await
        .expect("GET");
    let line: u64 = redis::cmd("EXISTS")
        .arg(format!("dlock:{{{key}}}:queue"))
        .arg(format!("dlock:{{{key}}}:tickets"))
        .query_async(&mut conn)
        .await
        .expect("EXISTS");
    (value, line)
}

/// Unfair by the URL's default and by the lock's option on a fair
/// client: an uncontended lock is one `SET` and no script; a waiter leaves
/// no ticket and no line on the server, only a mark on the holder's value;
/// and the release wakes it at once, long before the holder's 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfair_waiter_stands_in_no_line_and_the_release_wakes_it() {
    let server = RedisServer::start().expect("redis-server");
    let lease = Duration::from_secs(30);
    let unfair_url = format!("{}?fence=off&fair=false", server.url());
    let fair_url = format!("{}?fence=off", server.url());
    for (case, url, options) in [
        ("fair=false", &unfair_url, LockOptions::new()),
        ("fair(false)", &fair_url, LockOptions::new().fair(false)),
    ] {
        let key = format!("unfair-{}", case.len());
        let (holder, waiter) = (client(url, lease).await, client(url, lease).await);
        // Scripts loaded, connections up.
        holder.lock("warm").await.unwrap().release().await.unwrap();
        let (sets, scripts) = (calls(&server, "set").await, calls(&server, "evalsha").await);
        let guard = holder.lock_with(&key, options).await.unwrap();
        assert_eq!(
            (
                calls(&server, "set").await - sets,
                calls(&server, "evalsha").await - scripts
            ),
            (1, 0),
            "[{case}] an uncontended lock is one plain SET"
        );
        let waiting = tokio::spawn({
            let key = key.clone();
            async move {
                let guard = waiter
                    .lock_with(&key, options.wait(Duration::from_secs(20)))
                    .await
                    .unwrap();
                let got = Instant::now();
                guard.release().await.unwrap();
                got
            }
        });
        // The waiter marks the holder's value once it listens.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (value, line) = value_and_line(&server, &key).await;
            assert_eq!(line, 0, "[{case}] a waiter stood in the key's line");
            if value.is_some_and(|v| v.ends_with('+')) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "[{case}] the waiter never waited"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(value_and_line(&server, &key).await.1, 0, "[{case}] line");
        let released = Instant::now();
        guard.release().await.unwrap();
        let got = waiting.await.unwrap();
        let woke = got.saturating_duration_since(released);
        assert!(
            woke < Duration::from_secs(2),
            "[{case}] the waiter took the key {woke:?} after the release: not woken by it"
        );
    }
}

/// Sixteen clients, 25 locks each, every fallback long (a 60 s lease
/// and poll, so a waiter looks again on its own only after 10 s): each
/// time the key frees while someone waits, a waiter must hold it soon
/// after (`GAP`); one release that told nobody leaves that gap at
/// seconds. All unfair, and half fair and half unfair on one key; on one
/// node, and on Redlock (where an unfair waiter tries one node first, and
/// the holder's value is marked there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_unfair_wake_up_is_lost() {
    let server = RedisServer::start().expect("redis-server");
    let servers = RedisServer::start_many(5).expect("redis-server");
    for url in [server.url(), RedisServer::redlock_url(&servers)] {
        check_no_wake_up_is_lost(&url, 0).await;
        check_no_wake_up_is_lost(&url, 8).await;
    }
}

/// The longest a waiter may find the key free before holding it: a
/// woken waiter's round trip, on a loaded machine.
const GAP: Duration = Duration::from_millis(1500);

/// When the key was last freed (just before a release was sent) and the
/// longest gap seen between that and a grant to a waiter that had asked
/// before it.
#[derive(Default)]
struct Gaps {
    freed: Option<Instant>,
    longest: Duration,
}

async fn check_no_wake_up_is_lost(url: &str, fair_clients: usize) {
    const CLIENTS: usize = 16;
    const ROUNDS: usize = 25;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(client(url, Duration::from_secs(60)).await);
    }
    let gaps = Arc::new(Mutex::new(Gaps::default()));
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, locker)| {
            let gaps = gaps.clone();
            let options = LockOptions::new()
                .wait(Duration::from_secs(40))
                .fair(i < fair_clients);
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let asked = Instant::now();
                    let guard = locker.lock_with("lost", options).await.expect("lock");
                    {
                        let mut gaps = gaps.lock().unwrap();
                        if let Some(freed) = gaps.freed.filter(|&freed| freed > asked) {
                            gaps.longest = gaps.longest.max(freed.elapsed());
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    gaps.lock().unwrap().freed = Some(Instant::now());
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let longest = gaps.lock().unwrap().longest;
    println!("{CLIENTS} clients ({fair_clients} fair) x {ROUNDS} rounds on {url}: longest gap {longest:?}");
    assert!(
        longest < GAP,
        "[{url}, {fair_clients} fair] the key lay free {longest:?} with someone waiting: a release told nobody"
    );
}

/// A fair holder, a fair waiter in line and an unfair waiter on one key:
/// the release hands the key to the fair waiter (a message naming it
/// alone), who holds it a moment and releases with nobody left in line.
/// That release must wake the unfair waiter, not leave it asleep until
/// it looks again on its own (seconds). On one node and on Redlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfair_waiter_behind_a_fair_one_is_woken() {
    let server = RedisServer::start().expect("redis-server");
    check_behind_a_fair_one(&server.url(), &server).await;
    let servers = RedisServer::start_many(3).expect("redis-server");
    check_behind_a_fair_one(&RedisServer::redlock_url(&servers), &servers[0]).await;
}

/// How many clients listen on `key`'s release channel on `server`.
async fn listeners(server: &RedisServer, key: &str) -> u64 {
    let (_, n): (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(format!("dlock:{{{key}}}:released"))
        .query_async(&mut server.connection().await)
        .await
        .expect("PUBSUB NUMSUB");
    n
}

async fn check_behind_a_fair_one(url: &str, server: &RedisServer) {
    let lease = Duration::from_secs(30);
    let key = "behind-fair";
    let holder = client(url, lease).await;
    let (fair, unfair) = (client(url, lease).await, client(url, lease).await);
    let guard = holder.lock(key).await.unwrap();
    let wait = LockOptions::new().wait(Duration::from_secs(20));
    let freed = Arc::new(Mutex::new(None));
    let fair_waiter = tokio::spawn({
        let freed = freed.clone();
        async move {
            let guard = fair.lock_with(key, wait).await.unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
            *freed.lock().unwrap() = Some(Instant::now());
            guard.release().await.unwrap();
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while value_and_line(server, key).await.1 == 0 {
        assert!(
            Instant::now() < deadline,
            "the fair waiter never stood in line"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let unfair_waiter = tokio::spawn(async move {
        let guard = unfair.lock_with(key, wait.fair(false)).await.unwrap();
        let got = Instant::now();
        guard.release().await.unwrap();
        got
    });
    while listeners(server, key).await < 2 {
        assert!(
            Instant::now() < deadline,
            "the unfair waiter never listened"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its look after subscribing (which marks the hold) has answered.
    tokio::time::sleep(Duration::from_millis(300)).await;
    guard.release().await.unwrap();
    fair_waiter.await.unwrap();
    let got = unfair_waiter.await.unwrap();
    let freed = freed.lock().unwrap().expect("released");
    let woke = got.saturating_duration_since(freed);
    assert!(
        woke < Duration::from_secs(1),
        "[{url}] the unfair waiter took the key {woke:?} after the fair one freed it"
    );
}
