//! Elections on the in-process backend, with a fault injected between a
//! win and its first write (`CountingBackend::release_at_first_proclaim`).

use std::sync::Arc;

use dlock_core::{Locker, MemoryBackend};
use dlock_testkit::CountingBackend;

/// A win whose lock is gone by the time the leader's value is written
/// (the write answers "not held") is never announced: the candidate
/// campaigns again, and the term it announces is one it holds.
#[tokio::test]
async fn a_win_lost_before_its_first_write_is_not_announced() {
    let memory = MemoryBackend::new();
    let faulty =
        Arc::new(CountingBackend::new(Arc::new(memory.clone())).release_at_first_proclaim());
    let candidate = Locker::from_arc(faulty.clone());
    let other = Locker::new(memory);
    let election = candidate.elect("lost-at-once").unwrap();
    let term = tokio::time::timeout(std::time::Duration::from_secs(5), election.leading())
        .await
        .expect("a leader within 5 s")
        .unwrap();
    assert!(faulty.released_at_proclaim(), "the fault was not injected");
    let taken = other.try_lock("election:lost-at-once").await.unwrap();
    assert!(
        taken.is_none(),
        "term {term} was announced while nobody held the election's lock"
    );
    election.resign().await.unwrap();
}
