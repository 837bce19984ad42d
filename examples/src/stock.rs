//! The stock scenario: many concurrent purchase requests against one stock
//! counter that lives outside the lock service (a database row, here a
//! value in memory or a file several processes share). Each request reads
//! the stock, thinks, and writes it back: a read-modify-write that
//! oversells unless a lock makes it exclusive.
//!
//! The request handler is [`buy`], an ordinary async fn under
//! `#[distributed_lock]`; [`buy_unlocked`] is the same body without it.

use std::{
    io,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use dlock::{distributed_lock, LockError, Locker};
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
    /// The item bought; the lock key is `stock:{item}`.
    pub item: String,
}

impl Default for StockConfig {
    fn default() -> Self {
        StockConfig {
            stock: 300,
            requests: 500,
            think: Duration::from_millis(1),
            item: "42".to_owned(),
        }
    }
}

/// What a run did.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use dlock_examples::stock::StockReport;
///
/// let waits = vec![Duration::from_millis(3), Duration::from_millis(1), Duration::from_millis(2)];
/// let report = StockReport::new(300, 310, 0, Duration::from_secs(1), waits);
/// assert_eq!((report.oversold, report.lost_updates), (10, 10));
/// assert_eq!(report.wait_p50(), Duration::from_millis(2));
/// assert_eq!(report.wait_max(), Duration::from_millis(3));
/// ```
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
    /// How long each request waited before its handler body ran.
    pub waits: Vec<Duration>,
}

impl StockReport {
    /// A report from totals: units sold, the store's count at the end.
    pub fn new(
        initial: u64,
        sold: u64,
        remaining: u64,
        elapsed: Duration,
        mut waits: Vec<Duration>,
    ) -> Self {
        waits.sort();
        StockReport {
            initial,
            sold,
            remaining,
            oversold: sold.saturating_sub(initial),
            lost_updates: (sold + remaining).saturating_sub(initial),
            elapsed,
            waits,
        }
    }

    /// The median wait.
    pub fn wait_p50(&self) -> Duration {
        self.waits
            .get(self.waits.len() / 2)
            .copied()
            .unwrap_or_default()
    }

    /// The longest wait.
    pub fn wait_max(&self) -> Duration {
        self.waits.last().copied().unwrap_or_default()
    }
}

/// A request that could not be served.
#[derive(Debug, thiserror::Error)]
pub enum StockError {
    /// The lock could not be taken (the wait ran out, the server failed).
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The stock store could not be read or written.
    #[error("stock store: {0}")]
    Store(#[from] io::Error),
    /// A request's task panicked.
    #[error("a request panicked: {0}")]
    Panicked(String),
}

/// The stock, outside the lock service: reads and writes are separate round
/// trips, as with a database row read and later updated.
///
/// # Examples
///
/// ```
/// use dlock_examples::stock::Store;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> std::io::Result<()> {
/// let dir = tempfile::tempdir()?;
/// let store = Store::create_file(&dir.path().join("stock"), 300).await?;
/// store.write(store.read().await? - 1).await?;
/// assert_eq!(store.read().await?, 299);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub enum Store {
    /// A value in this process.
    Memory(Mutex<u64>),
    /// A file several processes share; writes replace it whole (write a
    /// temporary file, rename), so a read never sees half a number.
    File(PathBuf),
}

impl Store {
    /// A store in this process holding `stock`.
    pub fn in_memory(stock: u64) -> Store {
        Store::Memory(Mutex::new(stock))
    }

    /// A store in the file `path`, created holding `stock`.
    ///
    /// # Errors
    ///
    /// The I/O error if the file cannot be written.
    pub async fn create_file(path: &Path, stock: u64) -> io::Result<Store> {
        let store = Store::File(path.to_owned());
        store.write(stock).await?;
        Ok(store)
    }

    /// Reads the stock.
    ///
    /// # Errors
    ///
    /// The I/O error, or `InvalidData` if the file does not hold a number.
    pub async fn read(&self) -> io::Result<u64> {
        match self {
            Store::Memory(stock) => {
                tokio::task::yield_now().await;
                Ok(*stock.lock().unwrap_or_else(|e| e.into_inner()))
            }
            Store::File(path) => {
                let text = tokio::fs::read_to_string(path).await?;
                text.trim().parse().map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{}: `{text}`", path.display()),
                    )
                })
            }
        }
    }

    /// Writes the stock.
    ///
    /// # Errors
    ///
    /// The I/O error.
    pub async fn write(&self, value: u64) -> io::Result<()> {
        match self {
            Store::Memory(stock) => {
                tokio::task::yield_now().await;
                *stock.lock().unwrap_or_else(|e| e.into_inner()) = value;
                Ok(())
            }
            Store::File(path) => {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                let temporary = path.with_extension(format!(
                    "{}-{}.tmp",
                    std::process::id(),
                    NEXT.fetch_add(1, Ordering::Relaxed)
                ));
                tokio::fs::write(&temporary, value.to_string()).await?;
                tokio::fs::rename(&temporary, path).await
            }
        }
    }
}

