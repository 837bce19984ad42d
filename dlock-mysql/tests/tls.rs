//! MySQL over TLS (the `tls` feature, `ssl-mode=VERIFY_IDENTITY`), against
//! a real MariaDB server whose user may log in over TLS only: the whole
//! conformance suite, and typed errors for a connection without TLS or
//! with a server the client cannot trust (see `dlock_testkit::sql`). The
//! certificates are made in the test.
#![cfg(feature = "tls")]

dlock_testkit::sql_tests!(tls dlock_testkit::fixture::MariaDbServer);
