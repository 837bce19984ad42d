//! Redis over TLS (the `tls` feature), against real servers that speak
//! TLS only and ask clients for a certificate. One node (`rediss://`):
//! the whole conformance suite, and typed errors for a client the server
//! or the client cannot trust. A Redis Cluster (`rediss+cluster://`) and
//! a Sentinel set (`rediss+sentinel://`), whose own links (cluster bus,
//! replication, sentinels) speak TLS too: the plain-lock checks, and a
//! failover followed over TLS. The certificates are made in the test.
#![cfg(feature = "tls")]

use std::time::Duration;

use dlock_core::{BackendExt, LockError, Locker};
use dlock_redis::RedisBackend;
use dlock_testkit::{
    fixture::{RedisCluster, RedisSentinels, RedisServer, TestCerts},
    Harness,
};

fn tls_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let server = RedisServer::start_tls(&certs).expect("start redis-server with TLS");
    let url = server.tls_url(&certs);
    Harness::redis("redis over TLS", url, (server, certs)).lists()
}

dlock_testkit::conformance_tests!(suite whole_suite_over_tls, tls_harness());

/// A server whose certificate no trusted CA signed, a client without a
/// certificate, and a plain connection to the TLS port are each refused
/// with a typed error, in bounded time; the same URL with everything is
/// accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_ends_of_a_tls_connection_are_typed_errors() {
    let certs = TestCerts::generate().expect("certificates");
    let server = RedisServer::start_tls(&certs).expect("start redis-server with TLS");
    let good = server.tls_url(&certs);
    let port = server.host_port();
    let other = TestCerts::generate().expect("a CA the server does not know");
    let timeouts = "connect_timeout=2s&response_timeout=2s";
    let cases = [
        (
            "a server signed by a CA the client does not trust",
            format!(
                "rediss://{port}/?tls_ca={}&tls_cert={}&tls_key={}&{timeouts}",
                other.ca().display(),
                certs.client_cert().display(),
                certs.client_key().display()
            ),
        ),
        (
            "a client without a certificate",
            format!(
                "rediss://{port}/?tls_ca={}&{timeouts}",
                certs.ca().display()
            ),
        ),
        (
            "a client certificate the server's CA did not sign",
            format!(
                "rediss://{port}/?tls_ca={}&tls_cert={}&tls_key={}&{timeouts}",
                certs.ca().display(),
                other.client_cert().display(),
                other.client_key().display()
            ),
        ),
        (
            "plain text to the TLS port",
            format!("redis://{port}/?{timeouts}"),
        ),
    ];
    dlock_testkit::assert_refused(&cases, |url| async move {
        Ok(RedisBackend::connect(&url).await?.into_locker())
    })
    .await;
    let missing = format!("rediss://{port}/?tls_ca=/nonexistent/ca.pem");
    assert!(matches!(
        RedisBackend::connect(&missing).await,
        Err(LockError::InvalidOptions { .. })
    ));
    let locker = RedisBackend::connect(&good)
        .await
        .expect("a trusted client")
        .into_locker();
    drop(locker.lock("k").await.expect("a lock over TLS"));
}

fn tls_cluster_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let cluster = RedisCluster::start_tls(3, 0, &certs).expect("start a Redis Cluster with TLS");
    let url = cluster.url();
    assert!(url.starts_with("rediss+cluster://"), "{url}");
    Harness::redis("redis cluster over TLS", url, (cluster, certs)).lists()
}

dlock_testkit::conformance_tests!(plain_locks cluster_over_tls, tls_cluster_harness());

fn tls_sentinel_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let set = RedisSentinels::start_tls(&certs).expect("start Sentinel with TLS");
    let url = set.url();
    assert!(url.starts_with("rediss+sentinel://"), "{url}");
    Harness::redis("redis sentinel over TLS", url, (set, certs)).lists()
}

dlock_testkit::conformance_tests!(plain_locks sentinel_over_tls, tls_sentinel_harness());

/// A Sentinel set whose servers and sentinels speak TLS only: a client
/// without its certificate, and one in plain text, are refused with typed
/// errors. A lock held across a failover stays held on the promoted
/// master, reached over TLS, and the next holder's fence is higher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_sentinel_set_is_followed_through_a_failover() {
    let certs = TestCerts::generate().expect("certificates");
    let set = RedisSentinels::start_tls(&certs).expect("start Sentinel with TLS");
    let url = set.url();
    let (hosts, _) = url
        .trim_start_matches("rediss+sentinel://")
        .split_once('/')
        .unwrap();
    let timeouts = "connect_timeout=2s&response_timeout=2s";
    let cases = [
        (
            "plain text to the sentinels' TLS ports",
            format!("redis+sentinel://{hosts}/locks?{timeouts}"),
        ),
        (
            "a client without a certificate",
            format!(
                "rediss+sentinel://{hosts}/locks?tls_ca={}&{timeouts}",
                certs.ca().display()
            ),
        ),
    ];
    dlock_testkit::assert_refused(&cases, |url| async move {
        Ok(RedisBackend::connect(&url).await?.into_locker())
    })
    .await;

    // Longer than a failover takes, a split vote's retry included
    // (`failover-timeout` 5 s, twice): a lease that runs out while no
    // master answers is lost, rightly.
    let lease = Duration::from_secs(15);
    let locker = |url: String| async move {
        let backend = RedisBackend::connect(&url).await.expect("connect over TLS");
        Locker::builder(backend)
            .watchdog_lease(lease)
            .build()
            .unwrap()
    };
    let (holder, other) = (locker(url.clone()).await, locker(url.clone()).await);
    let held = holder.lock("across").await.expect("a lock over TLS");
    let before = held.fencing_token();
    let set = tokio::task::spawn_blocking(move || {
        let mut set = set;
        set.replicated()?;
        set.fail_over().map(|()| set)
    })
    .await
    .unwrap()
    .expect("the replica takes over");
    // The renewal after the failover runs on the new master, over TLS.
    tokio::time::sleep(lease / 2).await;
    assert!(
        !held.is_lost(),
        "a lock the promoted master holds was reported lost: {:?}",
        held.state()
    );
    let refused = other.try_lock("across").await;
    assert!(
        matches!(refused, Ok(None)),
        "a held lock was granted after the failover: {refused:?}"
    );
    held.release().await.expect("released on the new master");
    let next = other.lock("across").await.expect("granted after release");
    assert!(
        next.fencing_token() > before,
        "fences went backwards across the failover: {:?} after {before:?}",
        next.fencing_token()
    );
    drop(next);
    drop(set);
}
