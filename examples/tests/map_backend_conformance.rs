//! The whole conformance suite against the example backend of
//! `src/map_backend.rs`, run from outside dlock as a third party runs it
//! against its own backend (see "Writing a backend" in
//! `dlock-testkit/README.md`).
//!
//! Every client the harness makes is a new clone of one `MapBackend`: a new
//! client of the same map, as separate processes are clients of one server.
//! Checks of what the backend's `Capabilities` leave out (read-write locks,
//! semaphores) check that asking for them is refused.

use std::sync::Arc;

use dlock_core::backend::DynBackend;
use dlock_examples::map_backend::MapBackend;
use dlock_testkit::Harness;

fn harness() -> Harness {
    let server = MapBackend::new();
    Harness::new("map", move || {
        let client: Arc<dyn DynBackend> = Arc::new(server.clone());
        async move { Ok(client) }
    })
}

dlock_testkit::conformance_tests!(harness());
