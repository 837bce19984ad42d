//! An order-processing web service (axum) that several instances run side
//! by side. Processing an order charges it once: the handler checks the
//! shared ledger, calls the payment provider, and records the order, a
//! check-then-act that charges twice if two instances process one order at
//! once. `#[distributed_lock(key = "order:{id}")]` makes the handler
//! exclusive per order across every instance.
//!
//! Routes:
//! - `POST /orders/{id}/process`: 201 when this request processed it, 200
//!   when it was already processed, 409 + `Retry-After` when another
//!   request kept the order locked past the wait, 503 + `Retry-After` when
//!   the lock was lost, 500 (logged) when the lock service or the ledger
//!   failed;
//! - `GET /stats`: orders this instance processed and the total over all
//!   instances, kept in a [`DistMutex`] (this instance's counters, locked
//!   across all instances while the shared total is updated).

use std::{io, path::PathBuf, sync::Arc, time::Duration};

use axum::{
    extract::{Path, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use dlock::{distributed_lock, DistMutex, LockError, Locker};
use tokio::io::AsyncWriteExt;

/// The ledger all instances share (a database, here a directory):
/// `processed/{id}` marks a processed order, `charges.log` has one line per
/// charge made, `total` counts processed orders.
///
/// # Examples
///
/// ```
/// use dlock_examples::orders::Ledger;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> std::io::Result<()> {
/// let dir = tempfile::tempdir()?;
/// let ledger = Ledger::open(dir.path())?;
/// assert!(ledger.charges()?.is_empty());
/// assert_eq!(ledger.total().await?, 0);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Ledger {
    dir: PathBuf,
}

impl Ledger {
    /// A ledger in `dir`, created if missing.
    ///
    /// # Errors
    ///
    /// The I/O error if the directory cannot be created.
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<Ledger> {
        let dir = dir.into();
        std::fs::create_dir_all(dir.join("processed"))?;
        Ok(Ledger { dir })
    }

    async fn is_processed(&self, id: u64) -> io::Result<bool> {
        tokio::fs::try_exists(self.dir.join("processed").join(id.to_string())).await
    }

    async fn mark_processed(&self, id: u64, instance: &str) -> io::Result<()> {
        tokio::fs::write(self.dir.join("processed").join(id.to_string()), instance).await
    }

    async fn charge(&self, id: u64, instance: &str) -> io::Result<()> {
        let mut log = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("charges.log"))
            .await?;
        log.write_all(format!("{id} {instance}\n").as_bytes()).await
    }

    /// Every charge made, as `(order id, instance)`, in order.
    ///
    /// # Errors
    ///
    /// The I/O error if the log cannot be read.
    pub fn charges(&self) -> io::Result<Vec<(u64, String)>> {
        let text = match std::fs::read_to_string(self.dir.join("charges.log")) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
            other => other?,
        };
        Ok(text
            .lines()
            .filter_map(|l| {
                let (id, instance) = l.split_once(' ')?;
                Some((id.parse().ok()?, instance.to_owned()))
            })
            .collect())
    }

    /// Orders processed by all instances.
    ///
    /// # Errors
    ///
    /// The I/O error, or `InvalidData` if the file does not hold a number.
    pub async fn total(&self) -> io::Result<u64> {
        match tokio::fs::read_to_string(self.dir.join("total")).await {
            Ok(text) => text.trim().parse().map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidData, format!("total: `{text}`"))
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(e),
        }
    }

    async fn set_total(&self, total: u64) -> io::Result<()> {
        tokio::fs::write(self.dir.join("total"), total.to_string()).await
    }
}

/// This instance's counters.
#[derive(Debug, Default)]
pub struct InstanceStats {
    /// Orders this instance processed.
    pub processed: u64,
}

