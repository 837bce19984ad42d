//! The whole conformance suite against a real PostgreSQL server: one test
//! per check, each with keys of its own on one server the binary's tests
//! share, and every client a new `PgBackend` with sessions of its own.

use std::{sync::Arc, time::Duration};

use dlock_core::backend::DynBackend;
use dlock_postgres::PgBackend;
use dlock_testkit::{
    fixture::{PostgresServer, Shared},
    Harness,
};

/// One server for every check: each has keys of its own.
static POSTGRES: Shared<PostgresServer> = Shared::new(PostgresServer::start);

/// The session timeout is short, so that crashed clients let others in
/// quickly.
fn server() -> Harness {
    let server = POSTGRES.get();
    let session = Duration::from_secs(2);
    let url = format!("{}?session_timeout={}ms", server.url(), session.as_millis());
    Harness::new("postgres", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn DynBackend> = Arc::new(PgBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
    .disconnect_releases()
}

dlock_testkit::conformance_tests!(server());
