//! MySQL over TLS (the `tls` feature, `ssl-mode=VERIFY_IDENTITY`), against
//! a real MariaDB server whose user may log in over TLS only: the whole
//! conformance suite, and typed errors for a connection without TLS or
//! with a server the client cannot trust. The certificates are made in
//! the test.
#![cfg(feature = "tls")]

use std::sync::Arc;

use dlock_core::{backend::DynBackend, BackendExt};
use dlock_mysql::MySqlBackend;
use dlock_testkit::{
    fixture::{MariaDbServer, TestCerts},
    Harness,
};

fn tls_harness() -> Harness {
    let certs = TestCerts::generate().expect("certificates");
    let server = MariaDbServer::start_tls(&certs).expect("start MariaDB with TLS");
    let session = std::time::Duration::from_secs(2);
    let url = format!(
        "{}&session_timeout={}ms",
        server.tls_url(&certs),
        session.as_millis()
    );
    Harness::new("mysql over TLS", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(MySqlBackend::connect(&url).await?);
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
    let server = MariaDbServer::start_tls(&certs).expect("start MariaDB with TLS");
    let other = TestCerts::generate().expect("a CA the server does not know");
    let cases = [
        (
            "no TLS",
            format!("{}?ssl-mode=DISABLED&connect_timeout=5s", server.url()),
        ),
        (
            "a server signed by a CA the client does not trust",
            format!(
                "{}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}&connect_timeout=5s",
                server.url(),
                other.ca().display()
            ),
        ),
    ];
    dlock_testkit::assert_refused(&cases, |url| async move {
        Ok(MySqlBackend::connect(&url).await?.into_locker())
    })
    .await;
}
