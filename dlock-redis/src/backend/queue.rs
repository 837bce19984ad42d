//! Acquiring: the wait steps core's engine runs
//! ([`drive`](dlock_core::backend::wait::drive)). A look is one attempt
//! on every node; a refused waiter stands in the key's line on the
//! servers (a plain lock's with this process's turn at the key, so a
//! release wakes one contender per process), subscribed to the key's
//! release channel, and is woken by the release that names it.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use dlock_core::{
    backend::{
        wait::{Armed, Look, StepError, TurnAt, WaitSteps, Woken},
        AcquireRequest, Acquired, Backoff, Mode, Share,
    },
    LockError,
};
use futures_util::{future::join_all, stream::FuturesUnordered, StreamExt};
use redis::{RedisError, RedisResult};
use tokio::{sync::Notify, time::Instant};

use super::{backend_error, bounded, timed_out, RedisBackend, REDLOCK_NODE_TIMEOUT_MAX};
use crate::{
    keys::{entry, names, shared_names, Names},
    scripts::{
        lock::{self, Attempt, Place},
        shared::{self, SharedAttempt},
    },
    subscriber::Watch,
};

/// How long to wait for a release when the holder's TTL is unknown.
const UNKNOWN_TTL_RECHECK: Duration = Duration::from_millis(500);

/// How long an unfair Redlock waiter told of a release waits for the
/// release to reach the other nodes before it looks.
const REDLOCK_SETTLE: Duration = Duration::from_micros(500);

/// The shortest cap on a waiter's ticket life (see
/// [`RedisBackend::ticket_life`]).
const TICKET_LIFE: Duration = Duration::from_secs(3);

/// Redlock's validity: whether time is left on a lease whose round was
/// sent at `sent`, after the round and the clock drift.
fn within_validity(sent: Instant, lease: Duration) -> bool {
    let drift = lease / 100 + Duration::from_millis(2);
    sent.elapsed() + drift < lease
}

/// The wall clock in µs: a Redlock waiter's place in line, the same on
/// every node.
fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A random delay of 10 to 60 ms.
fn jitter() -> Duration {
    Duration::from_millis(10) + random_below(Duration::from_millis(50))
}

/// A random delay below `most`.
fn random_below(most: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(1);
    let most = most.as_micros().max(1) as u64;
    Duration::from_micros(h.finish() % most)
}

/// The longest pause of an unfair waiter refused again and again before
/// it answers a wake-up.
const UNFAIR_PAUSE: Duration = Duration::from_millis(32);

/// A refusal: look again within `retry_in` at the latest.
fn refused(retry_in: Duration) -> Look<Waiting> {
    Look::Refused {
        entry: None,
        again: Some(retry_in),
    }
}

impl RedisBackend {
    /// How long a waiter's ticket (and a lock handed to it) lives after
    /// its last refresh: its lease, but at most the longer of
    /// [`TICKET_LIFE`] and two response timeouts, so a crashed waiter
    /// holds the line up for seconds while a live one, refreshing every
    /// third of it, survives one slow answer.
    fn ticket_life(&self, lease: Duration) -> Duration {
        lease.min(TICKET_LIFE.max(self.inner.subscribe_timeout * 2))
    }

    /// How long one node may take to answer one step: for Redlock much
    /// shorter than the lease, so a slow node cannot eat the validity.
    fn node_timeout(&self, lease: Duration) -> Option<Duration> {
        let floor = Duration::from_millis(50).min(lease / 3);
        self.inner
            .redlock
            .then(|| (lease / 10).max(floor).min(REDLOCK_NODE_TIMEOUT_MAX))
    }

    /// A grant of a round sent at `sent`: with `fence` if locks carry
    /// fencing tokens.
    fn granted(&self, sent: Instant, fence: u64) -> Look<Waiting> {
        let acquired = Acquired::new(sent);
        Look::Granted(if self.inner.fences {
            acquired.with_fence(fence)
        } else {
            acquired
        })
    }

    /// A grant too few replicas acknowledged fails; core gives it back.
    fn unacknowledged(&self, acked: i64) -> StepError {
        StepError::Fatal(backend_error(self.inner.nodes[0].unacknowledged(acked)))
    }
}

