//! `RedisBackend`: the `Backend` trait over one node or a Redlock quorum.
//!
//! A single node is the one-node case of the same code: quorum 1, one
//! round trip per acquire, and fencing tokens from the node's counter.

use std::{fmt, sync::Arc, time::Duration};

use dlock_core::{
    backend::{
        unsupported_holder, wait, AcquireRequest, Acquired, Backend, Capabilities,
        ConnectionStates, Holder, ListPage, ListRequest, Mode, ReleaseOutcome, RenewOutcome,
        RenewRequest,
    },
    LockError, LockKey, Result, Token,
};
use futures_util::future::join_all;
use redis::{RedisError, RedisResult};
use tokio::sync::Notify;

use crate::{
    keys::{entry, names, shared_names, Names},
    node::Node,
    scripts::{
        election,
        lock::{self, Place},
        renew::{self, Renewal},
        shared,
    },
};
use session::RenewalInFlight;

#[cfg(test)]
mod failover_tests;
#[cfg(test)]
mod hooks;
mod listing;
mod queue;
mod session;

const NAME: &str = "redis";

/// The longest a Redlock node may take for one step.
const REDLOCK_NODE_TIMEOUT_MAX: Duration = Duration::from_secs(1);

/// A Redis lock server: one node, Redlock over several, a Redis Cluster,
/// or the master a Sentinel deployment names.
///
/// Build it with [`RedisBackend::connect`] (or `from_client`) and turn it
/// into a [`Locker`](dlock_core::Locker) with
/// [`into_locker`](dlock_core::BackendExt::into_locker); its lockers and
/// guards share one multiplexed and one pub/sub connection per node.
/// Redlock has no fencing tokens, read-write locks or semaphores. A
/// `redis://` URL names one server, not a proxy over cluster slots (use
/// `redis+cluster://`). How it locks: the [crate docs](crate); Sentinel,
/// Cluster and failover: dlock's
/// [guide](https://docs.rs/dlock/latest/dlock/guide/backends/index.html#redis).
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
    /// Whether plain locks are fair unless a lock asks (see
    /// `RedisConfig::fair`).
    fair: bool,
    /// How long a subscription may take before the waiter does without it.
    subscribe_timeout: Duration,
    /// Without a wait limit, how long the server may stay unreachable before
    /// an acquire fails with the error instead of retrying.
    unreachable_after: Duration,
    /// The longest sleep of a waiter that cannot subscribe.
    unwatched_poll: Duration,
    /// Per key, the turns of this process's waiters.
    local: dlock_core::backend::LocalTurns<String>,
    /// What the backend's own requests find (see `session`).
    states: ConnectionStates,
    /// When a quorum of nodes last answered.
    answered_at: std::sync::Mutex<tokio::time::Instant>,
    /// The node an unfair Redlock waiter tries alone first: the next one
    /// after it failed to answer.
    probe: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<&str> = self.inner.nodes.iter().map(|n| n.addr.as_str()).collect();
        f.debug_struct("RedisBackend")
            .field("nodes", &nodes)
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

    /// The names of a plain lock.
    fn names(&self, key: &LockKey) -> Names {
        names(&self.inner.prefix, key)
    }

    /// Releases `token` on every node, and takes it out of the key's line.
    async fn release_names(
        &self,
        names: &Names,
        token: &str,
        timeout: Option<Duration>,
    ) -> Result<ReleaseOutcome> {
        let answers = self
            .on_every_node(timeout, |node| {
                lock::release(node, names, token, Place::None, 0)
            })
            .await;
        // The token held the lock only if it held a majority: a stale
        // guard's leftover key on a node or two is not the lock.
        let released = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        if released >= self.inner.quorum {
            return Ok(ReleaseOutcome::Released);
        }
        if answers.iter().any(|a| a.is_ok()) {
            return Ok(ReleaseOutcome::NotHeld);
        }
        // No node answered: the lock, if held, expires with its lease.
        Err(first_error(answers))
    }

    /// A `PING` to every node, each within `within`: `Ok` when a quorum
    /// answers.
    async fn ping_quorum(&self, within: Duration) -> Result<()> {
        let answers = self
            .on_every_node(Some(within), |node| {
                let mut conn = node.connection();
                async move { redis::cmd("PING").query_async::<()>(&mut conn).await }
            })
            .await;
        let up = answers.iter().filter(|a| a.is_ok()).count();
        if up >= self.inner.quorum {
            return Ok(());
        }
        Err(first_error(answers))
    }

    /// A holder's value and its reads need one holder: Redlock has none
    /// (a value on a majority is not one value), and without fences
    /// nothing orders the holders.
    fn holders_known(&self) -> Result<()> {
        self.inner
            .fences
            .then_some(())
            .ok_or_else(|| unsupported_holder(NAME))
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

/// The first error among `answers` (a timeout if none has one).
fn first_error<T>(answers: Vec<RedisResult<T>>) -> LockError {
    backend_error(
        answers
            .into_iter()
            .find_map(|a| a.err())
            .unwrap_or_else(timed_out),
    )
}

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// A `PING` to every node, half a second each: `Ok` when a quorum
    /// answers (one dead Redlock node is no error).
    async fn check_servers(&self) -> Result<()> {
        self.ping_quorum(Duration::from_millis(500)).await
    }

    fn capabilities(&self) -> Capabilities {
        // Read-write locks and semaphores on one node: a majority of
        // per-node holder sets is not one set of holders.
        let one_node = !self.inner.redlock;
        Capabilities::new()
            .forced_release(true)
            .fencing(self.inner.fences)
            // The default: `LockOptions::fair` may opt a lock out (or in).
            .fifo(self.inner.fair)
            .read_write(one_node)
            .semaphores(one_node)
            .server_leases(true)
    }

    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        wait::drive(&queue::Steps::new(self, &req), &req).await
    }

    /// On every node, and out of the key's line; a read-write lock's or
    /// semaphore's entry on its one node.
    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        if mode != Mode::Exclusive {
            let names = shared_names(&self.inner.prefix, key, mode);
            let held = shared::release(&self.inner.nodes[0], &names, &entry(token, mode))
                .await
                .map_err(backend_error)?;
            return Ok(if held {
                ReleaseOutcome::Released
            } else {
                ReleaseOutcome::NotHeld
            });
        }
        let timeout = self.inner.redlock.then_some(REDLOCK_NODE_TIMEOUT_MAX);
        self.release_names(&self.names(key), &token.to_string(), timeout)
            .await
    }

    /// Every lock of a watchdog tick, in one pipelined round trip per
    /// node; on Redlock, renewed where a majority renewed it.
    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        let prefix = &self.inner.prefix;
        let renewals: Vec<Renewal> = locks
            .iter()
            .map(|r| {
                let (names, owner) = match r.mode {
                    Mode::Exclusive => (names(prefix, &r.key), r.token.to_string()),
                    mode => (shared_names(prefix, &r.key, mode), entry(&r.token, mode)),
                };
                Renewal {
                    names,
                    owner,
                    shared: r.mode != Mode::Exclusive,
                    lease_ms: r.lease.as_millis().max(1) as u64,
                }
            })
            .collect();
        // A renewal counts from when it was sent: a late answer is still
        // worth a watchdog period (a third of the lease) on Redlock.
        let timeout = locks
            .iter()
            .map(|r| r.lease)
            .min()
            .filter(|_| self.inner.redlock)
            .map(|lease| lease / 3);
        let renewals = &renewals;
        let longest = locks.iter().map(|r| r.lease).max().unwrap_or_default();
        let mut in_flight = RenewalInFlight {
            backend: self,
            lease: longest,
            answered: false,
        };
        let answers = self
            .on_every_node(timeout, |node| renew::renew(node, renewals))
            .await;
        // Unanswered, the guard counts it when it drops.
        in_flight.answered = self.inner.states.get() != dlock_core::ConnectionState::Suspended;
        drop(in_flight);
        if !self.inner.redlock {
            // One node: its error (too few replicas included) is the batch's.
            let answers = answers
                .into_iter()
                .next()
                .unwrap_or_else(|| Err(timed_out()))
                .map_err(backend_error)?;
            return Ok(answers
                .into_iter()
                .map(|renewed| {
                    if renewed {
                        RenewOutcome::Renewed
                    } else {
                        RenewOutcome::NotHeld
                    }
                })
                .collect());
        }
        let quorum = self.inner.quorum;
        Ok((0..locks.len())
            .map(|i| {
                let renewed = answers
                    .iter()
                    .filter(|a| matches!(a, Ok(v) if v[i]))
                    .count();
                let unanswered = answers.iter().filter(|a| a.is_err()).count();
                if renewed >= quorum {
                    RenewOutcome::Renewed
                } else if renewed + unanswered >= quorum {
                    RenewOutcome::Unknown
                } else {
                    RenewOutcome::NotHeld
                }
            })
            .collect())
    }

    /// Publishes `value` beside the lock (one node, with fences only).
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        self.holders_known()?;
        election::proclaim(
            &self.inner.nodes[0],
            &self.names(key),
            &token.to_string(),
            value,
        )
        .await
        .map_err(backend_error)
    }

    /// The plain lock's holder, with its note, mode, fence and lease
    /// left (fences only: without them, as on Redlock, who holds is not
    /// told, as [`list`](Backend::list) tells it).
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        self.holders_known()?;
        Ok(self
            .read_holder(&self.names(key), true)
            .await?
            .map(|(_, h)| h))
    }

    /// One page of the plain locks held under a prefix, from `SCAN` on
    /// each node in turn (each master of a cluster; on Redlock each key
    /// once, held for one token on a majority), each with its holder's
    /// note, fence (with fences) and lease left. Read-write locks and
    /// semaphores are not listed, and waiters are not counted. Every node
    /// scanned must answer (on Redlock too: a node down fails the page).
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        self.list_page(req).await
    }

    /// Subscribes to the key's holder channel (a proclaim, and the release
    /// of a proclaimed hold, publish there), then reads; woken by a
    /// message, or when the holder's lease runs out. A grant is seen when
    /// its holder proclaims: every elected leader does, before it is told.
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        self.holders_known()?;
        let names = self.names(key);
        let node = &self.inner.nodes[0];
        let wake = Arc::new(Notify::new());
        let watcher = Token::generate().to_string();
        let _watch = node
            .subscriber
            .watch(&names.holder_channel().to_string(), &watcher, &wake)
            .await
            .map_err(backend_error)?;
        let read = election::holder(node, &names)
            .await
            .map_err(backend_error)?;
        let current = read
            .clone()
            .map(|read| self.holder_of(read, true))
            .transpose()?;
        if current.as_ref() != seen {
            return Ok(());
        }
        let left = read.and_then(|read| read.lease_left);
        let _ = tokio::time::timeout(left.unwrap_or(Duration::MAX), wake.notified()).await;
        Ok(())
    }

    fn connection_state(&self) -> tokio::sync::watch::Receiver<dlock_core::ConnectionState> {
        self.inner.states.subscribe()
    }

    /// A renewal: the script sets the key's TTL (or the share's end) once
    /// the token is checked; on Redlock, on a majority of the nodes. A
    /// plain lock's waiters are then woken (every one: unfair ones stand
    /// in no line), since the end may have moved earlier than they were
    /// told (best effort: they look again at the old end anyway).
    async fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(tokio::time::Instant, Duration)>> {
        let extended =
            dlock_core::backend::extend_by_renewal(self, key, mode, token, lease).await?;
        if extended.is_some() && mode == Mode::Exclusive {
            let names = &self.names(key);
            let timeout = self.inner.redlock.then_some(REDLOCK_NODE_TIMEOUT_MAX);
            self.on_every_node(timeout, |node| lock::wake_first(node, names))
                .await;
        }
        Ok(extended)
    }

    /// The semaphore's holders whose lease has not ended by the server's
    /// clock.
    async fn permits_taken(&self, key: &LockKey, _limit: u32) -> Result<u32> {
        let names = shared_names(
            &self.inner.prefix,
            key,
            Mode::Permits { count: 1, limit: 1 },
        );
        shared::permits_taken(&self.inner.nodes[0], &names)
            .await
            .map_err(backend_error)
    }

    /// Reads each node's holder token and releases it there (the script
    /// checks the token, so a holder that changed meanwhile stays), and
    /// the first waiter in line is told. The holder learns at its next
    /// renewal. `true` if a node released.
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        let names = &self.names(key);
        let timeout = self.inner.redlock.then_some(REDLOCK_NODE_TIMEOUT_MAX);
        let answers = self
            .on_every_node(timeout, |node| async move {
                let mut conn = node.connection();
                let holder: Option<String> = redis::cmd("GET")
                    .arg(&names.lock)
                    .query_async(&mut conn)
                    .await?;
                match holder {
                    Some(token) => lock::force_release(node, names, &token).await,
                    None => Ok(false),
                }
            })
            .await;
        if answers.iter().any(|a| matches!(a, Ok(true))) {
            return Ok(true);
        }
        // "Free" only when a quorum said so; otherwise the nodes' error.
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if answered < self.inner.quorum {
            return Err(first_error(answers));
        }
        Ok(false)
    }
}
