//! The Lua scripts: each runs atomically on the server, so checking the
//! owner and acting on the key can never be split by another client.
//!
//! Deliberately not used: `SETNX` followed by `EXPIRE` (a crash between the
//! two leaves a lock that never expires), the `SETNX`/`GETSET` timestamp
//! scheme (it trusts every client's clock to agree), and a plain `DEL` on
//! release (after a lease ran out it deletes the next owner's lock).

use std::sync::OnceLock;

use redis::Script;

/// The waiting line shared by the acquire and release scripts.
///
/// `KEYS[3]` orders the tickets (a sorted set scored by place in line) and
/// `KEYS[4]` holds when each ticket lapses (a sorted set scored by server
/// time in ms). Both carry the longest ticket's lifetime as their TTL, so a
/// line whose waiters all went away leaves nothing behind.
macro_rules! queue_lua {
    () => {
        r"
local function clock()
  local t = redis.call('TIME')
  local us = t[1] * 1000000 + t[2]
  return us, math.floor(us / 1000)
end
-- Drops tickets that were not refreshed in time: their waiter crashed or
-- was cut off. A stale ticket blocks the line for at most its lifetime.
local function prune(now)
  local stale = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, 100)
  if #stale > 0 then
    redis.call('ZREM', KEYS[3], unpack(stale))
    redis.call('ZREM', KEYS[4], unpack(stale))
  end
  return #stale
end
-- The first live ticket and when it lapses, or nil.
local function first_in_line(now)
  prune(now)
  for _ = 1, 8 do
    local first = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not first then return nil end
    local lapses = redis.call('ZSCORE', KEYS[4], first)
    if lapses then return first, tonumber(lapses) end
    redis.call('ZREM', KEYS[3], first)
  end
  return nil
end
-- Puts `token` in line (or refreshes its ticket). `place` is the score
-- the client chose ('0': the server's clock, after the last ticket).
local function enqueue(token, place, ticket_ms, now_us, now)
  if not redis.call('ZSCORE', KEYS[3], token) then
    local score = place
    if place == '0' then
      score = now_us
      local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')[2]
      if last and tonumber(last) >= score then score = tonumber(last) + 1 end
    end
    redis.call('ZADD', KEYS[3], score, token)
  end
  local ms = tonumber(ticket_ms)
  redis.call('ZADD', KEYS[4], now + ms, token)
  for i = 3, 4 do
    if redis.call('PTTL', KEYS[i]) < ms then redis.call('PEXPIRE', KEYS[i], ms) end
  end
end
-- Tells the first waiter in line, by its token, that the lock is free.
local function wake_first(channel, except)
  if redis.call('EXISTS', KEYS[1]) == 1 then return end
  local _, now = clock()
  local first = first_in_line(now)
  if first and first ~= except then redis.call('PUBLISH', channel, first) end
end
"
    };
}

/// Acquire in one round trip.
///
/// KEYS: lock, fence counter, line, ticket lapses. ARGV: token, lease in
/// ms, "1" to count a fencing token, and for an attempt that queues if
/// refused: release channel, place in line ("0" for the server to place it
/// last, or a score), ticket lifetime in ms. (An attempt that does not
/// queue leaves the last three out: fewer arguments for the server to
/// take in on the common path.)
///
/// Returns `{1, fence}` when the token holds the lock (newly, or again
/// after a reply was lost); `{0, ms}` when another token holds it, for
/// `ms` more (or the first waiter's ticket lapses sooner); `{2,
/// ms}` when it is free but another waiter is first in line, whose ticket
/// lapses in `ms`. With fencing asked for, the fence is never 0.
///
/// The lock is granted only to the first waiter in line, or to anyone
/// when nobody waits; a waiter that is refused gets (or refreshes) its
/// ticket in the same run. The common case, a free key with nobody in
/// line and a live counter, costs four commands inside the script
/// (`EXISTS`, `SET NX PX`, `INCR`, `PEXPIRE`), and defines none of the
/// line's functions.
///
/// # The fence counter, and why its tokens only grow
///
/// The counter lives beside the lock with a TTL of twice the lease, set at
/// every acquisition and renewal, so it goes away with the lock: a service
/// that locks `order:{id}` for ever more ids does not grow Redis for ever.
///
/// A counter that is missing (never made, expired, or lost) is seeded from
/// the server's clock, `TIME` in microseconds; `INCR` then adds 1 per
/// acquisition. The tokens of one key still strictly increase:
///
/// - While the counter lives, each token is the previous one plus 1.
/// - A counter seeded at time `T` (in µs) has handed out `T + n - 1` by its
///   `n`-th acquisition. Each acquisition is one script run of several
///   microseconds (measured: 3 to 7 µs of server time), and a server runs
///   one script at a time, so `n` acquisitions span at least `n` µs: no
///   token is ever ahead of the server's clock at the moment it is issued.
/// - So when the counter is gone and is seeded again at a later time `T'`,
///   `T'` exceeds every token issued before, as long as the server's clock
///   does not go backwards (a restart without persistence, or a failover
///   to a replica, included: the seed comes from the clock, not the data).
const ACQUIRE: &str = concat!(
    // The common case first, before the line's functions are defined: a
    // free key with nobody in line.
    r"
local token = ARGV[1]
local function fence()
  local value = redis.call('INCR', KEYS[2])
  if value == 1 then
    local now = redis.call('TIME')
    value = now[1] * 1000000 + now[2]
    redis.call('SET', KEYS[2], value)
  end
  redis.call('PEXPIRE', KEYS[2], 2 * ARGV[2])
  return value
end
if redis.call('EXISTS', KEYS[3]) == 0 and redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[2]) then
  if ARGV[3] == '1' then
    return {1, fence()}
  end
  return {1, 0}