/// The wait steps of one acquire: a plain lock's on every node, or a
/// read-write lock's or semaphore's on the one node.
pub(super) struct Steps<'a> {
    backend: &'a RedisBackend,
    names: Names,
    token: String,
    /// What the lock's key holds when granted: the token and the note.
    value: String,
    /// A read-write lock's or semaphore's holder or waiter on the server
    /// (see [`entry`]); `None` for a plain lock.
    member: Option<String>,
    /// The longest pause between two looks: a third of the ticket's life.
    refresh: Duration,
    /// A Redlock waiter's place in line, the same on every node: its clock
    /// when it first stood in line (one node places a waiter by its own
    /// clock).
    place: OnceLock<Place>,
    /// A plain lock taken unfairly (see `RedisConfig::fair`): no line, no
    /// turn; a waiter marks the holder's value and waits for its release.
    unfair: bool,
    /// The holder's lease: a grant is worth having, and a ticket lives,
    /// by it, not by the lock delay the server's lease adds.
    holder_lease: Duration,
}

/// A waiter in the key's line: its wake-up and subscriptions.
pub(super) struct Waiting {
    wake: Arc<Notify>,
    /// The nodes whose release channel wakes us (those that could be
    /// subscribed).
    watches: Vec<Watch>,
    /// Whether the look that stood in line subscribed: the arm right
    /// after it does not try again.
    subscribed_now: bool,
    /// The pause between looks while no channel is watched.
    poll: Backoff,
    /// Unfair looks refused in a row.
    refused: u32,
}

