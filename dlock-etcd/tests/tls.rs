//! etcd over TLS (`etcds://`, the `tls` feature), against a real member
//! that speaks TLS only and asks clients for a certificate: the whole
//! conformance suite, and typed errors for a client the server or the
//! client cannot trust. The certificates are made in the test.
#![cfg(feature = "tls")]

use std::sync::Arc;

use dlock_core::{backend::DynBackend, BackendExt};
use dlock_etcd::EtcdBackend;
use dlock_testkit::{
    fixture::{EtcdServer, TestCerts},
    Harness,
};

fn tls_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let server = EtcdServer::start_tls(&certs).expect("start etcd with TLS");
    let url = server.tls_url(&certs, "dlock-test");
    Harness::new("etcd over TLS", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(EtcdBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .lists()
    .keep_alive((server, certs))
}

dlock_testkit::conformance_tests!(suite whole_suite_over_tls, tls_harness());

/// A server whose certificate no trusted CA signed, a client without a
/// certificate, and plain text to the TLS port are each refused with a
/// typed error, in bounded time; the same URL with everything is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_ends_of_a_tls_connection_are_typed_errors() {
    let certs = TestCerts::generate().expect("certificates");
    let server = EtcdServer::start_tls(&certs).expect("start etcd with TLS");
    let other = TestCerts::generate().expect("a CA the server does not know");
    let endpoint = server.endpoint();
    let timeouts = "connect_timeout=2s&request_timeout=2s";
    let cases = [
        (
            "a server signed by a CA the client does not trust",
            format!(
                "etcds://{endpoint}/x?tls_ca={}&tls_cert={}&tls_key={}&{timeouts}",
                other.ca().display(),
                certs.client_cert().display(),
                certs.client_key().display()
            ),
        ),
        (
            "a client without a certificate",
            format!(
                "etcds://{endpoint}/x?tls_ca={}&{timeouts}",
                certs.ca().display()
            ),
        ),
        (
            "a client certificate the server's CA did not sign",
            format!(
                "etcds://{endpoint}/x?tls_ca={}&tls_cert={}&tls_key={}&{timeouts}",
                certs.ca().display(),
                other.client_cert().display(),
                other.client_key().display()
            ),
        ),
        (
            "plain text to the TLS port",
            format!("etcd://{endpoint}/x?{timeouts}"),
        ),
    ];
    dlock_testkit::assert_refused(&cases, |url| async move {
        Ok(EtcdBackend::connect(&url).await?.into_locker())
    })
    .await;
    let locker = EtcdBackend::connect(&server.tls_url(&certs, "x"))
        .await
        .expect("a trusted client")
        .into_locker();
    drop(locker.lock("k").await.expect("a lock over TLS"));
}

/// A TLS connection leaves the process-wide crypto provider to the
/// application: dlock installs none (no test in this binary installs one,
/// and every one connects over TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_sets_no_process_wide_crypto_provider() {
    let certs = TestCerts::generate().expect("certificates");
    let server = EtcdServer::start_tls(&certs).expect("start etcd with TLS");
    let locker = EtcdBackend::connect(&server.tls_url(&certs, "x"))
        .await
        .expect("a trusted client")
        .into_locker();
    drop(locker.lock("k").await.expect("a lock over TLS"));
    assert!(
        rustls::crypto::CryptoProvider::get_default().is_none(),
        "connecting installed a process-wide crypto provider"
    );
}
