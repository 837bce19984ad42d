//! PostgreSQL over TLS (the `tls` feature, `sslmode=verify-full`), against
//! a real server that takes TCP connections over TLS only: the whole
//! conformance suite, and typed errors for a connection without TLS or
//! with a server the client cannot trust (see `dlock_testkit::sql`), and
//! no process-wide crypto provider set. The certificates are made in the
//! test.
#![cfg(feature = "tls")]

use dlock_core::BackendExt;
use dlock_postgres::PgBackend;
use dlock_testkit::fixture::{PostgresServer, TestCerts};

dlock_testkit::sql_tests!(tls PostgresServer);

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
