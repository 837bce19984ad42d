//! The whole conformance suite against a real PostgreSQL server: one
//! server per check, and every client a new `PgBackend` with sessions of
//! its own.

use std::{sync::Arc, time::Duration};

use dlock_core::backend::Backend;
use dlock_postgres::PgBackend;
use dlock_testkit::{fixture::PostgresServer, Harness};

/// The session timeout is short, so that crashed clients let others in
/// quickly.
fn server() -> Harness {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let session = Duration::from_secs(2);
    let url = format!("{}?session_timeout={}ms", server.url(), session.as_millis());
    Harness::new("postgres", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn Backend> = Arc::new(PgBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
    .disconnect_releases()
    .keep_alive(server)
}

dlock_testkit::conformance_tests!(server());
