//! Read-write locks' and semaphores' scripts: acquire, release and renew
//! of an entry among a key's holders, their arguments and answers.

use std::sync::OnceLock;

use dlock_core::backend::Mode;
use redis::{RedisResult, Script};

use super::{lock::Place, of, Keys};
use crate::{keys::Names, node::Node};

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

/// One attempt at a read-write lock or semaphore (`names` from
/// `shared_names`, `entry` from `keys::entry`); with `queue`, one that is
/// refused stands last in line, its ticket lapsing with its lease.
pub(crate) async fn acquire(
    node: &Node,
    names: &Names,
    entry: &str,
    lease_ms: u64,
    queue: bool,
) -> RedisResult<SharedAttempt> {
    let ((status, value), acked): ((i64, i64), _) = node
        .run(&of(node).shared_acquire, true, |cmd| {
            Keys::Line.write(cmd, names);
            cmd.arg(entry)
                .arg(lease_ms)
                .arg(if queue { "1" } else { "0" })
                .arg(Place::Last)
                .arg(lease_ms);
        })
        .await?;
    Ok(match status {
        1 => match node.short_of_replicas(acked) {
            Some(acked) => SharedAttempt::Unacknowledged(acked),
            None => SharedAttempt::Acquired(u64::try_from(value).unwrap_or(0)),
        },
        3 => SharedAttempt::OtherLimit(u32::try_from(value).unwrap_or(0)),
        _ => SharedAttempt::Held(u64::try_from(value).ok()),
    })
}

/// Takes `entry` out of a read-write lock's or semaphore's holders and
/// line, and wakes the waiters that are now admitted; `true` if it held.
pub(crate) async fn release(node: &Node, names: &Names, entry: &str) -> RedisResult<bool> {
    let (released, _): (i64, _) = node
        .run(&of(node).shared_release, false, |cmd| {
            Keys::Line.write(cmd, names);
            cmd.arg(entry).arg(names.channel());
        })
        .await?;
    Ok(released == 1)
}

