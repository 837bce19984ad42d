//! One Redis node (or one Redis Cluster, which is one node to the lock
//! algorithm: each key's names live in one slot): a reconnecting
//! multiplexed connection, the scripts run on it, and its shared pub/sub
//! subscriber.

use std::time::Duration;

use futures_util::future::join_all;
use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    Client, ErrorKind, RedisError, RedisResult,
};

mod conn;
mod replicas;

pub(crate) use conn::Conn;

use crate::{
    keys::Names,
    scripts::{scripts, Scripts},
    sentinel::{Following, Master},
    subscriber::{Subscriber, Watch},
};

/// What one acquire attempt found on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Our token holds the lock; the fencing counter's value.
    Acquired(u64),
    /// Another token holds it: worth checking again in this many
    /// milliseconds, when its lease ends (`None` when the key has no TTL:
    /// someone wrote it without dlock, or an attempt that does not queue
    /// was refused, which does not ask how long).
    Held(Option<u64>),
    /// A release handed it to another waiter, the first in line, who has
    /// this many milliseconds left to take it.
    NotOurTurn(u64),
    /// Granted, but fewer replicas than `wait_replicas` asks for (this
    /// many) acknowledged the grant: it does not count.
    Unacknowledged(i64),
}

/// What one attempt at a read-write lock or semaphore found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SharedAttempt {
    /// The entry holds; the fencing counter's value.
    Acquired(u64),
    /// Refused: worth checking again in this many milliseconds, when a
    /// holder's lease or a ticket ahead runs out (`None`: nothing will
    /// run out by itself).
    Held(Option<u64>),
    /// The semaphore's holders or waiters name this limit, not ours.
    OtherLimit(u32),
    /// Granted, but fewer replicas than `wait_replicas` asks for (this
    /// many) acknowledged the grant: it does not count.
    Unacknowledged(i64),
}

/// A plain lock's holder, as the holder script reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HolderRead {
    pub(crate) fence: u64,
    /// The lease it has left, if the key has one.
    pub(crate) lease_left: Option<Duration>,
    pub(crate) value: Option<Vec<u8>>,
}

/// Which of a lock's names a script takes as its `KEYS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// The lock and its fence counter.
    Lock,
    /// The lock, its fence counter and its waiting line.
    Line,
    /// The lock, its fence counter and its proclaimed value.
    Value,
    /// The lock, its fence counter, its waiting line and its proclaimed
    /// value.
    LineAndValue,
    /// As `LineAndValue`, and the token of the lock's last release.
    Release,
}

impl Keys {
    fn write(self, cmd: &mut redis::Cmd, names: &Names) {
        let count = match self {
            Keys::Lock => 2,
            Keys::Value => 3,
            Keys::Line => 4,
            Keys::LineAndValue => 5,
            Keys::Release => 6,
        };
        cmd.arg(count).arg(&names.lock).arg(names.fence());
        match self {
            Keys::Lock => {}
            Keys::Value => {
                cmd.arg(names.value());
            }
            Keys::Line => {
                cmd.arg(names.queue()).arg(names.tickets());
            }
            Keys::LineAndValue | Keys::Release => {
                cmd.arg(names.queue())
                    .arg(names.tickets())
                    .arg(names.value());
                if self == Keys::Release {
                    cmd.arg(names.released_by());
                }
            }
        }
    }
}

/// How many plain locks one batch renewal renews: a `GET` and three
/// `PEXPIRE`s each, so a call holds the server for a fraction of a
/// millisecond (Redlock-5 renewed 100,000 locks on each of 5 nodes, on 2
/// CPUs, in about 1.5 s), where a lock's request would wait behind it.
const RENEW_BATCH: usize = 256;

/// One lock for [`Node::renew`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Renewal<'a> {
    /// Its names (`shared_names` for a read-write lock or semaphore).
    pub(crate) names: &'a Names,
    /// The token of a plain lock; the entry of a shared one.
    pub(crate) owner: &'a str,
    /// Whether it is a read-write lock's or a semaphore's.
    pub(crate) shared: bool,
    /// The new lease.
    pub(crate) lease_ms: u64,
}

impl Renewal<'_> {
    /// The script that renews it, and the names that script takes.
    fn script(self, scripts: &Scripts) -> (&redis::Script, Keys) {
        if self.shared {
            (&scripts.shared_renew, Keys::Lock)
        } else {
            (&scripts.renew, Keys::Value)
        }
    }
}