/// One served purchase request.
#[derive(Debug, Clone, Copy)]
pub struct Purchase {
    /// Whether a unit was sold (false: out of stock).
    pub sold: bool,
    /// How long the request waited before its body ran.
    pub waited: Duration,
}

/// The purchase handler: read the stock, think, write it back less one.
/// The whole body runs under the lock `stock:{item}` of `locker`, in every
/// process that shares it; `asked` is when the request arrived.
///
/// # Errors
///
/// [`StockError::Lock`] if the lock service failed (the request waits for
/// its turn however long the queue); [`StockError::Store`] if the store
/// failed.
#[distributed_lock(key = "stock:{item}", locker = locker, wait = "forever")]
pub async fn buy(
    locker: &Locker,
    store: &Store,
    item: &str,
    think: Duration,
    asked: Instant,
) -> Result<Purchase, StockError> {
    sell_one(store, think, asked).await
}

/// The same handler with no lock: oversells.
///
/// # Errors
///
/// [`StockError::Store`] if the store failed.
pub async fn buy_unlocked(
    store: &Store,
    think: Duration,
    asked: Instant,
) -> Result<Purchase, StockError> {
    sell_one(store, think, asked).await
}

async fn sell_one(store: &Store, think: Duration, asked: Instant) -> Result<Purchase, StockError> {
    let waited = asked.elapsed();
    let left = store.read().await?;
    tokio::time::sleep(think).await;
    let sold = left > 0;
    if sold {
        store.write(left - 1).await?;
    }
    Ok(Purchase { sold, waited })
}

/// Serves `config.requests` concurrent purchases against `store`, each its
/// own Tokio task (as a web server would), under `locker`'s lock or with no
/// lock at all when `locker` is `None`. Returns the units sold and each
/// request's wait.
///
/// # Errors
///
/// The first error any request met.
pub async fn serve(
    locker: Option<&Locker>,
    store: Arc<Store>,
    config: &StockConfig,
) -> Result<(u64, Vec<Duration>), StockError> {
    // A JoinSet: on the first error the set is dropped, which aborts the
    // requests still running instead of leaving them buying unseen.
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..config.requests {
        let (store, locker) = (store.clone(), locker.cloned());
        let (item, think) = (config.item.clone(), config.think);
        requests.spawn(async move {
            let asked = Instant::now();
            match &locker {
                Some(locker) => buy(locker, &store, &item, think, asked).await,
                None => buy_unlocked(&store, think, asked).await,
            }
        });
    }
    let (mut sold, mut waits) = (0, Vec::with_capacity(config.requests));
    while let Some(request) = requests.join_next().await {
        let purchase = request.map_err(|e| StockError::Panicked(e.to_string()))??;
        sold += u64::from(purchase.sold);
        waits.push(purchase.waited);
    }
    Ok((sold, waits))
}

/// Runs the whole scenario in this process, against a new in-memory store.
///
/// # Errors
///
/// The first error any request met.
///
/// # Examples
///
/// ```
/// use dlock::{BackendExt, MemoryBackend};
/// use dlock_examples::stock::{run, StockConfig};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), dlock_examples::stock::StockError> {
/// let locker = MemoryBackend::new().into_locker();
/// let report = run(Some(&locker), &StockConfig::default()).await?;
/// assert_eq!((report.sold, report.oversold), (300, 0));
/// # Ok(())
/// # }
/// ```
pub async fn run(locker: Option<&Locker>, config: &StockConfig) -> Result<StockReport, StockError> {
    let store = Arc::new(Store::in_memory(config.stock));
    let start = Instant::now();
    let (sold, waits) = serve(locker, store.clone(), config).await?;
    let remaining = store.read().await?;
    Ok(StockReport::new(
        config.stock,
        sold,
        remaining,
        start.elapsed(),
        waits,
    ))
}
