//! Acquiring: one attempt on every node, and the wait in the key's line
//! (this process's local turn first, then the line on the nodes), for
//! plain locks and, on one node, read-write locks and semaphores.

use std::{sync::Arc, time::Duration};

use dlock_core::{
    backend::{AcquireRequest, Acquired, Backoff, LocalTurn, Mode, Share, Wait},
    LockError, Result,
};
use futures_util::{future::join_all, stream::FuturesUnordered, StreamExt};
use redis::{RedisError, RedisResult};
use tokio::{sync::Notify, time::Instant};

use super::{backend_error, bounded, timed_out, RedisBackend, REDLOCK_NODE_TIMEOUT_MAX};
use crate::{
    keys::{entry, names, shared_names, Names},
    node::{Attempt, Node, Place, SharedAttempt},
};

/// How long to wait for a release when the holder's TTL is unknown.
const UNKNOWN_TTL_RECHECK: Duration = Duration::from_millis(500);

/// The shortest cap on a waiter's ticket life (see
/// [`RedisBackend::ticket_life`]).
const TICKET_LIFE: Duration = Duration::from_secs(3);

/// A waiter's timers between attempts: the backoff while the servers fail
/// to answer, the fallback poll while no release channel can be watched,
/// and the pause until the next attempt, which a wake-up cuts short.
struct Pacing {
    deadline: Option<Instant>,
    /// The fallback poll while no release channel can be watched.
    poll: Backoff,
    /// The backoff while the servers fail to answer.
    failures: Backoff,
    failing_since: Option<Instant>,
    unreachable_after: Duration,
}

impl Pacing {
    /// The servers answered.
    fn answered(&mut self) {
        self.failing_since = None;
        self.failures.reset();
    }

    /// How long to wait after a refusal that names `retry_in`: that long
    /// when a release channel is watched; otherwise polled with backoff.
    fn held(&mut self, retry_in: Duration, watched: bool) -> Duration {
        if watched {
            return retry_in;
        }
        retry_in.min(self.poll.next_delay())
    }

    /// How long to back off after a failed attempt; the error, past the
    /// wait limit or (without one) once the servers stayed unreachable for
    /// `unreachable_after`.
    fn failed(&mut self, now: Instant, error: LockError) -> Result<Duration> {
        tracing::debug!(%error, "dlock redis acquire failed; retrying");
        let since = *self.failing_since.get_or_insert(now);
        let give_up = self.deadline.unwrap_or(since + self.unreachable_after);
        let delay = self.failures.next_delay();
        if now + delay >= give_up {
            return Err(error);
        }
        Ok(delay)
    }

    /// Sleeps `sleep` from `now`, or until the deadline or `wake`; `false`
    /// (at once) if the deadline has passed: the caller leaves the line.
    async fn pause(&self, now: Instant, sleep: Duration, wake: Option<&Arc<Notify>>) -> bool {
        let until = match self.deadline {
            Some(d) if d <= now => return false,
            Some(d) => d.min(now + sleep),
            None => now + sleep,
        };
        match wake {
            Some(wake) => tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep_until(until) => {}
            },
            None => tokio::time::sleep_until(until).await,
        }
        true
    }
}

/// The waiter's wake-up, made the first time it is asked for.
fn woken(wake: &mut Option<Arc<Notify>>) -> &Arc<Notify> {
    wake.get_or_insert_with(|| Arc::new(Notify::new()))
}

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
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    Duration::from_millis(10 + h.finish() % 50)
}

enum Round {
    Won(Acquired),
    Held {
        retry_in: Duration,
    },
    /// Granted, but too few replicas acknowledged it (this many did): the
    /// acquisition fails, and core gives the grant back, as for any
    /// acquisition that ends in an error.
    Unacknowledged(i64),
}

impl RedisBackend {
    /// How long a waiter's ticket (and a lock handed to it, until it takes
    /// it) lives after its last refresh: its lease, but no more than the
    /// longer of [`TICKET_LIFE`] and two response timeouts, so that a
    /// waiter that crashed in line holds it up for seconds whatever its
    /// lease, while a live one, refreshing every third of it, keeps its
    /// place through one slow answer.
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