end
",
    queue_lua!(),
    r"
local holder = redis.call('GET', KEYS[1])
if holder == token then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[3], token)
  redis.call('ZREM', KEYS[4], token)
  if ARGV[3] == '1' then
    local value = tonumber(redis.call('GET', KEYS[2]))
    if value then
      redis.call('PEXPIRE', KEYS[2], 2 * ARGV[2])
      return {1, value}
    end
    return {1, fence()}
  end
  return {1, 0}
end
local now_us, now = clock()
if not holder then
  local first, lapses = first_in_line(now)
  if not first or first == token then
    redis.call('ZREM', KEYS[3], token)
    redis.call('ZREM', KEYS[4], token)
    redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
    if ARGV[3] == '1' then
      return {1, fence()}
    end
    return {1, 0}
  end
  if ARGV[5] then
    enqueue(token, ARGV[5], ARGV[6], now_us, now)
    -- The lock is free here and the first waiter has not taken it: tell
    -- it again. It may not know that its turn has come (the tickets ahead
    -- of it lapsed just now, or the release that named it reached it
    -- while its ticket was missing here), and a waiter behind it must not
    -- wait on it for a whole lease.
    redis.call('PUBLISH', ARGV[4], first)
  end
  return {2, math.max(lapses - now, 0)}
end
if ARGV[5] then enqueue(token, ARGV[5], ARGV[6], now_us, now) end
-- Check again when the holder's lease ends, or sooner when the first
-- waiter's ticket lapses: the release will name that waiter, and if it
-- crashed, nobody else would be told.
local ttl = redis.call('PTTL', KEYS[1])
local first, lapses = first_in_line(now)
if first and first ~= token and (ttl < 0 or lapses - now < ttl) then
  ttl = math.max(lapses - now, 0)
end
return {0, ttl}
"
);

/// Release, or give back a grant and stay in line.
///
/// KEYS: as [`ACQUIRE`] (the fence counter is not touched). ARGV: token, release channel, place in line ("" to leave
/// the line: a release or a cancelled wait; otherwise the waiter's place,
/// as in [`ACQUIRE`]), ticket lifetime in ms.
///
/// When the lock is free afterwards, the first waiter in line is told by
/// a message carrying its token, so that one waiter wakes, not all. A
/// give-back does not wake its own waiter. Returns 1 if the token held the
/// lock, else 0.
const RELEASE: &str = concat!(
    // The common case first: a release with nobody in line.
    r"
local released = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  released = 1
end
if ARGV[3] == '' and redis.call('EXISTS', KEYS[3]) == 0 then
  return released
end
",
    queue_lua!(),
    r"
if ARGV[3] == '' then
  local left = redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  if released + left > 0 then
    wake_first(ARGV[2], nil)
  end
else
  local now_us, now = clock()
  enqueue(ARGV[1], ARGV[3], ARGV[4], now_us, now)
  wake_first(ARGV[2], ARGV[1])
end
return released
"
);

