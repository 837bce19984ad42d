//! Unfair locking (`?fair=false`, `LockOptions::fair(false)`) against real
//! `redis-server` processes: a waiter takes no place in the key's line,
//! an uncontended lock is the plain attempt alone, and the release (not the
//! holder's lease) wakes the waiters.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{LockOptions, Locker};
use dlock_redis::{redis, RedisBackend, RedisConfig};
use dlock_testkit::fixture::RedisServer;
use tokio::time::Instant;

/// A client of its own whose fallbacks are long: the poll without pub/sub
/// (60 s) and the holder's lease (`lease`).
async fn client(url: &str, lease: Duration) -> Locker {
    let config = RedisConfig::from_url(url)
        .expect("url")
        .with_unwatched_poll(Duration::from_secs(60));
    let backend = RedisBackend::connect_with(config).await.expect("connect");
    Locker::builder(backend)
        .watchdog_lease(lease)
        .build()
        .expect("locker")
}

/// What `INFO commandstats` counts of `command` on `server`.
async fn calls(server: &RedisServer, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut server.connection().await)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

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

/// Sixteen unfair clients, 25 locks each, every fallback long (a 60 s
/// lease and poll): a release that told nobody would leave every waiter
/// asleep for a minute. On one node, and on Redlock (where a waiter tries
/// one node first, and the holder's value is marked there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_unfair_wake_up_is_lost() {
    let server = RedisServer::start().expect("redis-server");
    check_no_wake_up_is_lost(&format!("{}?fair=false", server.url())).await;
    let servers = RedisServer::start_many(5).expect("redis-server");
    let url = format!("{}?fair=false", RedisServer::redlock_url(&servers));
    check_no_wake_up_is_lost(&url).await;
}

async fn check_no_wake_up_is_lost(url: &str) {
    const CLIENTS: usize = 16;
    const ROUNDS: usize = 25;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(client(url, Duration::from_secs(60)).await);
    }
    let longest = Arc::new(Mutex::new(Duration::ZERO));
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|locker| {
            let longest = longest.clone();
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let asked = Instant::now();
                    let guard = locker
                        .lock_with("lost", LockOptions::new().wait(Duration::from_secs(40)))
                        .await
                        .expect("lock");
                    let waited = asked.elapsed();
                    {
                        let mut longest = longest.lock().unwrap();
                        *longest = (*longest).max(waited);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let longest = *longest.lock().unwrap();
    println!("longest wait of {CLIENTS} unfair clients x {ROUNDS} rounds on {url}: {longest:?}");
    assert!(
        longest < Duration::from_secs(6),
        "a waiter slept {longest:?}: a release told nobody"
    );
}
