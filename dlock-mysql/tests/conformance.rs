//! The whole conformance suite against a real MariaDB server, twice: with
//! fencing tokens from the counter rows (the default), and without them
//! (`fence=off`). One test per check, each with keys of its own on one
//! server the binary's tests share, and every client a new `MySqlBackend`
//! with sessions of its own. And once more, in one test, in a database
//! whose character set is UTF-16.

use dlock_testkit::{
    fixture::{MariaDbServer, Shared, MARIADB_PASSWORD},
    Harness,
};

/// One server for every check, fenced or not: each has keys of its own.
static MARIADB: Shared<MariaDbServer> = Shared::new(MariaDbServer::start);

/// The session timeout is short (see `dlock_testkit::sql::harness`), so
/// that crashed clients let others in quickly (the server's `wait_timeout`
/// is whole seconds).
fn server(fence: &str) -> Harness {
    harness("mysql", &MARIADB.get().url(), fence)
}

/// In a database whose character set is UTF-16: the lock names dlock keeps
/// in its tables are passed to the server's lock functions, which compare
/// names by their bytes.
fn utf16_database() -> Harness {
    static MADE: std::sync::Once = std::sync::Once::new();
    let server = MARIADB.get();
    MADE.call_once(|| {
        server
            .admin(
                "CREATE DATABASE wide CHARACTER SET utf16; \
                 GRANT ALL ON wide.* TO 'dlock'@'127.0.0.1'",
            )
            .expect("a UTF-16 database");
    });
    let url = format!(
        "mysql://dlock:{MARIADB_PASSWORD}@{}/wide",
        server.host_port()
    );
    harness("mysql-utf16", &url, "row")
}

fn harness(name: &str, url: &str, fence: &str) -> Harness {
    dlock_testkit::sql::harness::<MariaDbServer>(name, &format!("{url}?fence={fence}"))
}

mod unfenced {
    use super::server;
    dlock_testkit::conformance_tests!(server("off"));
}

mod row {
    use super::server;
    dlock_testkit::conformance_tests!(server("row"));
}

dlock_testkit::conformance_tests!(suite whole_suite_in_a_utf16_database, utf16_database());
