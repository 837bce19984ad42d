//! The stock scenario: many concurrent purchase requests against one stock
//! counter that lives outside the lock service (a database, here simulated
//! with read and write latency). Each request reads the stock, thinks, and
//! writes it back: a read-modify-write that oversells unless a lock makes it
//! exclusive.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use dlock_core::{LockError, LockOptions, Locker};
use tokio::time::Instant;

/// How a run is set up.
#[derive(Debug, Clone)]
pub struct StockConfig {
    /// Units in stock at the start.
    pub stock: u64,
    /// Concurrent purchase requests, one unit each.
    pub requests: usize,
    /// Time between reading the stock and writing it back.
    pub think: Duration,
    /// The lock key.
    pub key: String,
}

impl Default for StockConfig {
    fn default() -> Self {
        StockConfig {
            stock: 300,
            requests: 500,
            think: Duration::from_millis(1),
            key: "stock:42".to_owned(),
        }
    }
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct StockReport {
    /// Units in stock at the start.
    pub initial: u64,
    /// Purchases that succeeded.
    pub sold: u64,
    /// Units the store says are left.
    pub remaining: u64,
    /// Purchases beyond the stock there was: `sold - initial`, if positive.
    pub oversold: u64,
    /// Sales the stock count does not reflect: `sold + remaining - initial`.
    pub lost_updates: u64,
    /// Wall time of the whole run.
    pub elapsed: Duration,
    /// Median time a request waited for the lock.
    pub wait_p50: Duration,
    /// Longest time a request waited for the lock.
    pub wait_max: Duration,
}

/// The stock store, outside the lock service: reads and writes are separate
/// round trips, as with a database row read and later updated.
#[derive(Debug)]
struct Store {
    stock: Mutex<u64>,
}

impl Store {
    async fn read(&self) -> u64 {
        tokio::task::yield_now().await;
        *self.stock.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn write(&self, value: u64) {
        tokio::task::yield_now().await;
        *self.stock.lock().unwrap_or_else(|e| e.into_inner()) = value;
    }
}

/// Runs `config.requests` concurrent purchases, each under `locker`'s lock
/// on `config.key`, or with no lock at all when `locker` is `None`.
///
/// # Errors
///
/// The first lock error any request met.
pub async fn run(locker: Option<&Locker>, config: &StockConfig) -> Result<StockReport, LockError> {
    let store = Arc::new(Store {
        stock: Mutex::new(config.stock),
    });
    let sold = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut requests = Vec::with_capacity(config.requests);
    for _ in 0..config.requests {
        let (store, sold, locker) = (store.clone(), sold.clone(), locker.cloned());
        let (key, think) = (config.key.clone(), config.think);
        requests.push(tokio::spawn(async move {
            let asked = Instant::now();
            let guard = match &locker {
                Some(locker) => Some(
                    locker
                        .lock_with(&key, LockOptions::new().wait(Duration::from_secs(120)))
                        .await?,
                ),
                None => None,
            };
            let waited = asked.elapsed();
            let left = store.read().await;
            tokio::time::sleep(think).await;
            if left > 0 {
                store.write(left - 1).await;
                sold.fetch_add(1, Ordering::SeqCst);
            }
            if let Some(guard) = guard {
                guard.release().await?;
            }
            Ok::<_, LockError>(waited)
        }));
    }
    let mut waits = Vec::with_capacity(requests.len());
    for r in requests {
        let waited = r.await.map_err(|e| LockError::backend("stock-demo", e))??;
        waits.push(waited);
    }
    waits.sort();
    let sold = sold.load(Ordering::SeqCst);
    let remaining = store.read().await;
    Ok(StockReport {
        initial: config.stock,
        sold,
        remaining,
        oversold: sold.saturating_sub(config.stock),
        lost_updates: (sold + remaining).saturating_sub(config.stock),
        elapsed: start.elapsed(),
        wait_p50: waits.get(waits.len() / 2).copied().unwrap_or_default(),
        wait_max: waits.last().copied().unwrap_or_default(),
    })
}
