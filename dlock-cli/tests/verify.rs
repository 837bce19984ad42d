//! `dlock verify` against every backend, each on a real server the
//! fixtures start: no double grant under pauses, kills and cancels; and
//! the same workload without the lock is caught.
#![cfg(all(
    feature = "file",
    feature = "redis",
    feature = "etcd",
    feature = "zk",
    feature = "postgres",
    feature = "mysql"
))]

use std::{path::Path, process::Output, time::Duration};

use dlock_testkit::fixture::{
    EtcdServer, MariaDbServer, PostgresServer, RedisServer, ZooKeeperServer,
};
use tokio::process::Command;

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

/// Runs `dlock verify` on `url` with `extra` arguments; its output and
/// JSON report.
async fn verify(url: String, json: &Path, extra: &[&str]) -> (Output, serde_json::Value) {
    let mut command = Command::new(DLOCK);
    command
        .args(["verify", "--url", &url, "--processes", "3", "--tasks", "3"])
        .args(["--seed", "7", "--json"])
        .arg(json)
        .args(extra)
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(180), command.output())
        .await
        .unwrap_or_else(|_| panic!("{url}: verify did not finish"))
        .expect("verify ran");
    let report = std::fs::read_to_string(json)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(serde_json::Value::Null);
    (output, report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_no_double_grant_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start().expect("redis");
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start().expect("redis"))
        .collect();
    let etcd = EtcdServer::start().expect("etcd");
    let zk = ZooKeeperServer::start().expect("zookeeper");
    let postgres = PostgresServer::start().expect("postgres");
    let mariadb = MariaDbServer::start().expect("mariadb");
    let redlock = format!(
        "redis+redlock://{}",
        nodes
            .iter()
            .map(RedisServer::host_port)
            .collect::<Vec<_>>()
            .join(",")
    );
    let runs = [
        (
            "file",
            format!("file://{}", dir.path().join("locks").display()),
            "all",
        ),
        ("redis", redis.url(), "all"),
        // Redlock offers mutexes (no semaphore or holder reads).
        ("redlock", redlock, "mutex"),
        ("etcd", format!("etcd://{}/verify", etcd.endpoint()), "all"),
        ("zk", format!("zk://{}/verify", zk.endpoint()), "all"),
        ("postgres", postgres.url(), "all"),
        ("mysql", mariadb.url(), "all"),
    ];
    let mut all = Vec::new();
    for (name, url, primitive) in runs {
        let json = dir.path().join(format!("{name}.json"));
        all.push(tokio::spawn(async move {
            let extra = ["--duration", "20s", "--watchdog-lease", "2s"];
            let (output, report) = verify(
                url,
                &json,
                &[&extra[..], &["--primitive", primitive]].concat(),
            )
            .await;
            (name, output, report)
        }));
    }
    for run in all {
        let (name, output, report) = run.await.unwrap();
        let said = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && report["ok"] == true,
            "{name}: {}\n{said}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let faults = &report["faults"];
        assert!(
            faults["pauses"].as_u64().unwrap_or(0) + faults["kills"].as_u64().unwrap_or(0) > 0,
            "{name}: no fault was injected: {report}"
        );
        // On Redis a pause past the watchdog lease loses the lock, and
        // the holder must see it: the dangerous path ran.
        if name == "redis" {
            assert!(
                report["losses_seen"].as_u64().unwrap_or(0) > 0,
                "{name}: no pause outlived a lease: {report}"
            );
        }
        for primitive in report["primitives"].as_array().expect("primitives") {
            assert!(
                primitive["holds"].as_u64().unwrap_or(0) > 0,
                "{name}: {primitive}"
            );
        }
    }
}

/// Without the lock the same workload overlaps, and verify says so: the
/// checker can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_without_the_lock_reports_overlaps() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().join("locks").display());
    let json = dir.path().join("report.json");
    let (output, report) = verify(
        url,
        &json,
        &[
            "--duration",
            "3s",
            "--watchdog-lease",
            "2s",
            "--no-lock",
            "--faults",
            "cancel",
            "--primitive",
            "mutex,rw,election",
        ],
    )
    .await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert_eq!(report["ok"], false, "{report}");
    // Every primitive overlaps without its lock, elections included.
    for primitive in report["primitives"].as_array().expect("primitives") {
        let violations = primitive["violations"].as_array().expect("violations");
        assert!(!violations.is_empty(), "{primitive}");
    }
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(said.contains("VIOLATION overlap"), "{said}");
}

/// With no `--watchdog-lease`, verify sizes the lease to its run, so that
/// its pauses outlast it: on Redis a paused holder loses its lock and
/// sees it, and every fault asked for (all, by default) happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_with_its_default_lease_pauses_holders_past_it() {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisServer::start().expect("redis");
    let json = dir.path().join("report.json");
    let (output, report) = verify(
        redis.url(),
        &json,
        &["--duration", "20s", "--key", "dlock-verify-defaults"],
    )
    .await;
    let faults = &report["faults"];
    assert!(
        faults["pauses"].as_u64().unwrap_or(0) > 0
            && report["losses_seen"].as_u64().unwrap_or(0) > 0,
        "no pause outlived the default lease: {report}\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(
        output.status.success() && report["ok"] == true,
        "{}\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(report["watchdog_lease_ms"], 2000, "{report}");
}

/// A run in which a fault asked for never happened checked nothing under
/// that fault: verify says so and fails, unless `--allow-quiet`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_fails_a_run_whose_faults_never_happened() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().join("locks").display());
    // A second leaves no room for a pause past the lease.
    let quiet = [
        "--duration",
        "1s",
        "--faults",
        "pause",
        "--primitive",
        "mutex",
    ];
    let (strict_json, allowed_json) = (
        dir.path().join("strict.json"),
        dir.path().join("allowed.json"),
    );
    let allow = [
        &quiet[..],
        &["--allow-quiet", "--key", "dlock-verify-allowed"],
    ]
    .concat();
    let (strict, allowed) = tokio::join!(
        verify(url.clone(), &strict_json, &quiet),
        verify(url, &allowed_json, &allow),
    );
    let (output, report) = strict;
    let said = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{said}\n{report}");
    assert!(said.contains("no pause happened"), "{said}");
    assert_eq!(report["ok"], false, "{report}");
    let (output, report) = allowed;
    assert!(
        output.status.success() && report["ok"] == true,
        "{output:?}\n{report}"
    );
}
