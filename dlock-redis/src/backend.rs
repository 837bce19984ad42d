//! `RedisBackend`: the `Backend` trait over one node or a Redlock quorum.
//!
//! A single node is the one-node case of the same code: quorum 1, one
//! round trip per acquire, and fencing tokens from the node's counter.

use std::{fmt, sync::Arc, time::Duration};

use dlock_core::{
    backend::{
        wait, AcquireRequest, Acquired, Backend, Capabilities, ConnectionStates, Holder, Mode,
        ReleaseOutcome, RenewOutcome, RenewRequest,
    },
    LockError, LockKey, Result, Token,
};
use futures_util::future::join_all;
use redis::{RedisError, RedisResult};

use crate::node::Node;

mod election;
#[cfg(test)]
mod failover_tests;
#[cfg(test)]
mod hooks;
mod queue;
mod release;
mod session;

const NAME: &str = "redis";

/// The longest a Redlock node may take for one step.
const REDLOCK_NODE_TIMEOUT_MAX: Duration = Duration::from_secs(1);

/// A Redis lock server: one node, Redlock over several, a Redis Cluster,
/// or the master a Sentinel deployment names.
///
/// Build it with [`RedisBackend::connect`] (or `from_client`) and turn it
/// into a [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker). All lockers and
/// guards of one backend share its connections: one multiplexed connection
/// and one pub/sub connection per node.
///
/// - **Acquire** is one round trip per node: a Lua script that takes a free
///   key and counts its fencing token, or puts the caller in the key's
///   line. Waiters are served first come, first served across processes: a
///   release hands the lock to the first of them and wakes that one alone
///   (the [crate docs](crate), "The waiting line", say how).
/// - **Release and renewal** compare the owner token in a script. The
///   watchdog renews every held lock of a locker in one pipelined round
///   trip per node and tick, so a `redis://` URL must name one server (or
///   a Sentinel deployment's master), not a proxy that spreads keys over
///   cluster slots, which refuses such a call (`CROSSSLOT`) and would let
///   every lease run out: for a cluster, use `redis+cluster://`.
/// - **Redlock** (`redis+redlock://`) holds a lock only with a majority of
///   nodes and time left on the lease. It gives no fencing tokens
///   ([`LockGuard::fencing_token`](dlock_core::LockGuard::fencing_token) is
///   `None`: per-node counters taken by different majorities can go
///   backwards), and no read-write locks or semaphores.
/// - **Sentinel** (`redis+sentinel://`): the one node is whichever server
///   the sentinels name master now, asked every second and at once after
///   an error a failover explains; a lock whose key the new master lacks
///   is reported lost by the next renewal (the [crate docs](crate), "Redis
///   Sentinel").
///
/// # Connection state
///
/// [`Locker::state`](dlock_core::Locker::state) follows what the backend's
/// own requests find (Redis has no session to watch): a step that a
/// quorum of nodes cannot answer for a reason of the connection (refused,
/// dropped, timed out) is `Suspended`; renewals that find no quorum for
/// longer than their lease are `Lost` (every lease renewed by then has run
/// out); the next answered step is `Reconnected`. The watchdog's
/// renewals, acquires, releases and `check_servers` all count; a backend
/// that sends nothing learns nothing.
///
/// # Examples
///
/// ```no_run
/// use dlock_core::BackendExt;
/// use dlock_redis::RedisBackend;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = RedisBackend::connect("redis://127.0.0.1:6379/").await?.into_locker();
/// let guard = locker.lock("report:daily").await?;
/// println!("fence {:?}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: Vec<Node>,
    quorum: usize,
    prefix: String,
    redlock: bool,
    /// Whether locks carry fencing tokens (see `RedisConfig::fences`).
    fences: bool,
    /// How long a subscription may take before the waiter does without it.
    subscribe_timeout: Duration,
    /// Without a wait limit, how long the server may stay unreachable before
    /// an acquire fails with the error instead of retrying.
    unreachable_after: Duration,
    /// The longest sleep of a waiter that cannot subscribe.
    unwatched_poll: Duration,
    /// Per key, the turns of this process's waiters (see `local_turn`).
    local: dlock_core::backend::LocalTurns<String>,
    /// See "Connection state" above.
    states: ConnectionStates,
    /// When a quorum of nodes last answered.
    answered_at: std::sync::Mutex<tokio::time::Instant>,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field(
                "nodes",
                &self
                    .inner
                    .nodes
                    .iter()
                    .map(|n| n.addr.as_str())
                    .collect::<Vec<_>>(),
            )
            .field("redlock", &self.inner.redlock)
            .field("fences", &self.inner.fences)
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

fn backend_error(e: RedisError) -> LockError {
    LockError::backend(NAME, e)
}

