//! `dlock::blocking` from plain threads: across two processes on the file
//! backend, and its refusal inside a runtime.
#![cfg(all(feature = "blocking", feature = "file"))]

use std::{
    io::Write as _,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use dlock::{blocking, LockError, Locker, MemoryBackend};

const CHILD: &str = "DLOCK_BLOCKING_CHILD_DIR";
const THREADS: u32 = 4;
const ROUNDS: u32 = 25;

/// Each of `THREADS` threads, `ROUNDS` times: locks `counter`, logs its
/// start, reads the counter file, sleeps a millisecond, writes it plus one,
/// logs its end.
fn count_under_the_lock(dir: &Path, who: &str) {
    let locker = blocking::connect(&format!("file://{}/locks", dir.display())).unwrap();
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let locker = locker.clone();
            scope.spawn(move || {
                for _ in 0..ROUNDS {
                    let guard = locker.lock("counter").unwrap();
                    let mut log = std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(dir.join("log"))
                        .unwrap();
                    writeln!(log, "start {who}-{thread}").unwrap();
                    let path = dir.join("counter");
                    let n: u32 = std::fs::read_to_string(&path).map_or(0, |s| {
                        s.trim()
                            .parse()
                            .expect("a torn counter: two holders at once")
                    });
                    std::thread::sleep(Duration::from_millis(1));
                    std::fs::write(&path, (n + 1).to_string()).unwrap();
                    writeln!(log, "end {who}-{thread}").unwrap();
                    drop(guard);
                }
            });
        }
    });
}

/// The child process's part of the test below; a no-op when run alone.
#[test]
fn child_counts_under_the_lock() {
    if let Ok(dir) = std::env::var(CHILD) {
        count_under_the_lock(Path::new(&dir), "child");
    }
}

#[test]
fn threads_of_two_processes_exclude_each_other() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("locks")).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_counts_under_the_lock", "--nocapture"])
        .env(CHILD, dir.path())
        .spawn()
        .unwrap();
    count_under_the_lock(dir.path(), "parent");
    assert!(child.wait().unwrap().success(), "the child process failed");

    let total = std::fs::read_to_string(dir.path().join("counter")).unwrap();
    assert_eq!(
        total,
        (2 * THREADS * ROUNDS).to_string(),
        "an increment was lost"
    );
    let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
    let mut inside: Option<&str> = None;
    let mut starts = 0;
    for line in log.lines() {
        match line.split_once(' ').unwrap() {
            ("start", who) => {
                assert_eq!(inside, None, "{who} started inside a hold");
                inside = Some(who);
                starts += 1;
            }
            ("end", who) => assert_eq!(inside.take(), Some(who), "an end without its start"),
            other => panic!("unexpected log line {other:?}"),
        }
    }
    assert_eq!(starts, 2 * THREADS * ROUNDS);
}

/// The private runtime renews a watchdog lease while the thread that holds
/// the lock does something else entirely.
#[test]
fn a_lease_is_renewed_while_the_holding_thread_sleeps() {
    let backend = MemoryBackend::new();
    let make = |backend: MemoryBackend| {
        blocking::Locker::build(move || async move {
            Locker::builder(backend)
                .watchdog_lease(Duration::from_millis(60))
                .build()
        })
        .unwrap()
    };
    let (holder, other) = (make(backend.clone()), make(backend));
    let guard = holder.lock("k").unwrap();
    std::thread::sleep(Duration::from_millis(400));
    assert!(!guard.is_lost());
    assert!(other.try_lock("k").unwrap().is_none(), "the lease ran out");
    drop(guard);
    assert!(
        other.try_lock("k").unwrap().is_some(),
        "a drop did not release"
    );
}

/// Inside a runtime every call is refused with a typed error, and a guard
/// dropped there neither blocks nor panics.
#[test]
fn inside_a_runtime_calls_are_refused_and_drops_do_not_block() {
    let locker = blocking::connect("memory").unwrap();
    let guard = locker.lock("k").unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let started = Instant::now();
    runtime.block_on(async {
        assert!(matches!(
            locker.lock("other"),
            Err(LockError::InsideRuntime)
        ));
        assert!(matches!(
            blocking::connect("memory"),
            Err(LockError::InsideRuntime)
        ));
        drop(guard);
    });
    assert!(started.elapsed() < blocking::DROP_WAIT);
    // Released in the background by the async guard.
    let deadline = Instant::now() + Duration::from_secs(5);
    while locker.try_lock("k").unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the background release never came"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A guard that outlives its locker and is dropped inside another runtime
/// takes the private runtime down with it: the release it leaves on that
/// runtime is still sent.
#[test]
fn the_last_guard_dropped_inside_a_runtime_still_releases() {
    let server = MemoryBackend::new();
    let make = |server: MemoryBackend| {
        blocking::Locker::build(move || async move { Ok(Locker::new(server)) }).unwrap()
    };
    let (holder, other) = (make(server.clone()), make(server));
    let guard = holder.lock("k").unwrap();
    drop(holder);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move { drop(guard) });
    let deadline = Instant::now() + Duration::from_secs(5);
    while other.try_lock("k").unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the release was lost with the runtime"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `list` reads one page per step, through every page, and ends after an
/// error: a listing advanced inside a runtime is refused once, then done.
#[test]
fn a_listing_reads_every_page_and_ends_after_an_error() {
    let locker = blocking::connect("memory").unwrap();
    let guards: Vec<_> = (0..5)
        .map(|i| locker.lock(format!("jobs/{i}")).unwrap())
        .collect();
    let pages: Vec<_> = locker
        .list("jobs/")
        .page_size(2)
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(pages.len(), 3, "{pages:?}");
    let mut keys: Vec<_> = pages
        .concat()
        .iter()
        .map(|held| held.key().name().unwrap().to_owned())
        .collect();
    keys.sort();
    assert_eq!(keys, ["jobs/0", "jobs/1", "jobs/2", "jobs/3", "jobs/4"]);
    let mut listing = locker.list("jobs/").page_size(2);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        assert!(matches!(
            listing.next(),
            Some(Err(LockError::InsideRuntime))
        ));
    });
    assert!(listing.next().is_none(), "a listing went on after an error");
    drop(guards);
}
