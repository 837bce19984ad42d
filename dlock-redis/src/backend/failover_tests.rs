//! Sentinel failovers at an exact moment of the backend's work, made
//! through [`hooks`](super::hooks) against real servers (a master, its
//! replica and three sentinels from the fixture).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{BackendExt, LockError};
use dlock_testkit::fixture::RedisSentinels;
use redis::AsyncCommands;
use tokio::time::Instant;

use super::{hooks, RedisBackend};
use crate::node::Conn;

/// How many times the backend has followed a new master.
fn masters_followed(backend: &RedisBackend) -> u64 {
    match backend.inner.nodes[0].connection() {
        Conn::Sentinel(following) => *following.0.changes().borrow(),
        _ => panic!("not a Sentinel backend"),
    }
}

/// Kills the master and promotes the replica; restarts the killed
/// server, empty. Blocking. Returns the new master's URL and the old
/// one's.
fn fail_over(set: &mut RedisSentinels) -> (String, String) {
    // Killed before the paused replica runs again and reconnects.
    set.master().process().kill();
    set.replica()
        .process()
        .resume()
        .expect("resume the replica");
    set.fail_over().expect("the replica takes over");
    set.replica().restart().expect("the old master, restarted");
    (set.master().url(), set.replica().url())
}

async fn connection(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("a server's URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the server")
}

/// Makes the server at `old` the replica of the one at `new`, and waits
/// until it is online: a `WAIT 1` on the new master then answers 1 for
/// anything written there.
async fn replicate(new: &str, old: &str) {
    let port = new
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .expect("a port")
        .to_owned();
    let () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(&port)
        .query_async(&mut connection(old).await)
        .await
        .expect("REPLICAOF");
    let mut new = connection(new).await;
    let since = Instant::now();
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut new)
            .await
            .expect("INFO");
        if info.contains("state=online") {
            return;
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "the old master never replicated the new one: {info}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// With `wait_replicas=1`, a grant counts only once a replica has it. The
/// master fails over between the grant's answer and the backend's next
/// step: the grant never reached the (paused, cut off) replica, which is
/// promoted, and the old master comes back as its replica, so a `WAIT` on
/// the new master's connection would count a replica without the grant.
/// The acquisition must fail (the new master not holding the key), or the
/// new master must hold it for us.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_between_a_grant_and_its_wait_does_not_count_the_grant() {
    let mut set = RedisSentinels::start().expect("start a master, a replica and 3 sentinels");
    let url = format!("{}?wait_replicas=1&wait_timeout=200ms", set.url());
    let backend = RedisBackend::connect(&url)
        .await
        .expect("connect through the sentinels");
    let locker = backend.clone().into_locker();
    // The replica stopped, and its link cut: nothing the master writes
    // from now on reaches it (a write already sent would wait in its
    // socket for it to run again).
    set.replica().process().pause().expect("pause the replica");
    let () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut connection(&set.master().url()).await)
        .await
        .expect("CLIENT KILL");
    let set = Arc::new(Mutex::new(set));
    let (during, watched) = (set.clone(), backend.clone());
    hooks::after_grant(
        "dlock:{switched}",
        Box::new(move || {
            Box::pin(async move {
                let (new, old) = tokio::task::spawn_blocking(move || {
                    fail_over(&mut during.lock().unwrap_or_else(|e| e.into_inner()))
                })
                .await
                .expect("the failover");
                replicate(&new, &old).await;
                // The backend follows the new master (it asks the
                // sentinels every second) before the grant's next step.
                let since = Instant::now();
                while masters_followed(&watched) == 0 {
                    assert!(
                        since.elapsed() < Duration::from_secs(15),
                        "the backend never followed the new master"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        }),
    );
    let outcome = tokio::time::timeout(Duration::from_secs(120), locker.try_lock("switched"))
        .await
        .expect("the acquisition never ended");
    assert!(
        masters_followed(&backend) > 0,
        "the failover did not happen between the grant and its next step"
    );
    let master = set.lock().unwrap_or_else(|e| e.into_inner()).master().url();
    let mut new_master = connection(&master).await;
    let on_new_master: Option<String> = new_master.get("dlock:{switched}").await.expect("GET");
    match outcome {
        Err(e @ LockError::Backend { .. }) => {
            assert!(e.to_string().contains("wait_replicas"), "{e}");
            assert_eq!(on_new_master, None, "a refused grant holds the key");
        }
        Ok(Some(guard)) => {
            assert!(
                on_new_master.is_some(),
                "granted as acknowledged by a replica, but the new master never had the \
                 grant: another client can take the lock ({:?})",
                guard.fencing_token()
            );
        }
        other => panic!("neither granted nor refused for want of replicas: {other:?}"),
    }
}
