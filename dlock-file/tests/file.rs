//! What the conformance suite cannot see from one process: fences across
//! clients and reopens, URLs through `dlock::connect`, and a dropped wait
//! on a real thread. (A holder killed with SIGKILL is in the testkit's
//! fault tests, `file_holder_killed`, through its helper process.)

use std::{path::Path, time::Duration};

use dlock_core::{BackendExt, InvalidReason, LockError, Locker};
use dlock_file::FileBackend;

fn locker(dir: &Path) -> Locker {
    FileBackend::open(dir)
        .expect("open the directory")
        .into_locker()
}

/// Fences of a key's plain lock rise across two clients of one directory,
/// and across a reopen of the directory (a restart).
#[tokio::test]
async fn fences_rise_across_clients_and_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (locker(dir.path()), locker(dir.path()));
    let mut last = 0;
    for (round, locker) in [&a, &b, &a, &b].into_iter().enumerate() {
        let guard = locker.lock("fenced").await.unwrap();
        let fence = guard.fencing_token().unwrap();
        assert!(fence > last, "round {round}: fence {fence} after {last}");
        last = fence;
        guard.release().await.unwrap();
    }
    drop((a, b));
    let reopened = locker(dir.path());
    let guard = reopened.lock("fenced").await.unwrap();
    assert!(
        guard.fencing_token().unwrap() > last,
        "a reopen started the fences again"
    );
}

/// A fence counter set back (its last writes lost in a power cut: the
/// counter is not `fsync`ed), lost altogether, or left holding zeros (a
/// new file whose blocks were never written) is overtaken by the clock:
/// the next fence is still above every earlier one, and the key is not
/// refused.
#[tokio::test]
async fn fences_rise_after_the_counter_is_set_back_or_lost() {
    let dir = tempfile::tempdir().unwrap();
    let locker = locker(dir.path());
    let mut last = 0;
    for round in 0..5 {
        let guard = locker.lock("set-back").await.unwrap();
        let fence = guard.fencing_token().unwrap();
        assert!(fence > last, "round {round}: fence {fence} after {last}");
        last = fence;
        guard.release().await.unwrap();
        let counters: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with("set-back.lock-fence"))
            .collect();
        assert_eq!(counters.len(), 1, "one counter for the key");
        match round {
            // Set back to an early value, as a lost write leaves it.
            0 => std::fs::write(&counters[0], format!("{:020}\n", 1)).unwrap(),
            // Gone, as after a restart that lost the new file.
            1 => std::fs::remove_file(&counters[0]).unwrap(),
            // A block of zeros.
            2 => std::fs::write(&counters[0], [0u8; 4096]).unwrap(),
            // Written whole again after the zeros: one record.
            _ => assert_eq!(
                std::fs::read_to_string(&counters[0]).unwrap().len(),
                21,
                "round {round}: the counter is not one record"
            ),
        }
    }
}

/// `dlock::connect` takes `file:///dir` (through the testkit's `file`
/// feature), and refuses a host, an empty path, parameters and a path that
/// is a file, with typed errors.
#[tokio::test]
async fn file_urls_connect_and_bad_ones_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}/locks", dir.path().display());
    let backend = dlock_testkit::connect(&url).await.unwrap();
    assert_eq!(backend.name(), "file");
    assert!(
        dir.path().join("locks").is_dir(),
        "the directory was not made"
    );
    for bad in [
        "file://host/tmp/x".to_owned(),
        "file:///".to_owned(),
        format!("{url}?mode=0600"),
    ] {
        assert!(
            matches!(
                dlock_testkit::connect(&bad).await,
                Err(LockError::InvalidOptions {
                    reason: InvalidReason::Url { .. } | InvalidReason::UnknownParameter { .. }
                })
            ),
            "{bad}"
        );
    }
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    assert!(matches!(
        FileBackend::open(&file),
        Err(LockError::InvalidOptions {
            reason: InvalidReason::Other(_)
        })
    ));
}

/// A wait dropped while it blocks in `flock` on its thread leaves nothing
/// held: once the holder releases, another client takes the key at once,
/// and the waiter's client holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_wait_leaves_nothing_held() {
    let dir = tempfile::tempdir().unwrap();
    let holder = locker(dir.path());
    let waiter = FileBackend::open(dir.path()).unwrap();
    let guard = holder.lock("waited").await.unwrap();
    let waiting = tokio::spawn({
        let waiter = waiter.clone().into_locker();
        async move { waiter.lock("waited").await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    guard.release().await.unwrap();
    let next = locker(dir.path()).try_lock("waited").await.unwrap();
    assert!(next.is_some(), "the dropped wait kept the lock");
    drop(next);
    // Its thread took the lock for a moment and let it go.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(waiter.held(), 0);
    let again = locker(dir.path()).try_lock("waited").await.unwrap();
    assert!(again.is_some(), "the dropped wait took the lock later");
}
