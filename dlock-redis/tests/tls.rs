//! Redis over TLS (`rediss://`, the `tls` feature), against a real
//! `redis-server` that speaks TLS only and asks clients for a certificate:
//! the whole conformance suite, and typed errors for a client the server
//! or the client cannot trust. The certificates are made in the test.
#![cfg(feature = "tls")]

use std::sync::Arc;

use dlock_core::{backend::Backend, BackendExt, LockError};
use dlock_redis::RedisBackend;
use dlock_testkit::{
    fixture::{RedisServer, TestCerts},
    Harness,
};

fn tls_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let server = RedisServer::start_tls(&certs).expect("start redis-server with TLS");
    let url = server.tls_url(&certs);
    Harness::new("redis over TLS", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .keep_alive((server, certs))
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
