//! The whole conformance suite against a real PostgreSQL server: one test
//! per check, each with keys of its own on one server the binary's tests
//! share, and every client a new `PgBackend` with sessions of its own.

use dlock_testkit::{
    fixture::{PostgresServer, Shared},
    sql::harness,
    Harness,
};

/// One server for every check: each has keys of its own.
static POSTGRES: Shared<PostgresServer> = Shared::new(PostgresServer::start);

fn server() -> Harness {
    harness::<PostgresServer>("postgres", &POSTGRES.get().url())
}

dlock_testkit::conformance_tests!(server());
