//! The stock demo's claims: nothing oversold with the lock, oversold without.

use dlock_core::{BackendExt, MemoryBackend};
use dlock_examples::stock::{run, StockConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_prevents_overselling() {
    let config = StockConfig::default();
    let locker = MemoryBackend::new().into_locker();
    let report = run(Some(&locker), &config).await.expect("locked run");
    assert_eq!(report.sold, 300, "{report:?}");
    assert_eq!(report.remaining, 0, "{report:?}");
    assert_eq!(report.oversold, 0, "{report:?}");
    assert_eq!(report.lost_updates, 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_the_stock_is_oversold() {
    let report = run(None, &StockConfig::default())
        .await
        .expect("unlocked run");
    assert!(report.oversold > 0, "{report:?}");
    assert!(report.lost_updates > 0, "{report:?}");
}

#[test]
fn the_demo_binary_prints_both_runs() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stock"))
        .args(["--requests", "120", "--stock", "100"])
        .output()
        .expect("run the stock demo");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let with = text
        .lines()
        .find(|l| l.starts_with("with lock"))
        .expect("a locked line");
    assert!(with.contains("oversold    0"), "{text}");
    let without = text
        .lines()
        .find(|l| l.starts_with("without lock"))
        .expect("an unlocked line");
    assert!(!without.contains("oversold    0"), "{text}");
}