/// What the handlers share.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use dlock::{BackendExt, MemoryBackend};
/// use dlock_examples::orders::{router, AppState, Ledger};
///
/// # fn main() -> std::io::Result<()> {
/// let dir = tempfile::tempdir()?;
/// let locker = MemoryBackend::new().into_locker();
/// let state = AppState::new(locker, "a", Ledger::open(dir.path())?, Duration::from_millis(50));
/// let app = router(state); // serve with axum::serve
/// # let _ = app;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct AppState {
    locker: Locker,
    instance: Arc<str>,
    ledger: Ledger,
    /// Held while the shared total is read and written: a [`DistMutex`],
    /// so the instances take turns, and its value is this instance's own.
    stats: Arc<DistMutex<InstanceStats>>,
    /// How long a charge takes at the payment provider.
    charge_time: Duration,
}

impl AppState {
    /// The state of instance `instance`, locking through `locker`.
    pub fn new(locker: Locker, instance: &str, ledger: Ledger, charge_time: Duration) -> AppState {
        AppState {
            stats: Arc::new(DistMutex::new(
                &locker,
                "orders:total",
                InstanceStats::default(),
            )),
            locker,
            instance: instance.into(),
            ledger,
            charge_time,
        }
    }
}

/// The service's routes.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use dlock_examples::orders::{router, AppState, Ledger};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let locker = dlock_examples::backend::locker(Some("redis://127.0.0.1:6379")).await?;
/// let state = AppState::new(locker, "a", Ledger::open("/var/lib/orders")?, Duration::from_millis(50));
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
/// axum::serve(listener, router(state)).await?;
/// # Ok(())
/// # }
/// ```
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/orders/{id}/process", post(process_order))
        .route("/stats", get(stats))
        .with_state(state)
}

/// Processes order `id` once, whichever instance and however many
/// requests ask. The body runs under the lock `order:{id}`; a request that
/// waits 2 s for it gets 409.
#[distributed_lock(key = "order:{id}", locker = state.locker, wait = "2s")]
async fn process_order(
    State(state): State<AppState>,
    Path(id): Path<u64>,
) -> Result<(StatusCode, String), ApiError> {
    if state.ledger.is_processed(id).await? {
        return Ok((
            StatusCode::OK,
            format!("order {id} was already processed\n"),
        ));
    }
    // The payment provider's call, then the record of it.
    tokio::time::sleep(state.charge_time).await;
    state.ledger.charge(id, &state.instance).await?;
    state.ledger.mark_processed(id, &state.instance).await?;

    // The order is charged: whatever fails from here is the service's
    // fault (500), never "being processed by another request" (409). A
    // failure here leaves the total one short; a real service would count
    // in the same transaction as the charge.
    let mut stats = state.stats.lock().await.map_err(ApiError::Stats)?;
    stats.processed += 1;
    let total = state.ledger.total().await?;
    state.ledger.set_total(total + 1).await?;
    Ok((
        StatusCode::CREATED,
        format!("order {id} processed by instance {}\n", state.instance),
    ))
}

async fn stats(State(state): State<AppState>) -> Result<String, ApiError> {
    let stats = state.stats.lock().await.map_err(ApiError::Stats)?;
    let total = state.ledger.total().await?;
    Ok(format!(
        "instance {} processed {}; all instances processed {total}\n",
        state.instance, stats.processed
    ))
}

/// A request that failed, as an HTTP response.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The lock: 409 or 503 with `Retry-After`, or 500.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The ledger: 500.
    #[error("ledger: {0}")]
    Ledger(#[from] io::Error),
    /// The instance counters' lock, taken after the charge: 500.
    #[error("stats lock: {0}")]
    Stats(LockError),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry = |status: StatusCode, message: &str| {
            (status, [(header::RETRY_AFTER, "1")], format!("{message}\n")).into_response()
        };
        match self {
            // Another request holds the order: it is being processed now.
            ApiError::Lock(LockError::Timeout { .. } | LockError::WouldBlock { .. }) => retry(
                StatusCode::CONFLICT,
                "this order is being processed by another request; retry later",
            ),
            ApiError::Lock(LockError::Lost { .. }) => retry(
                StatusCode::SERVICE_UNAVAILABLE,
                "the order's lock was lost; retry later",
            ),
            error => {
                tracing::error!(%error, "request failed");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").into_response()
            }
        }
    }
}
