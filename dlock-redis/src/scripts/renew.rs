//! Renewals: the plain lock's scripts, and the batch of a watchdog tick
//! on one node (read-write locks' and semaphores' renew one by one, with
//! `SHARED_RENEW`).

use futures_util::future::join_all;
use redis::{ErrorKind, RedisError, RedisResult};

use super::{of, Keys, Scripts};
use crate::{keys::Names, node::Node};

/// How many plain locks one batch renewal renews (a `GET` and three
/// `PEXPIRE`s each): few enough that a lock's request waiting behind the
/// call is not held up for long.
const RENEW_BATCH: usize = 256;

/// One lock for [`renew`].
#[derive(Debug, Clone)]
pub(crate) struct Renewal {
    /// Its names (`shared_names` for a read-write lock or semaphore).
    pub(crate) names: Names,
    /// The token of a plain lock; the entry of a shared one.
    pub(crate) owner: String,
    /// Whether it is a read-write lock's or a semaphore's.
    pub(crate) shared: bool,
    /// The new lease.
    pub(crate) lease_ms: u64,
}

impl Renewal {
    /// The script that renews it, and the names that script takes.
    fn script<'s>(&self, scripts: &'s Scripts) -> (&'s redis::Script, Keys) {
        if self.shared {
            (&scripts.shared_renew, Keys::Lock)
        } else {
            (&scripts.renew, Keys::Value)
        }
    }
}

/// Renews every lock in `locks` for its lease, in one pipelined round
/// trip; `true` where its owner still held it. Plain locks go
/// [`RENEW_BATCH`] to a call, read-write locks' and semaphores' one each.
pub(crate) async fn renew(node: &Node, locks: &[Renewal]) -> RedisResult<Vec<bool>> {
    if node.cluster {
        return renew_each(node, locks).await;
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
    let wait = node.wait_command();
    let pipeline = || {
        let mut pipe = redis::pipe();
        for call in &calls {
            let mut cmd = redis::cmd("EVALSHA");
            let first = &locks[call[0]];
            if first.shared {
                let (script, keys) = first.script(of(node));
                cmd.arg(script.get_hash());
                keys.write(&mut cmd, &first.names);
                cmd.arg(&first.owner).arg(first.lease_ms);
            } else {
                cmd.arg(of(node).renew_many.get_hash()).arg(3 * call.len());
                for &at in call {
                    let names = &locks[at].names;
                    cmd.arg(&names.lock).arg(names.fence()).arg(names.value());
                }
                for &at in call {
                    cmd.arg(&locks[at].owner).arg(locks[at].lease_ms);
                }
            }
            pipe.add_command(cmd);
        }
        if let Some(wait) = &wait {
            // On the renewals' connection, right behind them.
            pipe.add_command(wait.clone());
        }
        pipe
    };
    let mut conn = node.connection();
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
            of(node).load(&mut conn).await?;
            pipeline().query_async(&mut conn).await?
        }
        other => other?,
    };
    if wait.is_some() {
        let acked = answers.pop().map(redis::from_redis_value).transpose()?;
        if let Some(acked) = node.short_of_replicas(acked) {
            // Unanswered, as far as the leases go: they run on from
            // the last renewal the replicas acknowledged.
            return Err(node.unacknowledged(acked));
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

/// [`renew`] on a cluster, whose locks are in many slots: one script per
/// lock, all sent at once (the connection routes each to its master).
async fn renew_each(node: &Node, locks: &[Renewal]) -> RedisResult<Vec<bool>> {
    let renewals = locks.iter().map(|lock| {
        let (script, keys) = lock.script(of(node));
        node.run(script, false, move |cmd| {
            keys.write(cmd, &lock.names);
            cmd.arg(&lock.owner).arg(lock.lease_ms);
        })
    });
    join_all(renewals)
        .await
        .into_iter()
        .map(|answer: RedisResult<(i64, _)>| answer.map(|(a, _)| a == 1))
        .collect()
}

/// `renew(lock, counter, value, token, lease)`, the body of [`RENEW`] and
/// [`RENEW_MANY`]: if the token holds the lock (marked or not), extends
/// its lease, and the life of its fence counter and proclaimed value.
/// Returns 1 if renewed, else 0.
macro_rules! renew_lua {
    () => {
        r"
local function renew(lock, counter, value, token, lease)
  local holder = redis.call('GET', lock)
  if holder and string.match(holder, '^[^~+]*') == token then
    redis.call('PEXPIRE', counter, math.max(2 * lease, 600000))
    redis.call('PEXPIRE', value, 2 * lease)
    return redis.call('PEXPIRE', lock, lease)
  end
  return 0
end
"
    };
}

/// Renews one lock (see `renew_lua!`).
///
/// KEYS: lock, fence counter, proclaimed value. ARGV: token, lease in ms.
/// Returns 1 if renewed, else 0.
pub(super) const RENEW: &str = concat!(
    renew_lua!(),
    "return renew(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])\n"
);

/// Renews many locks of one node in one call (see `renew_lua!`). KEYS:
/// each lock's lock, fence counter and value, in turn. ARGV: each lock's
/// token and lease in ms, in order. Returns 1 or 0 for each, in order.
pub(super) const RENEW_MANY: &str = concat!(
    renew_lua!(),
    r"
local renewed = {}
for i = 1, #KEYS / 3 do
  renewed[i] = renew(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], ARGV[2 * i - 1], ARGV[2 * i])
end
return renewed
"
);
