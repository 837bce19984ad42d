//! What dlock traces. Alone in its test binary: tracing caches which
//! callsites are enabled process-wide, so tests running beside it without a
//! subscriber would make it flaky.

use std::time::Duration;

use dlock_core::{BackendExt, LockOptions, MemoryBackend};

#[test]
fn acquire_release_and_loss_are_traced() {
    let captured = dlock_testkit::CapturedLog::default();
    captured.block_on(tracing::Level::DEBUG, async {
        let locker = MemoryBackend::new().into_locker();
        let g = locker.lock("traced:key").await.unwrap();
        g.release().await.unwrap();
        let g = locker
            .lock_with(
                "traced:lost",
                LockOptions::new().lease(Duration::from_millis(20)),
            )
            .await
            .unwrap();
        g.lost().await;
    });
    let text = captured.text();
    for needle in [
        "dlock.acquire",
        "key=traced:key",
        "backend=\"memory\"",
        "waited_us=",
        "fence=",
        "dlock.hold",
        "dlock lock released",
        "dlock lock lost",
    ] {
        assert!(text.contains(needle), "`{needle}` not traced in:\n{text}");
    }
}

/// With `trace_keys(false)`, no span or event shows the key: `(hidden)`
/// stands in every place one would.
#[test]
fn keys_can_be_kept_out_of_traces() {
    let captured = dlock_testkit::CapturedLog::default();
    captured.block_on(tracing::Level::TRACE, async {
        let locker = dlock_core::LockerBuilder::from_arc(std::sync::Arc::new(MemoryBackend::new()))
            .trace_keys(false)
            .build()
            .unwrap();
        let g = locker.lock("user:ann@example.com").await.unwrap();
        let again = g.scope(locker.lock("user:ann@example.com")).await.unwrap();
        drop(again);
        g.release().await.unwrap();
        let g = locker
            .lock_with(
                "user:bob@example.com",
                LockOptions::new().lease(Duration::from_millis(20)),
            )
            .await
            .unwrap();
        g.lost().await;
    });
    let text = captured.text();
    for needle in [
        "dlock.acquire",
        "dlock.hold",
        "dlock lock lost",
        "key=(hidden)",
    ] {
        assert!(text.contains(needle), "`{needle}` not traced in:\n{text}");
    }
    assert!(!text.contains("example.com"), "a key was traced:\n{text}");
}

/// An election's own traces (here: a win lost before its first write)
/// hide the key too.
#[test]
fn election_traces_hide_keys_too() {
    let captured = dlock_testkit::CapturedLog::default();
    captured.block_on(tracing::Level::TRACE, async {
        let faulty = dlock_testkit::CountingBackend::new(std::sync::Arc::new(MemoryBackend::new()))
            .release_at_first_proclaim();
        let locker = dlock_core::Locker::builder(faulty)
            .trace_keys(false)
            .build()
            .unwrap();
        let election = locker.elect("carol@example.com").unwrap();
        election.leading().await.unwrap();
        election.resign().await.unwrap();
    });
    let text = captured.text();
    assert!(
        text.contains("the lock was lost as it was won"),
        "the election's warning was not traced:\n{text}"
    );
    assert!(!text.contains("example.com"), "a key was traced:\n{text}");
}
