//! The metrics of the in-process backend, read back through a debugging
//! recorder (`dlock_testkit::check_metrics`).

use std::sync::Arc;

use dlock_core::{backend::DynBackend, MemoryBackend};
use dlock_testkit::Harness;

#[test]
fn memory_locks_record_their_metrics() {
    let server = MemoryBackend::new();
    let harness = Harness::new("memory", move || {
        let client: Arc<dyn DynBackend> = Arc::new(server.clone());
        async move { Ok(client) }
    });
    dlock_testkit::check_metrics(&harness, true);
}
