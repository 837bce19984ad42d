//! `dlock list` and `dlock status` as an operator uses them, on the file
//! backend: who holds what, with the holders' notes, page after page.
#![cfg(feature = "file")]

use std::{process::Output, time::Duration};

use tokio::process::Command;

mod common;

use common::dlock;

/// Runs `command` to its end, within 30 s, and checks it exited 0.
async fn finish(command: &mut Command) -> Output {
    let output = common::finish(command, Duration::from_secs(30)).await;
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    output
}

/// `list --json`'s objects, one a line.
async fn listed(url: &str, prefix: &str) -> Vec<serde_json::Value> {
    let output = finish(dlock(url).args(["list", "--json", "--prefix", prefix])).await;
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// The locks under the prefix show with their notes (set, or the taking
/// process's `HOSTNAME:PID`), in a table and as JSON; a released one is
/// gone; `status` shows the note too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_status_show_who_holds_what() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let locker = dlock::connect(&url).await.expect("connect");
    let noted = dlock::LockOptions::new().holder_note("importer, batch 12");
    let a = locker.lock_with("jobs/a", noted).await.expect("lock a");
    let _other = locker.lock("other").await.expect("lock other");
    // A lock `dlock run` holds carries its process's note.
    let mut run = dlock(&url)
        .args(["run", "--key", "jobs/b", "--", "sleep", "30"])
        .spawn()
        .expect("spawn run");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let run_note = format!("{}:{}", host.trim(), run.id().unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let locks = loop {
        let locks = listed(&url, "jobs/").await;
        if locks.len() == 2 || tokio::time::Instant::now() > deadline {
            break locks;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let shown: Vec<_> = locks
        .iter()
        .map(|l| {
            (
                l["key"].as_str().unwrap(),
                l["holders"][0]["note"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            ("jobs/a", "importer, batch 12"),
            ("jobs/b", run_note.as_str())
        ]
    );
    assert_eq!(locks[0]["holders"][0]["mode"], "exclusive");
    assert_eq!(locks[0]["holders"][0]["fence"].as_u64(), a.fencing_token());

    let table = finish(dlock(&url).args(["list", "--prefix", "jobs/"])).await;
    let table = String::from_utf8(table.stdout).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(
        lines[0].contains("KEY") && lines[0].contains("NOTE"),
        "{table}"
    );
    assert!(
        lines[1].contains("jobs/a") && lines[1].contains("importer, batch 12"),
        "{table}"
    );
    assert!(
        lines[2].contains("jobs/b") && lines[2].contains(&run_note),
        "{table}"
    );

    let status = finish(dlock(&url).args(["status", "--key", "jobs/a", "--json"])).await;
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["note"], "importer, batch 12", "{status}");
    assert_eq!(status["mode"], "exclusive", "{status}");
    let text = finish(dlock(&url).args(["status", "--key", "jobs/a"])).await;
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("note: importer, batch 12"), "{text}");

    a.release().await.expect("release");
    let locks = listed(&url, "jobs/").await;
    assert_eq!(locks.len(), 1, "{locks:?}");
    assert_eq!(locks[0]["key"], "jobs/b");
    run.kill().await.unwrap();
}

/// More locks than a page: every one is listed, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_through_every_held_lock() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let locker = dlock::connect(&url).await.expect("connect");
    let count = dlock::backend::DEFAULT_LIST_PAGE * 2 + 10;
    let mut guards = Vec::new();
    for i in 0..count {
        guards.push(locker.lock(format!("many/{i:04}")).await.expect("lock"));
    }
    let locks = listed(&url, "many/").await;
    let keys: Vec<_> = locks
        .iter()
        .map(|l| l["key"].as_str().unwrap().to_owned())
        .collect();
    let wanted: Vec<_> = (0..count).map(|i| format!("many/{i:04}")).collect();
    assert_eq!(keys, wanted);
}

/// Keys, notes and proclaimed values come from whoever took the lock:
/// their control characters show escaped, never reach the terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_keys_notes_and_values_show_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let locker = dlock::connect(&url).await.expect("connect");
    let noted = dlock::LockOptions::new().holder_note("n\x1b[2Jote");
    let _held = locker
        .lock_with("ctl/a\x1b[31mred\nfake row", noted)
        .await
        .expect("lock");
    let table = finish(dlock(&url).args(["list", "--prefix", "ctl/"])).await;
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(!table.contains('\x1b'), "{table:?}");
    assert_eq!(table.lines().count(), 2, "{table}");
    assert!(
        table.contains(r"ctl/a\u{1b}[31mred\nfake row") && table.contains(r"n\u{1b}[2Jote"),
        "{table}"
    );

    let election = locker.elect("ctl").expect("elect");
    tokio::time::timeout(Duration::from_secs(10), election.leading())
        .await
        .expect("led in time")
        .expect("leads");
    assert!(election
        .proclaim("v\x1b]0;title\x07")
        .await
        .expect("proclaim"));
    let text = finish(dlock(&url).args(["status", "--election", "--key", "ctl"])).await;
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(!text.contains('\x1b') && !text.contains('\x07'), "{text:?}");
    assert!(text.contains(r"value: v\u{1b}]0;title\u{7}"), "{text}");
}

/// `status --election` shows the leader as `status` shows a holder: with
/// its note (the `dlock elect` process's `HOSTNAME:PID`), mode and age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_an_election_shows_the_leaders_note_mode_and_age() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let mut elect = dlock(&url)
        .args([
            "elect", "--key", "sched", "--value", "10.0.0.7", "--", "sleep", "30",
        ])
        .spawn()
        .expect("spawn elect");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let note = format!("{}:{}", host.trim(), elect.id().unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        let mut status = dlock(&url);
        status.args(["status", "--election", "--key", "sched", "--json"]);
        let output = tokio::time::timeout(Duration::from_secs(30), status.output())
            .await
            .expect("dlock finished in time")
            .expect("dlock ran");
        let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        if status["value"] == "10.0.0.7" || tokio::time::Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status["held"], true, "{status}");
    assert_eq!(status["value"], "10.0.0.7", "{status}");
    assert_eq!(status["note"], note.as_str(), "{status}");
    assert_eq!(status["mode"], "exclusive", "{status}");
    assert!(status["age_ms"].is_u64(), "{status}");
    assert!(status["fence"].is_u64(), "{status}");
    elect.kill().await.unwrap();
}

