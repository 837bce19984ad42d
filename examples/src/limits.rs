//! Two shared limits, with the primitives beyond the plain lock:
//!
//! - **A rate-limited worker pool** ([`run_pool`]): workers from several
//!   clients (as separate services would be) call a partner API that
//!   allows `permits` calls at once. Each call takes a permit of one
//!   [`DistSemaphore`]; a worker that crashes mid-call gives its permit
//!   back when its lease ends, not never.
//! - **A config cache** ([`run_config`]): many readers read a
//!   [`DistRwLock`]-protected config at once, and a refresher rewrites it
//!   alone; a waiting refresher keeps new readers out, so a stream of
//!   readers cannot starve it.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock::{DistRwLock, DistSemaphore, LockError, LockOptions, Locker};

/// What the worker pool saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolReport {
    /// API calls made.
    pub calls: usize,
    /// The most calls in flight at once, across every client.
    pub most_at_once: usize,
}

/// Runs `workers` workers per locker, `calls` calls each, every call under
/// one of `permits` permits of `key`, and counts the calls in flight.
///
/// # Errors
///
/// The first worker's error: [`LockError::Unsupported`] on a backend
/// without semaphores, or a lock error.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// use dlock::{BackendExt, MemoryBackend};
///
/// let server = MemoryBackend::new();
/// let clients = vec![server.clone().into_locker(), server.into_locker()];
/// let report = dlock_examples::limits::run_pool(&clients, "partner-api", 3, 4, 5).await?;
/// assert_eq!(report.calls, 2 * 4 * 5);
/// assert!(report.most_at_once <= 3);
/// # Ok(())
/// # }
/// ```
pub async fn run_pool(
    lockers: &[Locker],
    key: &str,
    permits: u32,
    workers: usize,
    calls: usize,
) -> Result<PoolReport, LockError> {
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for locker in lockers {
        for _ in 0..workers {
            let api = DistSemaphore::with_options(
                locker,
                key,
                permits,
                LockOptions::new().wait(Duration::from_secs(30)),
            );
            let (in_flight, most) = (in_flight.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..calls {
                    let permit = api.acquire().await?;
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    // The call to the partner API.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    permit.release().await?;
                }
                Ok::<(), LockError>(())
            }));
        }
    }
    let mut made = 0;
    for task in tasks {
        task.await.expect("a worker panicked")?;
        made += calls;
    }
    Ok(PoolReport {
        calls: made,
        most_at_once: most.load(Ordering::SeqCst),
    })
}

/// The cached config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Bumped by each refresh.
    pub version: u64,
    /// Set to `version` too: a reader that sees them differ saw a refresh
    /// half-way.
    pub checksum: u64,
}

/// What the config cache saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigReport {
    /// Reads made.
    pub reads: usize,
    /// Refreshes made.
    pub refreshes: u64,
    /// Reads that saw a refresh half-way (must be 0).
    pub torn: usize,
}

/// Runs `readers` readers per locker, `reads` reads each, and one
/// refresher that rewrites the config `refreshes` times in two steps with
/// a pause between (a reader inside would see it torn), through each
/// client's [`DistRwLock`] on `key`. The cache here is one value per
/// client: the distributed lock is what keeps every client's readers out
/// of any client's refresh.
///
/// # Errors
///
/// The first error: [`LockError::Unsupported`] on a backend without
/// read-write locks, or a lock error.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// use dlock::{BackendExt, MemoryBackend};
///
/// let server = MemoryBackend::new();
/// let clients = vec![server.clone().into_locker(), server.into_locker()];
/// let report = dlock_examples::limits::run_config(&clients, "config", 3, 10, 4).await?;
/// assert_eq!((report.refreshes, report.torn), (4, 0));
/// # Ok(())
/// # }
/// ```
pub async fn run_config(
    lockers: &[Locker],
    key: &str,
    readers: usize,
    reads: usize,
    refreshes: u64,
) -> Result<ConfigReport, LockError> {
    // One shared config, as a store all clients read and one rewrites.
    let store = Arc::new(std::sync::Mutex::new(Config {
        version: 0,
        checksum: 0,
    }));
    let torn = Arc::new(AtomicUsize::new(0));
    let options = LockOptions::new().wait(Duration::from_secs(30));
    let mut tasks = Vec::new();
    for locker in lockers {
        let cache = Arc::new(DistRwLock::with_options(locker, key, (), options));
        for _ in 0..readers {
            let (cache, store, torn) = (cache.clone(), store.clone(), torn.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..reads {
                    let guard = cache.read().await?;
                    let seen = store.lock().expect("store").clone();
                    if seen.version != seen.checksum {
                        torn.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    drop(guard);
                }
                Ok::<u64, LockError>(0)
            }));
        }
    }
    let refresher = Arc::new(DistRwLock::with_options(&lockers[0], key, (), options));
    let store_w = store.clone();
    tasks.push(tokio::spawn(async move {
        for _ in 0..refreshes {
            let guard = refresher.write().await?;
            let next = store_w.lock().expect("store").version + 1;
            store_w.lock().expect("store").version = next;
            // Half-way: a reader now would see version != checksum.
            tokio::time::sleep(Duration::from_millis(3)).await;
            store_w.lock().expect("store").checksum = next;
            drop(guard);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(refreshes)
    }));
    let mut done = 0;
    for task in tasks {
        done += task.await.expect("a task panicked")?;
    }
    Ok(ConfigReport {
        reads: lockers.len() * readers * reads,
        refreshes: done,
        torn: torn.load(Ordering::SeqCst),
    })
}