/// Where an attempt stands in the key's line of waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// A single attempt: it does not queue.
    None,
    /// Last in line, placed by the server's clock (one node).
    Last,
    /// At this score, the same on every node (Redlock: the waiter's clock
    /// in µs when it started waiting, so that every node orders the line
    /// alike).
    At(u64),
}

/// The script's argument: "" for none, "0" for last, else the score.
impl redis::ToRedisArgs for Place {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        match *self {
            Place::None => out.write_arg(b""),
            Place::Last => out.write_arg(b"0"),
            Place::At(score) => out.write_arg_fmt(score.max(1)),
        }
    }
}

/// The reconnecting connection's settings.
fn manager_config(
    connect_timeout: Duration,
    response_timeout: Duration,
) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500))
}

pub(crate) struct Node {
    pub(crate) addr: String,
    conn: Conn,
    subscriber: Subscriber,
    /// A cluster: wake-ups on shard channels, and no pipeline across keys.
    cluster: bool,
    /// `wait_replicas`: how many replicas must acknowledge a grant or a
    /// renewal, and for how long to wait (see [`Node::wait_for_replicas`]).
    wait: Option<(u32, Duration)>,
}

impl Node {
    /// A node through `client`. With `eager`, connects now and fails if
    /// the node is unreachable; otherwise connects on first use.
    pub(crate) async fn from_client(
        client: Client,
        connect_timeout: Duration,
        response_timeout: Duration,
        eager: bool,
    ) -> RedisResult<Node> {
        let config = manager_config(connect_timeout, response_timeout);
        let conn = if eager {
            let mut conn = ConnectionManager::new_with_config(client.clone(), config).await?;
            if let Err(error) = scripts(false).load(&mut conn).await {
                // Not fatal: every call still loads a missing script itself.
                tracing::debug!(%error, "dlock redis could not preload its scripts");
            }
            crate::eviction::warn_if_evicting(&mut conn, &client).await;
            conn
        } else {
            let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
            // Connects in the background; a node that is down now loads the
            // scripts on first use instead.
            let mut preload = conn.clone();
            let node = client.clone();
            tokio::spawn(async move {
                if let Err(error) = scripts(false).load(&mut preload).await {
                    tracing::debug!(%error, "dlock redis could not preload its scripts");
                    return;
                }
                crate::eviction::warn_if_evicting(&mut preload, &node).await;
            });
            conn
        };
        let addr = client.get_connection_info().addr().to_string();
        Ok(Node {
            addr,
            subscriber: Subscriber::new(client, connect_timeout, response_timeout),
            conn: Conn::Node(conn),
            cluster: false,
            wait: None,
        })
    }

    /// The master of a Sentinel deployment, as one node: connects now to
    /// the master the sentinels name, and follows the next one they name
    /// (commands and wake-ups alike).
    pub(crate) async fn sentinel(
        sentinel: redis::sentinel::SentinelClient,
        name: &str,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Node> {
        let master = Master::connect(
            sentinel,
            name,
            manager_config(connect_timeout, response_timeout),
            connect_timeout,
        )
        .await?;
        let addr = format!("sentinel master `{name}`");
        Ok(Node {
            addr,
            subscriber: Subscriber::following(master.clone(), connect_timeout, response_timeout),
            conn: Conn::Sentinel(Following(master)),
            cluster: false,
            wait: None,
        })
    }

    /// A Redis Cluster through `client`, as one node: connects now, and
    /// fails if no node of the list answers. Commands go to the master of
    /// their key's slot, following the cluster as slots move and replicas
    /// take over; wake-ups come on shard channels (`SSUBSCRIBE`).
    pub(crate) async fn cluster(
        client: ClusterClient,
        subscriber: ClusterClient,
        connect_timeout: Duration,
        response_timeout: Duration,
        addr: String,
    ) -> RedisResult<Node> {
        let mut conn = tokio::time::timeout(connect_timeout, client.get_async_connection())
            .await
            .map_err(|_| RedisError::from((ErrorKind::Io, "cluster connect timed out")))??;
        if let Err(error) = scripts(true).load(&mut conn).await {
            tracing::debug!(%error, "dlock redis could not preload its scripts");
        }
        Ok(Node {
            addr,
            subscriber: Subscriber::sharded(subscriber, connect_timeout, response_timeout),
            conn: Conn::Cluster(conn),
            cluster: true,
            wait: None,
        })
    }

    fn scripts(&self) -> &'static Scripts {
        scripts(self.cluster)
    }

