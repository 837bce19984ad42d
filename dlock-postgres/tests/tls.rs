//! PostgreSQL over TLS (the `tls` feature, `sslmode=verify-full`), against
//! a real server that takes TCP connections over TLS only: the whole
//! conformance suite, and typed errors for a connection without TLS or
//! with a server the client cannot trust. The certificates are made in
//! the test.
#![cfg(feature = "tls")]

use std::sync::Arc;

use dlock_core::{backend::DynBackend, BackendExt};
use dlock_postgres::PgBackend;
use dlock_testkit::{
    fixture::{PostgresServer, TestCerts},
    Harness,
};

fn tls_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let server = PostgresServer::start_tls(&certs).expect("start PostgreSQL with TLS");
    let session = std::time::Duration::from_secs(2);
    let url = format!(
        "{}&session_timeout={}ms",
        server.tls_url(&certs),
        session.as_millis()
    );
    Harness::new("postgres over TLS", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(PgBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
    .disconnect_releases()
    .keep_alive((server, certs))
}

dlock_testkit::conformance_tests!(suite whole_suite_over_tls, tls_harness());

/// Without TLS the server refuses the login, and with a CA that did not
/// sign the server's certificate the client refuses the server: typed
/// errors, in bounded time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_or_plain_connections_are_typed_errors() {
    let certs = TestCerts::generate().expect("certificates");
    let server = PostgresServer::start_tls(&certs).expect("start PostgreSQL with TLS");
    let other = TestCerts::generate().expect("a CA the server does not know");
    let cases = [
        (
            "no TLS",
            format!("{}?sslmode=disable&connect_timeout=5s", server.url()),
        ),
        (
            "a server signed by a CA the client does not trust",
            format!(
                "{}?sslmode=verify-full&sslrootcert={}&connect_timeout=5s",
                server.url(),
                other.ca().display()
            ),
        ),
    ];
    dlock_testkit::assert_refused(&cases, |url| async move {
        Ok(PgBackend::connect(&url).await?.into_locker())
    })
    .await;
}

/// A TLS connection leaves the process-wide crypto provider to the
/// application: dlock installs none (no test in this binary installs one,
/// and every one connects over TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_sets_no_process_wide_crypto_provider() {
    let certs = TestCerts::generate().expect("certificates");
    let server = PostgresServer::start_tls(&certs).expect("start PostgreSQL with TLS");
    let backend = PgBackend::connect(&server.tls_url(&certs))
        .await
        .expect("a trusted client");
    let locker = backend.into_locker();
    drop(locker.lock("k").await.expect("a lock over TLS"));
    assert!(
        rustls::crypto::CryptoProvider::get_default().is_none(),
        "connecting installed a process-wide crypto provider"
    );
}