    /// One acquire attempt on every node at once. A waiter (`place` other
    /// than [`Place::None`]) that is refused keeps its place in the key's
    /// line on every node.
    async fn attempt(
        &self,
        names: &Names,
        token: &str,
        lease: Duration,
        place: Place,
    ) -> Result<Round> {
        let lease_ms = lease.as_millis().max(1) as u64;
        let ticket_ms = self.ticket_life(lease).as_millis().max(1) as u64;
        let fence = self.inner.fences;
        let timeout = self.node_timeout(lease);
        let sent = Instant::now();
        let quorum = self.inner.quorum;
        let answers = match &self.inner.nodes[..] {
            [node] => {
                let step = node.acquire(names, token, lease_ms, fence, place, ticket_ms);
                let answers = vec![bounded(timeout, step).await];
                #[cfg(test)]
                if matches!(
                    answers[0],
                    Ok(Attempt::Acquired(_) | Attempt::Unacknowledged(_))
                ) {
                    super::hooks::granted(&names.lock).await;
                }
                self.observe(&answers);
                if let [Ok(Attempt::Unacknowledged(acked))] = answers[..] {
                    return Ok(Round::Unacknowledged(acked));
                }
                answers
            }
            nodes => {
                // Stop listening once a majority granted: the slower nodes'
                // answers cannot undo a won round. A late grant there is
                // ours, and a late refusal leaves our ticket; the release
                // (sent to every node) clears both.
                let mut pending: FuturesUnordered<_> = nodes
                    .iter()
                    .enumerate()
                    .map(|(i, node)| async move {
                        let step = node.acquire(names, token, lease_ms, fence, place, ticket_ms);
                        (i, bounded(timeout, step).await)
                    })
                    .collect();
                let mut answers: Vec<Option<RedisResult<Attempt>>> =
                    nodes.iter().map(|_| None).collect();
                let mut granted = 0;
                while let Some((i, answer)) = pending.next().await {
                    granted += usize::from(matches!(answer, Ok(Attempt::Acquired(_))));
                    answers[i] = Some(answer);
                    if granted >= quorum && within_validity(sent, lease) {
                        return Ok(Round::Won(Acquired::new(sent)));
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
        if won >= quorum && within_validity(sent, lease) {
            let acquired = Acquired::new(sent);
            return Ok(Round::Won(if fence {
                acquired.with_fence(fence_value)
            } else {
                acquired
            }));
        }
        if !give_back.is_empty() {
            // A partial grant, or replies that never came: give back what we
            // may hold there (release is owner-only, so this is safe where
            // we hold nothing), keeping our place in line. Awaited, not
            // spawned: the next attempt uses the same token, and a late
            // release would delete it. Each node's connection runs the
            // release after the acquire it may still be working on.
            let giving = give_back.iter().map(|&i| {
                bounded(
                    timeout,
                    self.inner.nodes[i].release(names, token, place, ticket_ms),
                )
            });
            let _ = join_all(giving).await;
        }
        let answered = won + frees_in.len();
        if answered < self.inner.quorum {
            // Without a majority answering, nobody can be granted the lock:
            // say so, instead of waiting as if someone held it.
            let detail = first_error.map_or_else(String::new, |e| e.to_string());
            return Err(backend_error(RedisError::from((
                redis::ErrorKind::Io,
                "too few nodes answered for a majority",
                format!(
                    "{answered} of {} answered, {} needed; {detail}",
                    self.inner.nodes.len(),
                    self.inner.quorum
                ),
            ))));
        }
        if won >= self.inner.quorum || (won > 0 && not_our_turn > 0) {
            // Too slow a round, or nodes that disagree on who is first in
            // line (a ticket that has not reached every node yet): the
            // round that follows finds every ticket on every node. Try
            // again after a short random delay, as Redlock prescribes.
            return Ok(Round::Held { retry_in: jitter() });
        }
        // The lock frees up when enough holders' TTLs run out for a
        // majority; a release before that wakes us if we are first in line.
        frees_in.sort_by_key(|ttl| ttl.unwrap_or(u64::MAX));
        let needed = self.inner.quorum.saturating_sub(won).max(1);
        let retry_in = frees_in
            .get(needed - 1)
            .or(frees_in.last())
            .copied()
            .flatten()
            .map(Duration::from_millis)
            .unwrap_or(UNKNOWN_TTL_RECHECK);
        Ok(Round::Held { retry_in })
    }

    pub(super) async fn acquire_waiting(
        &self,
        req: &AcquireRequest<'_>,
    ) -> Result<Option<Acquired>> {
        let names = names(&self.inner.prefix, req.key);
        let token = req.token.to_string();
        if req.wait == Wait::No {
            // One attempt, which does not queue.
            return match self.attempt(&names, &token, req.lease, Place::None).await? {
                Round::Won(acquired) => Ok(Some(acquired)),
                Round::Held { .. } => Ok(None),
                Round::Unacknowledged(acked) => Err(self.unacknowledged(acked)),
            };
        }
        let deadline = req.wait.deadline();
        // This process's waiters for the key queue here, first come first
        // served, and only the first of them stands in the key's line on
        // the servers: a release wakes one contender per process, and a
        // task that locks again at once queues behind the waiters already
        // there. An uncontended first attempt goes straight to the servers,
        // and stands in line only if it is refused.
        let contended = self.inner.local.busy(&names.lock) || {
            // Named only where some channel is watched at all: this runs
            // before every uncontended attempt.
            let nodes = &self.inner.nodes;
            nodes.iter().any(Node::watches_any) && {
                let channel = names.channel().to_string();
                nodes.iter().any(|n| n.is_watched(&channel))
            }
        };
        let mut turn = None;
        let mut place = Place::None;
        // A ticket lapses `ticket_life` after its last refresh: a waiter
        // that crashed holds up the line for at most that long, whatever
        // its lease.
        let refresh = self.ticket_life(req.lease) / 3;
        // Made at the first subscription: an uncontended lock needs none.
        let mut wake: Option<Arc<Notify>> = None;
        let mut watches = Vec::new();
        let mut subscribed = false;
        if contended {
            // Others wait here, or did a moment ago (the key's channel is
            // still subscribed): take our turn, and stand in line (with
            // the subscription made first) from the first attempt.
            match self.local_turn(&names.lock, deadline).await {
                Some(permit) => turn = Some(permit),
                None => return Ok(None),
            }
            place = self.line_place();
            subscribed = true;
            watches = self
                .watch_all(&names.channel().to_string(), &token, woken(&mut wake))
                .await;
        }
        let mut pacing = self.pacing(deadline);
        loop {
            let round = self.attempt(&names, &token, req.lease, place).await;
            let now = Instant::now();
            let sleep = match round {
                Ok(Round::Won(acquired)) => return Ok(Some(acquired)),
                Ok(Round::Unacknowledged(acked)) => return Err(self.unacknowledged(acked)),
                Ok(Round::Held { retry_in }) => {
                    pacing.answered();
                    if place == Place::None {
                        // Take this process's turn, then stand in line.
                        if turn.is_none() {
                            match self.local_turn(&names.lock, deadline).await {
                                Some(permit) => turn = Some(permit),
                                None => return Ok(None),
                            }
                        }
                        place = self.line_place();
                    }
                    if !subscribed {
                        // Subscribe, then check again at once (in line):
                        // a release between the attempt and the
                        // subscription would otherwise be missed.
                        subscribed = true;
                        watches = self
                            .watch_all(&names.channel().to_string(), &token, woken(&mut wake))
                            .await;
                        continue;
                    }
                    subscribed = !watches.is_empty();
                    pacing.held(retry_in.min(refresh), subscribed)
                }
                Err(error) => pacing.failed(now, error)?,
            };
            if !pacing.pause(now, sleep, wake.as_ref()).await {
                // Out of line, so that nobody waits for our turn. If no
                // node answers, the error has core release the token
                // again (a grant in the last instant included).
                self.release_names(&names, &token, self.node_timeout(req.lease))
                    .await?;
                return Ok(None);
            }
        }
    }

    /// The timers of one waiter with `deadline` (see [`Pacing`]).
    fn pacing(&self, deadline: Option<Instant>) -> Pacing {
        Pacing {
            deadline,
            poll: Backoff::new(Duration::from_millis(40), self.inner.unwatched_poll),
            failures: Backoff::new(Duration::from_millis(40), Duration::from_millis(500)),
            failing_since: None,
            unreachable_after: self.inner.unreachable_after,
        }
    }

    /// Acquires a read-write lock's share or a semaphore's permits (one
    /// node only: see `capabilities`). Every waiter stands in the object's
    /// line itself, and is woken by a release that names it once it is
    /// admitted; the retry the script answers covers a holder's lease or
    /// a waiter ahead that ran out with nobody told.
    pub(super) async fn acquire_shared(
        &self,
        req: &AcquireRequest<'_>,
    ) -> Result<Option<Acquired>> {
        let names = shared_names(&self.inner.prefix, req.key, req.mode);
        let entry = entry(req.token, req.mode);
        let token = req.token.to_string();
        let node = &self.inner.nodes[0];
        let lease_ms = req.lease.as_millis().max(1) as u64;
        let queue = req.wait != Wait::No;
        let deadline = req.wait.deadline();
        let refresh = req.lease / 3;
        let mut wake: Option<Arc<Notify>> = None;
        let mut watches = Vec::new();
        let mut subscribed = false;
        let mut pacing = self.pacing(deadline);
        loop {
            let sent = Instant::now();
            let answer = node
                .acquire_shared(&names, &entry, lease_ms, queue, lease_ms)
                .await;
            self.observe(std::slice::from_ref(&answer));
            let now = Instant::now();
            let sleep = match answer {
                Ok(SharedAttempt::Acquired(fence)) => {
                    let acquired = Acquired::new(sent);
                    return Ok(Some(if self.inner.fences {
                        acquired.with_fence(fence)
                    } else {
                        acquired
                    }));
                }
                Ok(SharedAttempt::Unacknowledged(acked)) => return Err(self.unacknowledged(acked)),
                Ok(SharedAttempt::OtherLimit(theirs)) => {
                    let ours = match req.mode {
                        Mode::Permits { limit, .. } => limit,
                        _ => 0,
                    };
                    return Err(LockError::permit_limit_mismatch(req.key, theirs, ours));
                }
                Ok(SharedAttempt::Held(_)) if !queue => return Ok(None),
                Ok(SharedAttempt::Held(retry_in)) => {
                    pacing.answered();
                    if !subscribed {
                        // Subscribe, then check again at once (in line):
                        // a release between the attempt and the
                        // subscription would otherwise be missed.
                        subscribed = true;
                        watches = self
                            .watch_all(&names.channel().to_string(), &token, woken(&mut wake))
                            .await;
                        continue;
                    }
                    let retry_in = retry_in
                        .map_or(UNKNOWN_TTL_RECHECK, Duration::from_millis)
                        .min(refresh);
                    subscribed = !watches.is_empty();
                    pacing.held(retry_in, subscribed)
                }
                Err(error) if !queue => return Err(backend_error(error)),
                Err(error) => pacing.failed(now, backend_error(error))?,
            };
            if !pacing.pause(now, sleep, wake.as_ref()).await {
                // Out of line, so that nobody waits for our turn: the
                // entry lives for the lease, so a failure is an error,
                // and core releases the token again.
                node.release_shared(&names, &entry)
                    .await
                    .map_err(backend_error)?;
                return Ok(None);
            }
        }
    }

    /// The error of a grant that only `acked` replicas acknowledged.
    fn unacknowledged(&self, acked: i64) -> LockError {
        backend_error(self.inner.nodes[0].unacknowledged(acked))
    }

    /// A waiter's place in line: by the node's clock on one node, by the
    /// waiter's on Redlock (see the type's docs).
    fn line_place(&self) -> Place {
        if self.inner.redlock {
            Place::At(unix_micros())
        } else {
            Place::Last
        }
    }

    /// This process's turn to wait for `lock` on the servers; `None` if the
    /// deadline passed first. Local waiters queue in FIFO order, so a
    /// release wakes one contender per process, not all of its tasks: a
    /// herd of local tasks would split Redlock votes among themselves.
    async fn local_turn(&self, lock: &str, deadline: Option<Instant>) -> Option<LocalTurn<String>> {
        let wait = deadline.map_or(Wait::Forever, Wait::Until);
        self.inner
            .local
            .take(&lock.to_owned(), Share::Alone, wait)
            .await
    }

    /// Registers `wake` for the releases that name `token` on every node
    /// that can be reached; a node whose subscription fails is covered by
    /// the TTL bound and the ticket refresh.
    async fn watch_all(
        &self,
        channel: &str,
        token: &str,
        wake: &Arc<Notify>,
    ) -> Vec<crate::subscriber::Watch> {
        let within = self.inner.subscribe_timeout;
        self.on_every_node(Some(within), |node| node.watch(channel, token, wake))
            .await
            .into_iter()
            .filter_map(|w| {
                w.inspect_err(|error| tracing::debug!(%error, "dlock redis subscribe failed"))
                    .ok()
            })
            .collect()
    }
}