impl<'a> Steps<'a> {
    pub(super) fn new(backend: &'a RedisBackend, req: &AcquireRequest<'_>) -> Steps<'a> {
        let prefix = &backend.inner.prefix;
        let (names, member, refresh) = match req.mode {
            Mode::Exclusive => (
                names(prefix, req.key),
                None,
                backend.ticket_life(req.holder_lease()) / 3,
            ),
            mode => (
                shared_names(prefix, req.key, mode),
                Some(entry(req.token, mode)),
                req.lease / 3,
            ),
        };
        Steps {
            backend,
            unfair: member.is_none() && !req.fair.unwrap_or(backend.inner.fair),
            names,
            token: req.token.to_string(),
            value: lock::value(&req.token.to_string(), req.note),
            member,
            refresh,
            place: OnceLock::new(),
            holder_lease: req.holder_lease(),
        }
    }

    /// Registers `wake` for the releases that name our token on every
    /// node that can be reached (the others are covered by the TTL bound
    /// and the ticket refresh).
    async fn watch_all(&self, wake: &Arc<Notify>) -> Vec<Watch> {
        let within = self.backend.inner.subscribe_timeout;
        let channel = self.names.channel().to_string();
        self.backend
            .on_every_node(Some(within), |node| {
                node.subscriber.watch(&channel, &self.token, wake)
            })
            .await
            .into_iter()
            .filter_map(|w| {
                w.inspect_err(|error| tracing::debug!(%error, "dlock redis subscribe failed"))
                    .ok()
            })
            .collect()
    }

    /// One attempt at a plain lock on every node at once. A waiter
    /// (`place` other than [`Place::None`]) that is refused keeps its
    /// place in the key's line on every node.
    async fn attempt(&self, lease: Duration, place: Place) -> Result<Look<Waiting>, StepError> {
        let backend = self.backend;
        let (names, token) = (&self.names, self.token.as_str());
        let value = self.value.as_str();
        let lease_ms = lease.as_millis().max(1) as u64;
        let ticket_ms = backend.ticket_life(self.holder_lease).as_millis().max(1) as u64;
        let fence = backend.inner.fences;
        let timeout = backend.node_timeout(self.holder_lease);
        let nodes = &backend.inner.nodes;
        if place == Place::Mark && nodes.len() > 1 {
            // An unfair Redlock waiter tries one node alone: refused there,
            // it has marked that node's hold and waits again, at the cost
            // of one request, not one per node. Granted there (or
            // unanswered: the next waiter tries the next node), the whole
            // round follows, on every node.
            let probe = &backend.inner.probe;
            let at = probe.load(std::sync::atomic::Ordering::Relaxed) % nodes.len();
            let step = lock::acquire(&nodes[at], names, value, lease_ms, fence, place, ticket_ms);
            let answer = bounded(timeout, step).await;
            if answer.is_err() {
                probe.store(at + 1, std::sync::atomic::Ordering::Relaxed);
            }
            match answer {
                Ok(Attempt::Held(ttl)) => {
                    return Ok(refused(
                        ttl.map_or(UNKNOWN_TTL_RECHECK, Duration::from_millis),
                    ))
                }
                Ok(Attempt::NotOurTurn(lapses)) => {
                    return Ok(refused(Duration::from_millis(lapses)))
                }
                _ => {}
            }
        }
        let sent = Instant::now();
        let quorum = backend.inner.quorum;
        let answers = match &backend.inner.nodes[..] {
            [node] => {
                let step = lock::acquire(node, names, value, lease_ms, fence, place, ticket_ms);
                let answers = vec![bounded(timeout, step).await];
                #[cfg(test)]
                if matches!(
                    answers[0],
                    Ok(Attempt::Acquired(_) | Attempt::Unacknowledged(_))
                ) {
                    super::hooks::granted(&names.lock).await;
                }
                backend.observe(&answers);
                if let [Ok(Attempt::Unacknowledged(acked))] = answers[..] {
                    return Err(backend.unacknowledged(acked));
                }
                answers
            }
            nodes => {
                // A majority granted: the slower nodes cannot undo it (the
                // release, sent to every node, clears what they leave).
                let mut pending: FuturesUnordered<_> = nodes
                    .iter()
                    .enumerate()
                    .map(|(i, node)| async move {
                        let step =
                            lock::acquire(node, names, value, lease_ms, fence, place, ticket_ms);
                        (i, bounded(timeout, step).await)
                    })
                    .collect();
                let mut answers: Vec<Option<RedisResult<Attempt>>> =
                    nodes.iter().map(|_| None).collect();
                let mut granted = 0;
                while let Some((i, answer)) = pending.next().await {
                    granted += usize::from(matches!(answer, Ok(Attempt::Acquired(_))));
                    answers[i] = Some(answer);
                    if granted >= quorum && within_validity(sent, self.holder_lease) {
                        return Ok(Look::Granted(Acquired::new(sent)));
                    }
                }
                answers
                    .into_iter()
                    .map(|a| a.unwrap_or_else(|| Err(timed_out())))
                    .collect()
            }
        };
        let mut won = 0;
        let mut fence_value = 0;
        let mut not_our_turn = 0;
        // Per node that refused: how long until it may grant.
        let mut frees_in = Vec::new();
        let mut give_back = Vec::new();
        let mut first_error = None;
        for (i, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(Attempt::Acquired(f)) => {
                    won += 1;
                    fence_value = f;
                    give_back.push(i);
                }
                Ok(Attempt::Held(ttl)) => frees_in.push(ttl),
                Ok(Attempt::NotOurTurn(lapses)) => {
                    not_our_turn += 1;
                    frees_in.push(Some(lapses));
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    give_back.push(i);
                }
                // Only one node waits for replicas (answered above).
                Ok(Attempt::Unacknowledged(_)) => give_back.push(i),
            }
        }
        if won >= quorum && within_validity(sent, self.holder_lease) {
            return Ok(backend.granted(sent, fence_value));
        }
        if !give_back.is_empty() {
            // A partial grant, or replies that never came: give back what
            // we may hold (owner-only), keeping our place. Awaited: the
            // next attempt's same token must not meet a late release.
            let giving = give_back.iter().map(|&i| {
                bounded(
                    timeout,
                    lock::release(&backend.inner.nodes[i], names, token, place, ticket_ms),
                )
            });
            let _ = join_all(giving).await;
        }
        let answered = won + frees_in.len();
        if answered < quorum {
            // Without a majority answering, nobody can be granted: say so.
            let detail = first_error.map_or_else(String::new, |e| e.to_string());
            return Err(StepError::Retry(backend_error(RedisError::from((
                redis::ErrorKind::Io,
                "too few nodes answered for a majority",
                format!(
                    "{answered} of {} answered, {quorum} needed; {detail}",
                    backend.inner.nodes.len(),
                ),
            )))));
        }
        if won >= quorum || (won > 0 && not_our_turn > 0) {
            // Too slow a round, or nodes that disagree on who is first (a
            // ticket not yet on every node): again after a random delay.
            return Ok(refused(jitter()));
        }
        // Free when enough holders' TTLs run out for a majority, unless a
        // release wakes us first.
        frees_in.sort_by_key(|ttl| ttl.unwrap_or(u64::MAX));
        let needed = quorum.saturating_sub(won).max(1);
        let retry_in = frees_in
            .get(needed - 1)
            .or(frees_in.last())
            .copied()
            .flatten()
            .map_or(UNKNOWN_TTL_RECHECK, Duration::from_millis);
        Ok(refused(retry_in))
    }

    /// One attempt at a read-write lock's share or a semaphore's permits
    /// (one node only: see `capabilities`); with `queue`, one that is
    /// refused stands last in the object's line.
    async fn attempt_shared(
        &self,
        req: &AcquireRequest<'_>,
        member: &str,
        queue: bool,
    ) -> Result<Look<Waiting>, StepError> {
        let backend = self.backend;
        let lease_ms = req.lease.as_millis().max(1) as u64;
        let sent = Instant::now();
        let answer = shared::acquire(
            &backend.inner.nodes[0],
            &self.names,
            member,
            lease_ms,
            queue,
        )
        .await;
        backend.observe(std::slice::from_ref(&answer));
        match answer.map_err(|e| StepError::Retry(backend_error(e)))? {
            SharedAttempt::Acquired(fence) => Ok(backend.granted(sent, fence)),
            SharedAttempt::Unacknowledged(acked) => Err(backend.unacknowledged(acked)),
            SharedAttempt::OtherLimit(theirs) => {
                let ours = match req.mode {
                    Mode::Permits { limit, .. } => limit,
                    _ => 0,
                };
                Err(StepError::Fatal(LockError::permit_limit_mismatch(
                    req.key, theirs, ours,
                )))
            }
            SharedAttempt::Held(retry_in) => Ok(refused(
                retry_in.map_or(UNKNOWN_TTL_RECHECK, Duration::from_millis),
            )),
        }
    }
}