/// Extend the lease if the token holds the lock, and the fence counter's
/// life with it (see [`ACQUIRE`]; a key without a counter, as on Redlock,
/// is left so).
///
/// KEYS: lock, fence counter. ARGV: token, lease in ms. Returns 1 if
/// renewed, else 0.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[2], 2 * ARGV[2])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// The compiled scripts (their SHA1 is computed once).
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
}

impl Scripts {
    /// Loads every script into a node's cache in one round trip, so that
    /// the first acquire, release and renewal need no `NOSCRIPT` retry.
    pub(crate) async fn load(conn: &mut impl redis::aio::ConnectionLike) -> redis::RedisResult<()> {
        let mut pipe = redis::pipe();
        for source in [ACQUIRE, RELEASE, RENEW] {
            pipe.cmd("SCRIPT").arg("LOAD").arg(source).ignore();
        }
        pipe.query_async(conn).await
    }
}

pub(crate) fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        acquire: Script::new(ACQUIRE),
        release: Script::new(RELEASE),
        renew: Script::new(RENEW),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_testkit::fixture::RedisServer;

    async fn acquire(conn: &mut redis::aio::MultiplexedConnection, token: &str) -> (i64, i64) {
        acquire_queued(conn, token, true).await
    }

    /// An attempt that stands in line if refused (`queue`), or one that
    /// does not (a single attempt: the last three arguments left out).
    async fn acquire_queued(
        conn: &mut redis::aio::MultiplexedConnection,
        token: &str,
        queue: bool,
    ) -> (i64, i64) {
        let mut call = on_key(&scripts().acquire);
        call.arg(token).arg(10_000).arg("1");
        if queue {
            call.arg("dlock:{k}:released").arg("0").arg(10_000);
        }
        call.invoke_async(conn).await.expect("acquire script")
    }

    async fn connect(server: &RedisServer) -> redis::aio::MultiplexedConnection {
        redis::Client::open(server.url())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect")
    }

    /// `script` on the names of key `k`.
    fn on_key(script: &Script) -> redis::ScriptInvocation<'_> {
        let mut call = script.key("dlock:{k}");
        call.key("dlock:{k}:fence")
            .key("dlock:{k}:queue")
            .key("dlock:{k}:tickets");
        call
    }

    async fn release(conn: &mut redis::aio::MultiplexedConnection, token: &str) -> i64 {
        on_key(&scripts().release)
            .arg(token)
            .arg("dlock:{k}:released")
            .arg("")
            .arg(0)
            .invoke_async(conn)
            .await
            .expect("release script")
    }

    /// First come, first served, at the script: once someone waits, a free
    /// lock goes to the first in line and to nobody else, whether or not
    /// the one asking queues.
    #[tokio::test]
    async fn a_free_lock_goes_only_to_the_first_in_line() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = connect(&server).await;
        assert_eq!(acquire(&mut conn, "holder").await.0, 1);
        assert_eq!(acquire(&mut conn, "first").await.0, 0, "held: first queues");
        assert_eq!(
            acquire(&mut conn, "second").await.0,
            0,
            "held: second queues"
        );
        assert_eq!(release(&mut conn, "holder").await, 1);
        for (token, queue) in [("second", true), ("newcomer", false), ("newcomer", true)] {
            let (status, _) = acquire_queued(&mut conn, token, queue).await;
            assert_eq!(
                status, 2,
                "{token} took the lock ahead of the first in line"
            );
        }
        assert_eq!(
            acquire(&mut conn, "first").await.0,
            1,
            "the first in line is refused"
        );
        assert_eq!(release(&mut conn, "first").await, 1);
        assert_eq!(acquire(&mut conn, "second").await.0, 1, "then the second");
    }

    /// The branch for a token that holds the lock already (its first reply
    /// was lost) never answers a fence of 0, or one below an earlier token,
    /// though the counter is gone.
    #[tokio::test]
    async fn re_acquiring_without_a_counter_gives_a_greater_fence() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = connect(&server).await;
        let (won, first) = acquire(&mut conn, "t1").await;
        assert_eq!(won, 1);
        let _: () = redis::cmd("DEL")
            .arg("dlock:{k}:fence")
            .query_async(&mut conn)
            .await
            .expect("DEL");
        let (won, again) = acquire(&mut conn, "t1").await;
        assert_eq!(won, 1, "the holder's token re-acquires");
        assert!(again > first, "re-acquired fence {again} after {first}");
        let (won, _) = acquire(&mut conn, "t2").await;
        assert_eq!(won, 0, "another token does not");
    }
}
