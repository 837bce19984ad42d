//! The whole conformance suite against `FileBackend`: every client is a
//! new `FileBackend` on one temporary directory, as processes of one
//! machine would open it.

use std::sync::Arc;

use dlock_core::backend::DynBackend;
use dlock_file::FileBackend;
use dlock_testkit::Harness;

fn harness() -> Harness {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().to_path_buf();
    Harness::new("file", move || {
        let client = FileBackend::open(&path).map(|b| Arc::new(b) as Arc<dyn DynBackend>);
        async move { client }
    })
    // A client's locks are unlocked when its last clone is dropped, as
    // when its process dies: nothing waits for a lease.
    .disconnect_releases()
    .lists()
    .keep_alive(dir)
}

dlock_testkit::conformance_tests!(harness());