impl WaitSteps for Steps<'_> {
    type TurnKey = String;
    type Entry = Waiting;
    type Wake = ();

    /// One attempt. One that stands in line for a plain lock subscribes
    /// first: then the attempt itself is the look after the subscription,
    /// and a contended acquire costs no extra round trip. Unfair, the
    /// first attempt is a plain one, and a refused waiter's entry holds
    /// nothing on the server: its arm subscribes, and its next attempts
    /// mark the holder's value instead of standing in line.
    async fn look(
        &self,
        req: &AcquireRequest<'_>,
        waiting: Option<&mut Waiting>,
        join: bool,
    ) -> Result<Look<Waiting>, StepError> {
        let new = || Waiting {
            wake: Arc::new(Notify::new()),
            watches: Vec::new(),
            subscribed_now: false,
            poll: Backoff::new(Duration::from_millis(40), self.backend.inner.unwatched_poll),
            refused: 0,
        };
        if self.unfair {
            let place = if waiting.is_some() {
                Place::Mark
            } else {
                Place::None
            };
            let look = self.attempt(req.lease, place).await?;
            let Look::Refused { again, .. } = look else {
                return Ok(look);
            };
            let mut made = (waiting.is_none() && join).then(new);
            let again = again.map(|again| match waiting.or(made.as_mut()) {
                Some(w) => {
                    w.refused = w.refused.saturating_add(1);
                    if w.watches.is_empty() {
                        again.min(w.poll.next_delay())
                    } else {
                        again
                    }
                }
                None => again,
            });
            return Ok(Look::Refused { entry: made, again });
        }
        let mut made = None;
        if waiting.is_none() && join {
            let mut new = new();
            if self.member.is_none() {
                new.watches = self.watch_all(&new.wake).await;
                new.subscribed_now = true;
            }
            made = Some(new);
        }
        let in_line = waiting.is_some() || made.is_some();
        let look = match &self.member {
            None => {
                let place = if !in_line {
                    Place::None
                } else if self.backend.inner.redlock {
                    *self.place.get_or_init(|| Place::At(unix_micros()))
                } else {
                    Place::Last
                };
                self.attempt(req.lease, place).await?
            }
            Some(member) => self.attempt_shared(req, member, in_line).await?,
        };
        let Look::Refused { again, .. } = look else {
            return Ok(look);
        };
        let again = again.map(|again| match waiting.or(made.as_mut()) {
            Some(w) if w.watches.is_empty() => again.min(self.refresh).min(w.poll.next_delay()),
            _ => again.min(self.refresh),
        });
        Ok(Look::Refused { entry: made, again })
    }

    /// Subscribes to the key's release channel where the look did not:
    /// then a look again, since a release between the last look and the
    /// subscription woke nobody.
    async fn arm(
        &self,
        _req: &AcquireRequest<'_>,
        waiting: &mut Waiting,
        _wake: &mut Option<()>,
    ) -> Result<Armed, StepError> {
        if !waiting.watches.is_empty() || std::mem::take(&mut waiting.subscribed_now) {
            return Ok(Armed::Wait);
        }
        waiting.watches = self.watch_all(&waiting.wake).await;
        Ok(if waiting.watches.is_empty() {
            Armed::Wait
        } else {
            Armed::LookAgain
        })
    }

    async fn changed(
        &self,
        _req: &AcquireRequest<'_>,
        waiting: &mut Waiting,
        _wake: &mut Option<()>,
        until: Instant,
    ) -> Result<Woken, StepError> {
        if self.unfair && waiting.refused > 2 {
            // Refused after a wake-up, again and again: others take the
            // key as it frees. A random pause (longer the more often
            // refused, at most `UNFAIR_PAUSE`) before answering the next
            // wake-up spares the servers a look per waiter and release.
            let most = UNFAIR_PAUSE.min(Duration::from_millis(1 << waiting.refused.min(8)));
            tokio::time::sleep_until(until.min(Instant::now() + random_below(most))).await;
        }
        // A release that named us before the wait left its permit.
        let woken = tokio::time::timeout_at(until, waiting.wake.notified()).await;
        if woken.is_ok() && self.unfair && self.backend.inner.nodes.len() > 1 {
            // A release reaches the nodes one by one, and each marked one
            // tells us: one look once the release had time to reach them
            // all.
            tokio::time::sleep(REDLOCK_SETTLE).await;
            let _ = futures_util::FutureExt::now_or_never(waiting.wake.notified());
        }
        Ok(Woken::LookAgain)
    }

    /// Out of line, so that nobody waits for our turn. If no node
    /// answers, the error has core release the token again (a grant in
    /// the last instant included). Unfair, there is no line to leave.
    async fn withdraw(&self, req: &AcquireRequest<'_>, _: Waiting) -> Result<(), StepError> {
        let left = match &self.member {
            None if self.unfair => Ok(()),
            None => {
                let timeout = self.backend.node_timeout(req.holder_lease());
                self.backend
                    .release_names(&self.names, &self.token, timeout)
                    .await
                    .map(drop)
            }
            Some(member) => shared::release(&self.backend.inner.nodes[0], &self.names, member)
                .await
                .map(drop)
                .map_err(backend_error),
        };
        left.map_err(StepError::Fatal)
    }

    fn unreachable_after(&self) -> Duration {
        self.backend.inner.unreachable_after
    }

    /// A fair plain lock's: this process's waiters take their turn before one
    /// stands in line, from the first attempt when the key is contended
    /// here (a task waits, or its channel is still watched), so a task
    /// that locks again at once queues behind the waiters already there.
    fn turn(&self, _req: &AcquireRequest<'_>) -> Option<TurnAt<'_, String>> {
        if self.member.is_some() || self.unfair {
            return None;
        }
        let inner = &self.backend.inner;
        let lock = &self.names.lock;
        let first = inner.local.busy(lock) || {
            // Named only where some channel is watched at all: this runs
            // before every uncontended attempt.
            inner.nodes.iter().any(|n| n.subscriber.watches_any()) && {
                let channel = self.names.channel().to_string();
                inner.nodes.iter().any(|n| n.subscriber.is_live(&channel))
            }
        };
        Some(TurnAt {
            turns: &inner.local,
            key: lock.clone(),
            share: Share::Alone,
            first,
        })
    }
}
