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
            // Written whole again after the zeros: one record, the
            // fence and the grant's note.
            _ => assert_eq!(
                std::fs::read_to_string(&counters[0]).unwrap(),
                format!("{last:020}\n{}", dlock_core::backend::HolderNote::process()),
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

/// A wait dropped while it blocks in `flock` on its thread, or timed out
/// there, leaves nothing held: once the holder releases, another client
/// takes the key at once, and the waiter's client holds nothing.
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
    let short = dlock_core::LockOptions::new().wait(Duration::from_millis(100));
    let timed_out = waiter
        .clone()
        .into_locker()
        .lock_with("waited", short)
        .await;
    assert!(matches!(timed_out, Err(LockError::Timeout { .. })));
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

/// `holder` (what `dlock status` asks) looks without locking: a client
/// trying a free key at the same moment always gets it. A probe that took
/// a shared `flock` on the key's file for a moment made such a try fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_lookup_never_makes_a_try_on_a_free_key_fail() {
    let dir = tempfile::tempdir().unwrap();
    let (asker, trier) = (locker(dir.path()), locker(dir.path()));
    // Made once, so that every try below is of an existing file.
    trier.lock("k").await.unwrap().release().await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looking = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut looks = 0_u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && looks < 1_000_000 {
                asker.holder("k").await.unwrap();
                looks += 1;
            }
            looks
        }
    });
    let mut refused = 0;
    for _ in 0..10_000 {
        match trier.try_lock("k").await.unwrap() {
            Some(guard) => guard.release().await.unwrap(),
            None => refused += 1,
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let looks = looking.await.unwrap();
    assert!(
        looks > 100,
        "the lookups never overlapped the tries ({looks})"
    );
    assert_eq!(
        refused, 0,
        "{refused} of 10000 tries of a free key were refused"
    );
}

/// In a sticky directory every user may write to (`/run/lock`), a lock
/// file is made writable by every user whatever the umask, so that other
/// users' clients can lock it and move its fence.
#[tokio::test]
async fn lock_files_in_a_shared_sticky_directory_are_every_users() {
    use std::os::unix::fs::PermissionsExt as _;
    let root = tempfile::tempdir().unwrap();
    let shared = root.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let private = root.path().join("private");
    let url = |dir: &Path| format!("file://{}?prefix=app.", dir.display());
    for dir in [&shared, &private] {
        let backend = FileBackend::connect(&url(dir)).await.unwrap();
        backend
            .into_locker()
            .lock("k")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let mode =
        |path: std::path::PathBuf| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    for file in ["app.k.lock", "app.k.lock-fence"] {
        assert_eq!(mode(shared.join(file)), 0o666, "{file}");
        assert_eq!(
            mode(private.join(file)) & 0o002,
            0,
            "{file} in a private directory"
        );
    }
}

/// A held lock whose file is deleted (the user who made it in a shared
/// directory can, the sticky bit notwithstanding) excludes nobody: the
/// next client makes and locks a new file. The holder's guard is told at
/// its next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_lock_file_was_deleted_is_told_it_lost_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let holder = Locker::builder(FileBackend::open(dir.path()).unwrap())
        .watchdog_lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let held = holder.lock("k").await.unwrap();
    std::fs::remove_file(dir.path().join("k.lock")).unwrap();
    let other = locker(dir.path());
    let taken = other.try_lock("k").await.unwrap();
    assert!(taken.is_some(), "the deleted file still excluded");
    let told = tokio::time::timeout(Duration::from_secs(5), held.lost()).await;
    assert!(
        told.is_ok(),
        "the holder was never told its lock file was deleted"
    );
}