/// What read-write locks and semaphores share: an entry's mode, the
/// admission rule, and keeping keys alive. `KEYS[1]` is the holders (a
/// sorted set of entries scored by when their lease ends, in server ms),
/// `KEYS[2]` the fence counter, `KEYS[3]` and `KEYS[4]` the waiting line
/// as the plain lock's; an entry is `keys::entry`.
macro_rules! shared_lua {
    () => {
        r"
-- What an entry takes: 'r', 'w' or 'p' (with its count and limit); '?'
-- for an entry this version cannot read, which blocks everything behind.
local function parse(entry)
  local tag = string.match(entry, '|([^|]*)$') or ''
  if tag == 'r' or tag == 'w' then return tag, 0, 0 end
  local count, limit = string.match(tag, '^p(%d+)/(%d+)$')
  if count then return 'p', tonumber(count), tonumber(limit) end
  return '?', 0, 0
end
-- First come, first served (dlock_core::backend::admitted): a reader
-- holds when no writer is ahead, permits when those ahead and its own fit
-- the limit, a writer when nothing is ahead.
local function admitted(entry, ahead)
  local kind, count, limit = parse(entry)
  if kind == 'r' then
    for _, other in ipairs(ahead) do
      if parse(other) ~= 'r' then return false end
    end
    return true
  end
  if kind == 'p' then
    local taken = count
    for _, other in ipairs(ahead) do
      local k, c = parse(other)
      if k ~= 'p' then return false end
      taken = taken + c
      if taken > limit then return false end
    end
    return taken <= limit
  end
  return #ahead == 0
end
-- Drops holders whose lease ended (scored at or before `now`).
local function prune_holders(now)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
end
-- Keeps a key alive for at least `ms`.
local function keep(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end
"
    };
}

/// The permits the semaphore's holders take whose lease has not ended
/// by the server's clock, read with that clock in one script.
pub(crate) async fn permits_taken(node: &Node, names: &Names) -> RedisResult<u32> {
    static READ: OnceLock<Script> = OnceLock::new();
    let read = READ.get_or_init(|| {
        Script::new(
            "local t = redis.call('TIME') \
             return {t[1], t[2], redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}",
        )
    });
    let (secs, micros, holders): (u64, u64, Vec<(String, f64)>) = read
        .key(&names.lock)
        .invoke_async(&mut node.connection())
        .await?;
    let now_ms = (secs * 1000 + micros / 1000) as f64;
    Ok(holders
        .iter()
        .filter(|(_, ends)| *ends > now_ms)
        .filter_map(
            |(entry, _)| match Mode::from_tag(entry.rsplit('|').next()?)? {
                Mode::Permits { count, .. } => Some(count),
                _ => None,
            },
        )
        .sum())
}

/// A read-write lock's or a semaphore's acquire, in one round trip.
///
/// KEYS: see `shared_lua!`. ARGV: entry, lease in ms, "1" to stand in line
/// if refused, the place in line ("0": last), ticket lifetime in ms. An
/// entry holds when it is admitted behind every live holder and every
/// live waiter ahead of it, so a waiting writer keeps later readers out.
/// Returns `{1, fence}` when it holds (again after a lost reply too, with
/// a new fence); `{0, ms}` when refused, `ms` until a holder's lease or a
/// ticket ahead runs out (-1 if none); `{3, limit}` when the semaphore's
/// entries name another limit (the entry leaves the line).
pub(super) const SHARED_ACQUIRE: &str = concat!(
    fence_lua!(),
    queue_lua!(),
    shared_lua!(),
    r"
local entry, lease = ARGV[1], tonumber(ARGV[2])
local now_us, now = clock()
local function hold()
  redis.call('ZREM', KEYS[3], entry)
  redis.call('ZREM', KEYS[4], entry)
  redis.call('ZADD', KEYS[1], now + lease, entry)
  keep(KEYS[1], lease)
  return {1, fence(lease, true)}
end
prune_holders(now)
prune(now)
if redis.call('ZSCORE', KEYS[1], entry) then
  -- Ours already: the reply to the attempt that won it was lost.
  return hold()
end
local holders = redis.call('ZRANGE', KEYS[1], 0, -1)
local line = redis.call('ZRANGE', KEYS[3], 0, -1)
local kind, _, limit = parse(entry)
if kind == 'p' then
  for _, list in ipairs({holders, line}) do
    for _, other in ipairs(list) do
      local k, _, theirs = parse(other)
      if k == 'p' and theirs ~= limit then
        redis.call('ZREM', KEYS[3], entry)
        redis.call('ZREM', KEYS[4], entry)
        return {3, theirs}
      end
    end
  end
end
local ahead = holders
local waiting_ahead = {}
for _, other in ipairs(line) do
  if other == entry then break end
  table.insert(ahead, other)
  table.insert(waiting_ahead, other)
end
if admitted(entry, ahead) then return hold() end
if ARGV[3] == '1' then enqueue(entry, ARGV[4], ARGV[5], now_us, now) end
-- Check again when the first holder's lease ends, or a ticket ahead
-- lapses (its waiter crashed): nobody publishes either.
local retry = -1
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
if first then retry = math.max(tonumber(first) - now, 0) end
for i = 1, math.min(#waiting_ahead, 16) do
  local lapses = redis.call('ZSCORE', KEYS[4], waiting_ahead[i])
  if lapses and (retry < 0 or tonumber(lapses) - now < retry) then
    retry = math.max(tonumber(lapses) - now, 0)
  end
end
return {0, retry}
"
);

/// A read-write lock's or a semaphore's release, or a wait given up.
///
/// KEYS: as [`SHARED_ACQUIRE`]. ARGV: entry, release channel. Takes the
/// entry out, then wakes by name the waiters at the head of the line that
/// are now admitted. Returns 1 if the entry held, else 0.
pub(super) const SHARED_RELEASE: &str = concat!(
    queue_lua!(),
    shared_lua!(),
    r"
local entry = ARGV[1]
local _, now = clock()
local released = 0
local lapses = redis.call('ZSCORE', KEYS[1], entry)
if lapses then
  redis.call('ZREM', KEYS[1], entry)
  if tonumber(lapses) > now then released = 1 end
end
redis.call('ZREM', KEYS[3], entry)
redis.call('ZREM', KEYS[4], entry)
if redis.call('EXISTS', KEYS[3]) == 1 then
  prune_holders(now)
  prune(now)
  local ahead = redis.call('ZRANGE', KEYS[1], 0, -1)
  for _, waiter in ipairs(redis.call('ZRANGE', KEYS[3], 0, 99)) do
    if not admitted(waiter, ahead) then break end
    redis.call('PUBLISH', ARGV[2], string.match(waiter, '^(.*)|'))
    table.insert(ahead, waiter)
  end
end
return released
"
);

/// A read-write lock's or a semaphore's renewal, if the entry's lease has
/// not ended. KEYS: holders, fence counter. ARGV: entry, lease in ms.
/// Returns 1 if renewed, else 0.
pub(super) const SHARED_RENEW: &str = concat!(
    queue_lua!(),
    shared_lua!(),
    r"
local entry, lease = ARGV[1], tonumber(ARGV[2])
local _, now = clock()
local lapses = redis.call('ZSCORE', KEYS[1], entry)
if lapses and tonumber(lapses) > now then
  redis.call('ZADD', KEYS[1], 'XX', now + lease, entry)
  keep(KEYS[1], lease)
  keep(KEYS[2], math.max(2 * lease, 600000))
  return 1
end
return 0
"
);

#[cfg(test)]
mod tests {
    use dlock_testkit::fixture::RedisServer;
    use redis::AsyncCommands;

    use crate::scripts::scripts;

    /// Runs a read-write lock's acquire for `entry` on key `k` with a lease
    /// of `lease_ms`, standing in line if refused.
    async fn shared(
        conn: &mut redis::aio::MultiplexedConnection,
        entry: &str,
        lease_ms: u64,
    ) -> (i64, i64) {
        let mut call = scripts(false).shared_acquire.key("dlock:{k}:rw");
        call.key("dlock:{k}:rw:fence")
            .key("dlock:{k}:rw:queue")
            .key("dlock:{k}:rw:tickets");
        call.arg(entry).arg(lease_ms).arg("1").arg("0").arg(10_000);
        call.invoke_async(conn)
            .await
            .expect("shared acquire script")
    }

    /// Readers share the fence counter: one with a short lease does not
    /// cut the life a long one gave it (twice its lease), which keeps the
    /// counter alive while the long one holds.
    #[tokio::test]
    async fn a_short_lease_does_not_shorten_the_shared_fence_counter() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = server.connection().await;
        assert_eq!(shared(&mut conn, "long|r", 3_600_000).await.0, 1);
        assert_eq!(shared(&mut conn, "short|r", 1_000).await.0, 1);
        let ttl: i64 = conn.pttl("dlock:{k}:rw:fence").await.expect("PTTL");
        assert!(ttl > 7_000_000, "the counter lives {ttl} ms more");
    }

    /// A release wakes exactly the waiters it admits, each by a message
    /// naming its token: the readers at the head of the line, and none
    /// behind the writer that waits after them (no herd, and no reader
    /// let past a waiting writer).
    #[tokio::test]
    async fn a_shared_release_names_only_the_waiters_it_admits() {
        use futures_util::StreamExt;

        let server = RedisServer::start().expect("redis-server");
        let mut conn = server.connection().await;
        let client = redis::Client::open(server.url()).expect("url");
        let mut pubsub = client.get_async_pubsub().await.expect("pubsub");
        pubsub
            .subscribe("dlock:{k}:rw:released")
            .await
            .expect("SUBSCRIBE");
        assert_eq!(shared(&mut conn, "holder|w", 10_000).await.0, 1);
        for waiter in ["r1|r", "r2|r", "w2|w", "r3|r"] {
            assert_eq!(
                shared(&mut conn, waiter, 10_000).await.0,
                0,
                "{waiter} joined a writer"
            );
        }
        let released: i64 = scripts(false)
            .shared_release
            .key("dlock:{k}:rw")
            .key("dlock:{k}:rw:fence")
            .key("dlock:{k}:rw:queue")
            .key("dlock:{k}:rw:tickets")
            .arg("holder|w")
            .arg("dlock:{k}:rw:released")
            .invoke_async(&mut conn)
            .await
            .expect("shared release script");
        assert_eq!(released, 1);
        // A marker after the release: every message it sent comes first.
        let _: i64 = conn
            .publish("dlock:{k}:rw:released", "end")
            .await
            .expect("PUBLISH");
        let mut messages = pubsub.on_message();
        let mut woken = Vec::new();
        loop {
            let message = tokio::time::timeout(std::time::Duration::from_secs(5), messages.next())
                .await
                .expect("messages within 5 s")
                .expect("subscription open");
            let payload: String = message.get_payload().expect("text");
            if payload == "end" {
                break;
            }
            woken.push(payload);
        }
        assert_eq!(woken, ["r1", "r2"]);
        assert_eq!(shared(&mut conn, "r3|r", 10_000).await.0, 0, "r3 passed w2");
        assert_eq!(
            shared(&mut conn, "r2|r", 10_000).await.0,
            1,
            "a woken reader holds"
        );
    }
}
