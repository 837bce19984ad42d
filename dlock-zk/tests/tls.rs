//! ZooKeeper over TLS (`zks://`, the `tls` feature), against a real server
//! whose TLS port (`secureClientPort`, on Netty) asks clients for a
//! certificate: the whole conformance suite, and typed errors for a client
//! the server or the client cannot trust. The certificates are made in
//! the test.
#![cfg(feature = "tls")]

use std::{sync::Arc, time::Duration};

use dlock_core::{backend::DynBackend, BackendExt};
use dlock_testkit::{
    fixture::{TestCerts, ZooKeeperServer},
    Harness,
};
use dlock_zk::ZkBackend;

fn tls_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let server = ZooKeeperServer::start_tls(&certs).expect("start ZooKeeper with TLS");
    let session = Duration::from_secs(2);
    let url = format!(
        "{}&session_timeout={}ms",
        server.tls_url(&certs, "/dlock-test"),
        session.as_millis()
    );
    Harness::new("zookeeper over TLS", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(ZkBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
    .lists()
    .keep_alive((server, certs))
}

dlock_testkit::conformance_tests!(suite whole_suite_over_tls, tls_harness());

/// A server whose certificate no trusted CA signed, a client without a
/// certificate, a client certificate the server's CA did not sign, and
/// plain text to the TLS port are each refused with a typed error, in
/// bounded time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_ends_of_a_tls_connection_are_typed_errors() {
    let certs = TestCerts::generate().expect("certificates");
    let server = ZooKeeperServer::start_tls(&certs).expect("start ZooKeeper with TLS");
    let other = TestCerts::generate().expect("a CA the server does not know");
    let good = server.tls_url(&certs, "/x");
    let (base, _) = good.split_once('?').expect("a query");
    let secure = base.trim_start_matches("zks://").trim_end_matches("/x");
    let timeouts = "connect_timeout=3s";
    let cases = [
        (
            "a server signed by a CA the client does not trust",
            format!(
                "{base}?tls_ca={}&tls_cert={}&tls_key={}&{timeouts}",
                other.ca().display(),
                certs.client_cert().display(),
                certs.client_key().display()
            ),
        ),
        (
            "a client without a certificate",
            format!("{base}?tls_ca={}&{timeouts}", certs.ca().display()),
        ),
        (
            "a client certificate the server's CA did not sign",
            format!(
                "{base}?tls_ca={}&tls_cert={}&tls_key={}&{timeouts}",
                certs.ca().display(),
                other.client_cert().display(),
                other.client_key().display()
            ),
        ),
        (
            "plain text to the TLS port",
            format!("zk://{secure}/x?{timeouts}"),
        ),
    ];
    dlock_testkit::assert_refused(&cases, |url| async move {
        Ok(ZkBackend::connect(&url).await?.into_locker())
    })
    .await;
    let locker = ZkBackend::connect(&good)
        .await
        .expect("a trusted client")
        .into_locker();
    drop(locker.lock("k").await.expect("a lock over TLS"));
}