impl RedisBackend {
    /// Runs `step` on every node at once, each bounded by `timeout`.
    async fn on_every_node<'n, T, F, Fut>(
        &'n self,
        timeout: Option<Duration>,
        step: F,
    ) -> Vec<RedisResult<T>>
    where
        F: Fn(&'n Node) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>> + 'n,
    {
        let answers = match &self.inner.nodes[..] {
            // One node (not Redlock): no join to allocate and poll.
            [node] => vec![bounded(timeout, step(node)).await],
            nodes => join_all(nodes.iter().map(|node| bounded(timeout, step(node)))).await,
        };
        self.observe(&answers);
        answers
    }

    /// Feeds the connection state from one step's answers: a quorum that
    /// answered (even with a script's error) is `answered`; a step that a
    /// quorum could not answer, for a reason of the connection, is
    /// `suspended`.
    fn observe<T>(&self, answers: &[RedisResult<T>]) {
        let unreachable = |e: &RedisError| {
            e.is_io_error()
                || e.is_connection_refusal()
                || e.is_connection_dropped()
                || e.is_timeout()
                // A demoted master, or one a failover is replacing: its
                // answer is not the master's.
                || matches!(
                    e.kind(),
                    redis::ErrorKind::Server(
                        redis::ServerErrorKind::ReadOnly | redis::ServerErrorKind::MasterDown
                    )
                )
        };
        let reached = answers
            .iter()
            .filter(|a| !matches!(a, Err(e) if unreachable(e)))
            .count();
        if reached >= self.inner.quorum {
            *self.answered_at() = tokio::time::Instant::now();
            self.inner.states.answered();
        } else {
            self.inner.states.suspended();
        }
    }

    fn answered_at(&self) -> std::sync::MutexGuard<'_, tokio::time::Instant> {
        self.inner
            .answered_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// After renewals that a quorum could not answer: `lost` at the end
    /// of the longest of their leases unless a quorum answers by then
    /// (every lease renewed at the last answer has run out).
    fn lost_unless_answered_within(&self, lease: Duration) {
        let answered = *self.answered_at();
        let inner = Arc::downgrade(&self.inner);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            tokio::time::sleep_until(answered + lease).await;
            if let Some(inner) = inner.upgrade() {
                let backend = RedisBackend { inner };
                if *backend.answered_at() == answered {
                    backend.inner.states.lost();
                }
            }
        });
    }
}

/// A renewal round in flight: dropped before it is answered (the
/// watchdog gives a round one period, which a black-holed node outlasts),
/// it counts as unanswered.
pub(crate) struct RenewalInFlight<'a> {
    pub(crate) backend: &'a RedisBackend,
    pub(crate) lease: Duration,
    pub(crate) answered: bool,
}

impl Drop for RenewalInFlight<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.backend.inner.states.suspended();
            self.backend.lost_unless_answered_within(self.lease);
        }
    }
}

/// `step`, bounded by `timeout` if there is one.
async fn bounded<T>(
    timeout: Option<Duration>,
    step: impl std::future::Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    match timeout {
        Some(t) => tokio::time::timeout(t, step)
            .await
            .unwrap_or_else(|_| Err(timed_out())),
        None => step.await,
    }
}

fn timed_out() -> RedisError {
    RedisError::from((redis::ErrorKind::Io, "the node did not answer in time"))
}

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// A `PING` to every node: `Ok` when a quorum answers. Each node gets
    /// half a second, well inside the Locker's bound, so that one dead
    /// Redlock node does not turn a quorum's answer into an error.
    async fn check_servers(&self) -> Result<()> {
        let answers = self
            .on_every_node(Some(Duration::from_millis(500)), |node| {
                let mut conn = node.connection();
                async move { redis::cmd("PING").query_async::<()>(&mut conn).await }
            })
            .await;
        let up = answers.iter().filter(|a| a.is_ok()).count();
        if up >= self.inner.quorum {
            return Ok(());
        }
        Err(backend_error(
            answers
                .into_iter()
                .find_map(|a| a.err())
                .unwrap_or_else(timed_out),
        ))
    }

    fn capabilities(&self) -> Capabilities {
        // Read-write locks and semaphores on one node: a majority of
        // per-node holder sets is not one set of holders.
        let one_node = !self.inner.redlock;
        Capabilities::new()
            .forced_release(true)
            .fencing(self.inner.fences)
            .fifo(true)
            .read_write(one_node)
            .semaphores(one_node)
    }

    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        wait::drive(&queue::Steps::new(self, &req), &req).await
    }

    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        self.release_inner(key, mode, token).await
    }

    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        self.renew_inner(locks).await
    }

    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        self.proclaim_inner(key, token, value).await
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        self.holder_inner(key).await
    }

    /// Subscribes to the key's holder channel (a proclaim, and the release
    /// of a proclaimed hold, publish there), then reads; woken by a
    /// message, or when the holder's lease runs out. A grant is seen when
    /// its holder proclaims: every elected leader does, before it is told.
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        self.holder_changed_inner(key, seen).await
    }

    fn connection_state(&self) -> tokio::sync::watch::Receiver<dlock_core::ConnectionState> {
        self.inner.states.subscribe()
    }

    /// A renewal: the script sets the key's TTL (or the share's end) once
    /// the token is checked; on Redlock, on a majority of the nodes.
    async fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(tokio::time::Instant, Duration)>> {
        dlock_core::backend::extend_by_renewal(self, key, mode, token, lease).await
    }

    /// The semaphore's holders whose lease has not ended by the server's
    /// clock, in one script.
    async fn permits_taken(&self, key: &LockKey, _limit: u32) -> Result<u32> {
        self.permits_taken_inner(key).await
    }

    /// Reads the holder's token on each node and releases it there (the
    /// script hands the lock to the first waiter in line). The holder's
    /// guard learns at its next renewal, within a third of its lease.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.force_release_inner(key).await
    }
}
