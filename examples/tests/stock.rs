//! The stock demo's claims, in one process and across processes on real
//! servers: nothing oversold with the lock, oversold without it.

use std::process::{Command, Output};

use dlock::{BackendExt, MemoryBackend};
use dlock_examples::stock::{run, StockConfig};
use dlock_testkit::fixture::{EtcdServer, RedisServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_prevents_overselling() {
    let config = StockConfig::default();
    let locker = MemoryBackend::new().into_locker();
    let report = run(Some(&locker), &config).await.expect("locked run");
    assert_eq!(report.sold, 300, "{report:?}");
    assert_eq!(report.remaining, 0, "{report:?}");
    assert_eq!(report.oversold, 0, "{report:?}");
    assert_eq!(report.lost_updates, 0, "{report:?}");
    assert_eq!(report.waits.len(), 500, "one wait per request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_the_stock_is_oversold() {
    let report = run(None, &StockConfig::default())
        .await
        .expect("unlocked run");
    assert!(report.oversold > 0, "{report:?}");
    assert!(report.lost_updates > 0, "{report:?}");
}

fn demo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stock"))
        .args(args)
        .output()
        .expect("run the stock demo")
}

/// `(sold, remaining, oversold, lost updates)` from the line starting
/// with `label`.
fn numbers(stdout: &str, label: &str) -> (u64, u64, u64, u64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{stdout}"));
    let after = |name: &str| -> u64 {
        let rest = &line[line
            .find(name)
            .unwrap_or_else(|| panic!("no {name} in `{line}`"))
            + name.len()..];
        rest.split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no number after {name} in `{line}`"))
    };
    (
        after(" sold "),
        after("remaining "),
        after("oversold "),
        after("lost updates "),
    )
}

fn check_both_runs(out: &Output, stock: u64) {
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let (sold, remaining, oversold, lost) = numbers(&text, "with lock");
    assert_eq!(
        (sold, remaining, oversold, lost),
        (stock, 0, 0, 0),
        "{text}"
    );
    let (_, _, oversold, lost) = numbers(&text, "without lock");
    assert!(
        oversold > 0 || lost > 0,
        "no oversell without the lock?\n{text}"
    );
}

#[test]
fn the_demo_binary_prints_both_runs() {
    let out = demo(&["--requests", "120", "--stock", "100"]);
    check_both_runs(&out, 100);
}

#[test]
fn several_processes_share_the_stock_through_redis() {
    let server = RedisServer::start().expect("redis-server");
    let out = demo(&["--processes", "3", "--backend", &server.url()]);
    check_both_runs(&out, 300);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("in 3 processes"),
        "{out:?}"
    );
}

/// Two processes selling a stock of 120 to 200 requests through `url`.
fn two_processes_share_the_stock(url: &str) {
    let out = demo(&[
        "--processes",
        "2",
        "--requests",
        "200",
        "--stock",
        "120",
        "--backend",
        url,
    ]);
    check_both_runs(&out, 120);
    // The output names the backend, never with its password.
    let password = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .and_then(|(user_info, _)| user_info.split_once(':'))
        .map(|(_, password)| password);
    if let Some(password) = password.filter(|p| !p.is_empty()) {
        for shown in [&out.stdout, &out.stderr] {
            let shown = String::from_utf8_lossy(shown);
            assert!(!shown.contains(password), "the password is shown: {shown}");
        }
    }
}

#[test]
fn several_processes_share_the_stock_through_etcd() {
    let server = EtcdServer::start().expect("etcd");
    two_processes_share_the_stock(&format!("etcd://{}/stock-demo", server.endpoint()));
}

#[test]
#[cfg(feature = "postgres")]
fn several_processes_share_the_stock_through_postgres() {
    let server = dlock_testkit::fixture::PostgresServer::start().expect("postgres");
    two_processes_share_the_stock(&server.url());
}

#[test]
#[cfg(feature = "mysql")]
fn several_processes_share_the_stock_through_mysql() {
    let server = dlock_testkit::fixture::MariaDbServer::start().expect("mariadb");
    two_processes_share_the_stock(&server.url());
}

#[test]
fn processes_without_a_lock_server_are_refused_with_a_reason() {
    let out = demo(&["--processes", "2"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs a server backend"), "{err}");
}

#[test]
fn a_bad_backend_url_is_a_clear_error() {
    let out = demo(&["--backend", "mongodb://localhost"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("names no backend"), "{err}");
}