/// A page that fails after others were read: the table still shows the
/// locks read, then the error, with the failure's exit code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_page_keeps_the_rows_read_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let locker = dlock::connect(&url).await.expect("connect");
    let count = dlock::backend::DEFAULT_LIST_PAGE + 5;
    let mut guards = Vec::new();
    for i in 0..count {
        guards.push(locker.lock(format!("many/{i:04}")).await.expect("lock"));
    }
    // The last key's fence record, damaged: its page cannot be read.
    let fence = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.to_string_lossy()
                .ends_with(&format!("{:04}.lock-fence", count - 1))
        })
        .expect("the last key's fence file");
    std::fs::write(&fence, b"\xffnot a fence record").unwrap();
    let mut list = dlock(&url);
    list.args(["list", "--prefix", "many/"]);
    let output = tokio::time::timeout(Duration::from_secs(30), list.output())
        .await
        .expect("dlock finished in time")
        .expect("dlock ran");
    // 69: the lock server (here, a damaged lock file) failed.
    assert_eq!(output.status.code(), Some(69), "{output:?}");
    let table = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        table.lines().count(),
        dlock::backend::DEFAULT_LIST_PAGE + 1,
        "the first page's rows and the header: {table}"
    );
    assert!(table.contains("many/0000"), "{table}");
    assert!(!output.stderr.is_empty(), "no error told: {output:?}");
}