    /// Runs `script` on a lock's names (KEYS: lock, fence counter, and
    /// with `line` the line and ticket lapses) and `args` in one `EVALSHA`, loading the script first
    /// if the node lost it (a restart, `SCRIPT FLUSH`). One command buffer,
    /// rather than a vector per argument.
    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &redis::Script,
        names: &Names,
        keys: Keys,
        args: impl FnOnce(&mut redis::Cmd),
    ) -> RedisResult<T> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash());
        keys.write(&mut cmd, names);
        args(&mut cmd);
        let mut conn = self.conn.clone();
        match cmd.query_async(&mut conn).await {
            Err(e) if e.kind() == ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script.load_async(&mut conn).await?;
                cmd.query_async(&mut conn).await
            }
            answer => answer,
        }
    }

    /// One acquire attempt; one that is refused takes (or refreshes) its
    /// ticket at `place`, lapsing after `ticket_ms`.
    ///
    /// An attempt that neither queues nor counts a fence (Redlock's first)
    /// is a plain `SET NX PX`: a free key may be taken by anyone (see
    /// the acquire script), and the server spares a script run.
    pub(crate) async fn acquire(
        &self,
        names: &Names,
        token: &str,
        lease_ms: u64,
        fence: bool,
        place: Place,
        ticket_ms: u64,
    ) -> RedisResult<Attempt> {
        if place == Place::None && !fence {
            let mut set = redis::cmd("SET");
            set.arg(&names.lock)
                .arg(token)
                .arg("NX")
                .arg("PX")
                .arg(lease_ms);
            let (set, acked): (Option<String>, _) = self.query_acked(set).await?;
            return Ok(match set {
                Some(_) => self.acknowledged(Attempt::Acquired(0), acked),
                None => Attempt::Held(None),
            });
        }
        let ((status, value), acked): ((i64, i64), _) = self
            .run_acked(
                &self.scripts().acquire,
                names,
                if place == Place::None {
                    Keys::Lock
                } else {
                    Keys::Line
                },
                |cmd| {
                    cmd.arg(token)
                        .arg(lease_ms)
                        .arg(if fence { "1" } else { "0" });
                    if place != Place::None {
                        cmd.arg(names.channel()).arg(place).arg(ticket_ms);
                    }
                },
            )
            .await?;
        Ok(match status {
            1 => self.acknowledged(Attempt::Acquired(u64::try_from(value).unwrap_or(0)), acked),
            2 => Attempt::NotOurTurn(u64::try_from(value).unwrap_or(0)),
            _ => Attempt::Held(u64::try_from(value).ok()),
        })
    }

    /// One attempt at a read-write lock or semaphore (`names` from
    /// `shared_names`, `entry` from `keys::entry`); with `queue`, one that
    /// is refused stands last in line, its ticket lapsing after
    /// `ticket_ms`.
    pub(crate) async fn acquire_shared(
        &self,
        names: &Names,
        entry: &str,
        lease_ms: u64,
        queue: bool,
        ticket_ms: u64,
    ) -> RedisResult<SharedAttempt> {
        let ((status, value), acked): ((i64, i64), _) = self
            .run_acked(&self.scripts().shared_acquire, names, Keys::Line, |cmd| {
                cmd.arg(entry)
                    .arg(lease_ms)
                    .arg(if queue { "1" } else { "0" })
                    .arg(Place::Last)
                    .arg(ticket_ms);
            })
            .await?;
        Ok(match status {
            1 => match self.short_of_replicas(acked) {
                Some(acked) => SharedAttempt::Unacknowledged(acked),
                None => SharedAttempt::Acquired(u64::try_from(value).unwrap_or(0)),
            },
            3 => SharedAttempt::OtherLimit(u32::try_from(value).unwrap_or(0)),
            _ => SharedAttempt::Held(u64::try_from(value).ok()),
        })
    }

    /// Takes `entry` out of a read-write lock's or semaphore's holders and
    /// line, and wakes the waiters that are now admitted; `true` if it
    /// held.
    pub(crate) async fn release_shared(&self, names: &Names, entry: &str) -> RedisResult<bool> {
        let released: i64 = self
            .run(&self.scripts().shared_release, names, Keys::Line, |cmd| {
                cmd.arg(entry).arg(names.channel());
            })
            .await?;
        Ok(released == 1)
    }

    /// Releases the lock if `token` holds it. With `Place::None` the token
    /// also leaves the line (a release, or a wait given up); otherwise it
    /// stays in line at `place` (a Redlock grant given back). Either way,
    /// a lock left free is handed to the first waiter in line, who is
    /// told. A release sent again after its reply was lost answers `true`
    /// and does nothing.
    pub(crate) async fn release(
        &self,
        names: &Names,
        token: &str,
        place: Place,
        ticket_ms: u64,
    ) -> RedisResult<bool> {
        self.release_with(Keys::Release, names, token, place, ticket_ms)
            .await
    }

    /// [`release`](Node::release) for `force_release`, which names the
    /// holder's token: it leaves no record that the holder released, so
    /// the holder's own release still answers `false`.
    pub(crate) async fn force_release(&self, names: &Names, token: &str) -> RedisResult<bool> {
        self.release_with(Keys::LineAndValue, names, token, Place::None, 0)
            .await
    }

    async fn release_with(
        &self,
        keys: Keys,
        names: &Names,
        token: &str,
        place: Place,
        ticket_ms: u64,
    ) -> RedisResult<bool> {
        let released: i64 = self
            .run(&self.scripts().release, names, keys, |cmd| {
                cmd.arg(token)
                    .arg(names.channel())
                    .arg(place)
                    .arg(ticket_ms)
                    .arg(names.holder_channel());
            })
            .await?;
        Ok(released == 1)
    }

    /// Renews every lock in `locks` for its lease, in one pipelined round
    /// trip; `true` where its owner still held it. Plain locks go
    /// [`RENEW_BATCH`] to a script call, read-write locks' and semaphores'
    /// one each.
    pub(crate) async fn renew(&self, locks: &[Renewal<'_>]) -> RedisResult<Vec<bool>> {
        if self.cluster {
            return self.renew_each(locks).await;
        }
        // Each call: the locks it renews, by their place in `locks`.
        let mut calls: Vec<Vec<usize>> = Vec::new();
        let mut batch = Vec::new();
        for (at, lock) in locks.iter().enumerate() {
            if lock.shared {
                calls.push(vec![at]);
            } else {
                batch.push(at);
                if batch.len() == RENEW_BATCH {
                    calls.push(std::mem::take(&mut batch));
                }
            }
        }
        if !batch.is_empty() {
            calls.push(batch);
        }
        let pipeline = || {
            let mut pipe = redis::pipe();
            for call in &calls {
                let mut cmd = redis::cmd("EVALSHA");
                let first = locks[call[0]];
                if first.shared {
                    let (script, keys) = first.script(self.scripts());
                    cmd.arg(script.get_hash());
                    keys.write(&mut cmd, first.names);
                    cmd.arg(first.owner).arg(first.lease_ms);
                } else {
                    cmd.arg(self.scripts().renew_many.get_hash())
                        .arg(3 * call.len());
                    for &at in call {
                        let names = locks[at].names;
                        cmd.arg(&names.lock).arg(names.fence()).arg(names.value());
                    }
                    for &at in call {
                        cmd.arg(locks[at].owner).arg(locks[at].lease_ms);
                    }
                }
                pipe.add_command(cmd);
            }
            if let Some(wait) = self.wait_command() {
                // On the renewals' connection, right behind them.
                pipe.add_command(wait);
            }
            pipe
        };
        let mut conn = self.conn.clone();
        let mut answers: RedisResult<Vec<redis::Value>> = pipeline().query_async(&mut conn).await;
        if answers.as_ref().is_err_and(RedisError::is_io_error) {
            // The connection dropped (a restart, a network blip) and is
            // being re-established: renewing is idempotent, so try once more
            // rather than lose a tick.
            answers = pipeline().query_async(&mut conn).await;
        }
        let mut answers = match answers {
            // The script cache is empty after a restart or SCRIPT FLUSH:
            // load them, then send the batch again.
            Err(e) if e.kind() == ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.scripts().load(&mut conn).await?;
                pipeline().query_async(&mut conn).await?
            }
            other => other?,
        };
        if self.wait.is_some() {
            let acked = answers.pop().map(redis::from_redis_value).transpose()?;
            if let Some(acked) = self.short_of_replicas(acked) {
                // Unanswered, as far as the leases go: they run on from
                // the last renewal the replicas acknowledged.
                return Err(self.unacknowledged(acked));
            }
        }
        if answers.len() != calls.len() {
            return Err(RedisError::from((
                ErrorKind::Parse,
                "a renewal pipeline answered for another number of calls",
                format!("{} answers for {} calls", answers.len(), calls.len()),
            )));
        }
        let mut renewed = vec![false; locks.len()];
        for (call, answer) in calls.iter().zip(answers) {
            let answer: Vec<i64> = if locks[call[0]].shared {
                vec![redis::from_redis_value(answer)?]
            } else {
                redis::from_redis_value(answer)?
            };
            if answer.len() != call.len() {
                return Err(RedisError::from((
                    ErrorKind::Parse,
                    "a batch renewal answered for another number of locks",
                    format!("{} answers for {} locks", answer.len(), call.len()),
                )));
            }
            for (&at, answer) in call.iter().zip(answer) {
                renewed[at] = answer == 1;
            }
        }
        Ok(renewed)
    }

    /// [`renew`](Node::renew) on a cluster: the locks' keys are in many
    /// slots, so one script per lock, all sent at once on the multiplexed
    /// connection (which routes each to its slot's master).
    async fn renew_each(&self, locks: &[Renewal<'_>]) -> RedisResult<Vec<bool>> {
        let renewals = locks.iter().map(|lock| {
            let (script, keys) = lock.script(self.scripts());
            self.run(script, lock.names, keys, |cmd| {
                cmd.arg(lock.owner).arg(lock.lease_ms);
            })
        });
        join_all(renewals)
            .await
            .into_iter()
            .map(|answer: RedisResult<i64>| answer.map(|a| a == 1))
            .collect()
    }

    /// Publishes `value` as what `token`, the holder of the plain lock,
    /// says; `false` if it does not hold it.
    pub(crate) async fn proclaim(
        &self,
        names: &Names,
        token: &str,
        value: &[u8],
    ) -> RedisResult<bool> {
        let written: i64 = self
            .run(&self.scripts().proclaim, names, Keys::Value, |cmd| {
                cmd.arg(token).arg(value).arg(names.holder_channel());
            })
            .await?;
        Ok(written == 1)
    }

    /// The plain lock's holder: its fence, the lease it has left, and
    /// what it proclaimed.
    pub(crate) async fn holder(&self, names: &Names) -> RedisResult<Option<HolderRead>> {
        let read: Option<Vec<Vec<u8>>> = self
            .run(&self.scripts().holder, names, Keys::Value, |_| {})
            .await?;
        let Some(mut read) = read else {
            return Ok(None);
        };
        let value = (read.len() > 2).then(|| read.swap_remove(2));
        let number =
            |at: usize| -> Option<i64> { std::str::from_utf8(read.get(at)?).ok()?.parse().ok() };
        let fence = number(0)
            .and_then(|fence| u64::try_from(fence).ok())
            .filter(|&fence| fence > 0)
            .ok_or_else(|| {
                RedisError::from((
                    ErrorKind::Parse,
                    "the lock is held, but its fence counter is missing",
                ))
            })?;
        // A key without a TTL is not a lock of ours: no end to wait for.
        let lease_left = number(1)
            .and_then(|ms| u64::try_from(ms).ok())
            .map(Duration::from_millis);
        Ok(Some(HolderRead {
            fence,
            lease_left,
            value,
        }))
    }

    /// A handle on the node's multiplexed connection.
    pub(crate) fn connection(&self) -> Conn {
        self.conn.clone()
    }

    /// Whether any channel is subscribed now.
    pub(crate) fn watches_any(&self) -> bool {
        self.subscriber.watches_any()
    }

    /// Whether `channel` is subscribed now: the key has, or had a moment
    /// ago, a waiter in this process.
    pub(crate) fn is_watched(&self, channel: &str) -> bool {
        self.subscriber.is_live(channel)
    }

    /// Wakes `wake` whenever a release on `channel` names `token` first in
    /// line (and when the subscription had to be made again).
    pub(crate) async fn watch(
        &self,
        channel: &str,
        token: &str,
        wake: &std::sync::Arc<tokio::sync::Notify>,
    ) -> Result<Watch, RedisError> {
        self.subscriber.watch(channel, token, wake).await
    }
}
