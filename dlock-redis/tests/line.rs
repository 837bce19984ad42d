//! The waiting line on the servers, against real `redis-server` processes:
//! a free lock waits for the first in line, whichever client asks, one waiter woken per release,
//! wake-ups that are never lost, and a line that a crashed or departed
//! waiter does not hold up.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{LockError, LockOptions, Locker};
use dlock_redis::redis;
use dlock_testkit::fixture::RedisServer;
use tokio::time::Instant;

mod common;

use common::client;

/// How many tickets the line of `key` holds on `server`.
async fn in_line(server: &RedisServer, key: &str) -> u64 {
    redis::cmd("ZCARD")
        .arg(format!("dlock:{{{key}}}:queue"))
        .query_async(&mut server.connection().await)
        .await
        .expect("ZCARD")
}

/// Waits until the line of `key` holds `n` tickets on `server`.
async fn until_in_line(server: &RedisServer, key: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while in_line(server, key).await != n {
        assert!(Instant::now() < deadline, "the line never held {n} tickets");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The ids of `server`'s pub/sub connections.
async fn pubsub_clients(server: &RedisServer) -> Vec<String> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut server.connection().await)
        .await
        .expect("CLIENT LIST");
    list.lines()
        .filter_map(|l| l.split(' ').next()?.strip_prefix("id="))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiters_subscription_stays_up_past_its_keepalive_ping() {
    let server = RedisServer::start().expect("redis-server");
    let (holder, waiter) = (
        client(&server.url(), Duration::from_secs(30)).await,
        client(&server.url(), Duration::from_secs(30)).await,
    );
    let guard = holder.lock("kept").await.unwrap();
    let waiting = tokio::spawn(async move {
        let guard = waiter.lock("kept").await.unwrap();
        guard.release().await.unwrap();
    });
    until_in_line(&server, "kept", 1).await;
    let before = pubsub_clients(&server).await;
    // The keepalive pings every 5 s: past two of them.
    tokio::time::sleep(Duration::from_millis(11_000)).await;
    let after = pubsub_clients(&server).await;
    assert_eq!(
        before, after,
        "the pub/sub connection was replaced while its waiter waited"
    );
    guard.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter was not woken")
        .unwrap();
}

/// 16 clients take turns on one key; every wait must end well before the
/// shortest fallback timer (the pub/sub keepalive's 5 s; the tickets are
/// refreshed every 20 s and the TTLs are 60 s), so a lost wake-up fails it.
async fn check_no_wake_up_is_lost(url: &str) {
    const CLIENTS: usize = 16;
    const ROUNDS: usize = 25;
    let lease = Duration::from_secs(60);
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(client(url, lease).await);
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
                        .lock_with("lost", LockOptions::new().wait(Duration::from_secs(30)))
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
    println!("longest wait of {CLIENTS} clients x {ROUNDS} rounds: {longest:?}");
    assert!(
        longest < Duration::from_secs(4),
        "a waiter slept {longest:?}: a release did not wake the waiter it named"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wake_up_is_lost_on_one_node_with_every_fallback_long() {
    let server = RedisServer::start().expect("redis-server");
    check_no_wake_up_is_lost(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wake_up_is_lost_on_redlock_with_every_fallback_long() {
    let servers = RedisServer::start_many(5).expect("redis-server");
    check_no_wake_up_is_lost(&RedisServer::redlock_url(&servers)).await;
}

/// A waiter first in line on every node that never acts (a ticket put
/// there by hand, lapsing in 3 s): the holder's release hands the lock to
/// it, and the lock is refused to every client that asks later, whether
/// with one attempt or waiting, until that ticket lapses; then the next
/// waiter takes it. Deterministic, unlike a race between a woken waiter
/// and a releaser.
async fn check_a_released_lock_goes_to_the_first_in_line(url: &str, servers: &[RedisServer]) {
    let lease = Duration::from_secs(30);
    let ticket = Duration::from_secs(3);
    let (holder, later) = (client(url, lease).await, client(url, lease).await);
    let guard = holder.lock("fifo").await.unwrap();
    let placed = Instant::now();
    for server in servers {
        let mut conn = server.connection().await;
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let lapses_ms = secs * 1000 + micros / 1000 + ticket.as_millis() as u64;
        let _: () = redis::pipe()
            .cmd("ZADD")
            .arg("dlock:{fifo}:queue")
            .arg(1)
            .arg("first")
            .cmd("ZADD")
            .arg("dlock:{fifo}:tickets")
            .arg(lapses_ms)
            .arg("first")
            .query_async(&mut conn)
            .await
            .expect("ZADD");
    }
    // A waiter that gives up: its attempt in line marks the holder's key
    // as waited for, as every waiter's does.
    let gave_up = later
        .lock_with("fifo", LockOptions::new().wait(Duration::from_millis(200)))
        .await;
    assert!(
        matches!(gave_up, Err(LockError::Timeout { .. })),
        "granted while held: {:?}",
        gave_up.map(|_| ())
    );
    guard.release().await.unwrap();
    for server in servers {
        let held: Option<String> = redis::cmd("GET")
            .arg("dlock:{fifo}")
            .query_async(&mut server.connection().await)
            .await
            .unwrap();
        assert_eq!(
            held.as_deref(),
            Some("next:first"),
            "the release did not hand the lock to the first in line"
        );
    }
    assert!(
        later.try_lock("fifo").await.unwrap().is_none(),
        "a single attempt took the lock ahead of the first in line"
    );
    let waited = later
        .lock_with("fifo", LockOptions::new().wait(Duration::from_millis(500)))
        .await;
    assert!(
        matches!(waited, Err(LockError::Timeout { .. })),
        "a waiter took the lock ahead of the first in line: {:?}",
        waited.map(|_| ())
    );
    let taken = later
        .lock_with("fifo", LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .expect("the lock stayed refused after the first ticket lapsed");
    let after = placed.elapsed();
    assert!(
        after >= ticket - Duration::from_millis(50),
        "taken {after:?} after the first ticket was placed, before it lapsed"
    );
    assert!(
        after < ticket + Duration::from_secs(2),
        "taken only {after:?} after the first ticket was placed"
    );
    taken.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lock_goes_to_the_first_in_line_on_one_node() {
    let server = RedisServer::start().expect("redis-server");
    check_a_released_lock_goes_to_the_first_in_line(&server.url(), std::slice::from_ref(&server))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lock_goes_to_the_first_in_line_on_redlock() {
    let servers = RedisServer::start_many(5).expect("redis-server");
    check_a_released_lock_goes_to_the_first_in_line(&RedisServer::redlock_url(&servers), &servers)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_waiter_holds_up_the_line_for_at_most_its_lease() {
    let server = RedisServer::start().expect("redis-server");
    let lease = Duration::from_secs(2);
    let (holder, crashed, next) = (
        client(&server.url(), Duration::from_secs(30)).await,
        client(&server.url(), lease).await,
        client(&server.url(), Duration::from_secs(30)).await,
    );
    let guard = holder.lock("crash").await.unwrap();
    // A waiter that stops, as a killed process does: never polled again,
    // never dropped, so it neither refreshes its ticket nor leaves.
    let mut stuck = Box::pin(crashed.lock("crash"));
    tokio::select! {
        result = &mut stuck => panic!("granted while held: {:?}", result.map(|_| ())),
        () = until_in_line(&server, "crash", 1) => {}
    }
    let crashed_at = Instant::now();
    std::mem::forget(stuck);
    let waiting = tokio::spawn(async move {
        let guard = next
            .lock_with("crash", LockOptions::new().wait(Duration::from_secs(20)))
            .await
            .unwrap();
        let at = Instant::now();
        guard.release().await.unwrap();
        at
    });
    until_in_line(&server, "crash", 2).await;
    guard.release().await.unwrap();
    let granted_at = waiting.await.unwrap();
    let after = granted_at - crashed_at;
    println!("granted {after:?} after the waiter ahead crashed (its lease {lease:?})");
    // Its ticket lapses one lease after its last refresh, which was before
    // `crashed_at`; the next attempt then finds it gone.
    assert!(
        after < lease + Duration::from_millis(1500),
        "the crashed waiter held up the line for {after:?}"
    );
}

/// Once `quitter`'s releases settled, nobody stands in the line of "quit".
async fn assert_left_the_line(quitter: &Locker, server: &RedisServer, who: &str) {
    tokio::time::timeout(Duration::from_secs(10), quitter.wait_for_releases())
        .await
        .unwrap_or_else(|_| panic!("the release of {who} did not settle"));
    assert_eq!(in_line(server, "quit").await, 0, "{who} kept its ticket");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_leaves_the_line_at_once() {
    let server = RedisServer::start().expect("redis-server");
    let lease = Duration::from_secs(30);
    let (holder, quitter, next) = (
        client(&server.url(), lease).await,
        client(&server.url(), lease).await,
        client(&server.url(), lease).await,
    );
    let guard = holder.lock("quit").await.unwrap();
    // One gives up at its wait limit, one is dropped half-way.
    let limited = quitter
        .lock_with("quit", LockOptions::new().wait(Duration::from_millis(300)))
        .await;
    assert!(
        matches!(limited, Err(LockError::Timeout { .. })),
        "{limited:?}"
    );
    assert_left_the_line(&quitter, &server, "a waiter that timed out").await;
    let mut dropped = Box::pin(quitter.lock("quit"));
    tokio::select! {
        result = &mut dropped => panic!("granted while held: {:?}", result.map(|_| ())),
        () = until_in_line(&server, "quit", 1) => {}
    }
    drop(dropped);
    assert_left_the_line(&quitter, &server, "a dropped waiter").await;
    guard.release().await.unwrap();
    let taken = next.try_lock("quit").await.unwrap();
    assert!(taken.is_some(), "the departed waiters held up the line");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_channel_is_unsubscribed_after_lingering() {
    let server = RedisServer::start().expect("redis-server");
    let lease = Duration::from_secs(30);
    let (holder, waiter) = (
        client(&server.url(), lease).await,
        client(&server.url(), lease).await,
    );
    let guard = holder.lock("linger").await.unwrap();
    let waiting = tokio::spawn(async move {
        let guard = waiter.lock("linger").await.unwrap();
        guard.release().await.unwrap();
        waiter
    });
    until_in_line(&server, "linger", 1).await;
    let channels = || async {
        let names: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .query_async(&mut server.connection().await)
            .await
            .expect("PUBSUB CHANNELS");
        names
    };
    assert_eq!(channels().await, ["dlock:{linger}:released"]);
    guard.release().await.unwrap();
    let _waiter = waiting.await.unwrap();
    // Kept for a second after its last waiter left, then given up.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !channels().await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the channel stayed subscribed with nobody waiting"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
