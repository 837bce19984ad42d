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
