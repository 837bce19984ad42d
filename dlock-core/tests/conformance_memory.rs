//! The whole conformance suite against `MemoryBackend`: every client is a
//! clone of one in-process server, as processes share one Redis.

use std::sync::Arc;

use dlock_core::{backend::DynBackend, MemoryBackend};
use dlock_testkit::Harness;

fn harness() -> Harness {
    let server = MemoryBackend::new();
    Harness::new("memory", move || {
        let client: Arc<dyn DynBackend> = Arc::new(server.clone());
        async move { Ok(client) }
    })
    .lists()
}

dlock_testkit::conformance_tests!(harness());
