//! The whole conformance suite against a real MariaDB server, twice: with
//! fencing tokens from the counter rows (the default), and without them
//! (`fence=off`). One test per check, each with keys of its own on one
//! server the binary's tests share, and every client a new `MySqlBackend`
//! with sessions of its own.

use std::{sync::Arc, time::Duration};

use dlock_core::backend::Backend;
use dlock_mysql::MySqlBackend;
use dlock_testkit::{
    fixture::{MariaDbServer, Shared},
    Harness,
};

/// One server for every check, fenced or not: each has keys of its own.
static MARIADB: Shared<MariaDbServer> = Shared::new(MariaDbServer::start);

/// The session timeout is short, so that crashed clients let others in
/// quickly (the server's `wait_timeout` is whole seconds).
fn server(fence: &str) -> Harness {
    let server = MARIADB.get();
    let session = Duration::from_secs(2);
    let url = format!(
        "{}?session_timeout={}ms&fence={fence}",
        server.url(),
        session.as_millis()
    );
    Harness::new("mysql", move || {
        let url = url.clone();
        async move {
            let client: Arc<dyn Backend> = Arc::new(MySqlBackend::connect(&url).await?);
            Ok(client)
        }
    })
    .session_timeout(session)
    .disconnect_releases()
}

mod unfenced {
    use super::server;
    dlock_testkit::conformance_tests!(server("off"));
}

mod row {
    use super::server;
    dlock_testkit::conformance_tests!(server("row"));
}
