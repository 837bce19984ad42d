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
-- Hands a free lock to the first live waiter in line (if any but
-- `except`): the key holds 'next:' and that waiter's token until its
-- ticket lapses, so nobody else can take it, and the message naming it
-- wakes that one waiter. Only that token takes a handed lock, with a new
-- fence. Returns whether the lock was handed on.
local function hand_first(channel, except)
  local _, now = clock()
  local first, lapses = first_in_line(now)
  if not first or first == except then return false end
  local ms = math.max(1, math.min(lapses - now, 86400000))
  redis.call('SET', KEYS[1], 'next:' .. first, 'PX', ms)
  redis.call('PUBLISH', channel, first)
  return true
end
"
    };
}

/// Acquire in one round trip.
///
/// KEYS: lock, fence counter, line, ticket lapses. ARGV: token, lease in
/// ms, "1" to count a fencing token, and for an attempt that queues if
/// refused: release channel, place in line ("0" for the server to place it
/// last, or a score), ticket lifetime in ms. An attempt that does not
/// queue leaves the last three arguments and the last two keys out: it
/// never touches the line (its token cannot be in it yet), and the server
/// takes in less on the common path.
///
/// Returns `{1, fence}` when the token holds the lock (newly, taken from a
/// release that handed it over, or again after a reply was lost); `{0,
/// ms}` when another token holds it, for `ms` more; `{2, ms}` when a
/// release handed it to another waiter, who has `ms` left to take it. With
/// fencing asked for, the fence is never 0.
///
/// A free key goes to whoever asks first: the key is never free while a
/// live waiter stands in line, because a release hands the lock to the
/// first waiter (the key then holds `next:` and that waiter's token until
/// its ticket lapses). Only a crash frees a key with waiters in line: a
/// holder's lease or a handed waiter's ticket that runs out. The next
/// attempt then takes it, whoever makes it, and the release after that
/// serves the line in order again. A waiter that is refused gets (or
/// refreshes) its ticket in the same run.
///
/// The common case, a free key and a live counter, costs three commands
/// inside the script (`SET NX PX`, `INCR`, `PEXPIRE`), and defines none of
/// the line's functions. Redlock, which counts no fence, sends a plain
/// `SET NX PX` instead (see `Node::acquire`).
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
    // free key. Nobody is passed over by taking it, because the key is
    // never free while a live waiter stands in line: a release hands it
    // to the first waiter (see `hand_first`).
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
-- `in_line`: the token may have a ticket, to take out; if others still
-- wait, the lock's value is marked (see `RELEASE`).
local function granted(in_line)
  if in_line then
    redis.call('ZREM', KEYS[3], token)
    redis.call('ZREM', KEYS[4], token)
    if redis.call('EXISTS', KEYS[3]) == 1 then
      redis.call('SET', KEYS[1], token .. '+', 'KEEPTTL')
    end
  end
  if ARGV[3] == '1' then
    return {1, fence()}
  end
  return {1, 0}
end
if redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[2]) then
  return granted(ARGV[5])
end
",
    queue_lua!(),
    r"
local holder = redis.call('GET', KEYS[1])
if holder == token or holder == token .. '+' then
  -- Ours already: the reply to the attempt that won it was lost.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if ARGV[5] then
    redis.call('ZREM', KEYS[3], token)
    redis.call('ZREM', KEYS[4], token)
  end
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
if holder == 'next:' .. token then
  -- Handed to us by a release: take it, with a new fence.
  redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
  return granted(true)
end
local ttl = redis.call('PTTL', KEYS[1])
if not ARGV[5] then
  -- An attempt that does not queue: it names the lock and the counter
  -- only, and never touches the line.
  if string.sub(holder, 1, 5) == 'next:' then return {2, math.max(ttl, 0)} end
  return {0, ttl}
end
local now_us, now = clock()
enqueue(token, ARGV[5], ARGV[6], now_us, now)
local handed = string.sub(holder, 1, 5) == 'next:'
if not handed and string.sub(holder, -1) ~= '+' then
  -- Someone waits now: mark the holder's value, so that its release
  -- hands the lock on.
  redis.call('SET', KEYS[1], holder .. '+', 'KEEPTTL')
end
if handed then
  -- Handed to another waiter, who may not know yet: tell it again (the
  -- message that named it may have reached it while its ticket was
  -- missing here, or not at all), so that nobody behind it waits out its
  -- ticket for a wake-up it missed.
  redis.call('PUBLISH', ARGV[4], string.sub(holder, 6))
  return {2, math.max(ttl, 0)}
end
-- Check again when the holder's lease ends, or sooner when the first
-- waiter's ticket lapses: a release hands the lock to that waiter and
-- wakes only it, and if it crashed, the lock it was handed frees up when
-- its ticket lapses, with nobody told.
local first, lapses = first_in_line(now)
if first and first ~= token and (ttl < 0 or lapses - now < ttl) then
  ttl = math.max(lapses - now, 0)
end
return {0, ttl}
"
);

/// Release, or give back a grant and stay in line.
///
/// KEYS: as [`ACQUIRE`] (the fence counter is not touched). ARGV: token,
/// release channel, place in line ("" to leave the line: a release or a
/// cancelled wait; otherwise the waiter's place, as in [`ACQUIRE`]),
/// ticket lifetime in ms.
///
/// A holder's value is marked (its token and `+`) once someone stands in
/// line behind it, so a release that finds its token unmarked knows that
/// nobody waits without reading the line: two commands, `GET` and `DEL`,
/// as a release without a line. (The mark is set by every queued attempt
/// that finds it missing, so even a holder that took a key freed by a
/// crash is marked at the next attempt of a waiter.)
///
/// When the lock is free afterwards and someone waits, the lock is handed
/// to the first waiter in line, and a message carrying its token wakes
/// that one waiter. A waiter that gives up while the lock is handed to it
/// passes it on the same way. A give-back (Redlock) does not hand the lock
/// to its own waiter. Returns 1 if the token held the lock, else 0.
const RELEASE: &str = concat!(
    // The common case first: a holder's release with nobody in line (its
    // value is unmarked).
    r"
local holder = redis.call('GET', KEYS[1])
if ARGV[3] == '' and holder == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
",
    queue_lua!(),
    r"
local released = 0
if holder == ARGV[1] or holder == ARGV[1] .. '+' then
  released = 1
  redis.call('DEL', KEYS[1])
elseif holder == 'next:' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
end
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then hand_first(ARGV[2], nil) end
else
  local now_us, now = clock()
  enqueue(ARGV[1], ARGV[3], ARGV[4], now_us, now)
  if redis.call('EXISTS', KEYS[1]) == 0 then hand_first(ARGV[2], ARGV[1]) end
end
return released
"
);

/// Extend the lease if the token holds the lock (its value marked or not,
/// see [`RELEASE`]), and the fence counter's
/// life with it (see [`ACQUIRE`]; a key without a counter, as on Redlock,
/// is left so).
///
/// KEYS: lock, fence counter. ARGV: token, lease in ms. Returns 1 if
/// renewed, else 0.
const RENEW: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or holder == ARGV[1] .. '+' then
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
    /// does not (a single attempt: the line's two keys and the last three
    /// arguments left out, as the backend sends it).
    async fn acquire_queued(
        conn: &mut redis::aio::MultiplexedConnection,
        token: &str,
        queue: bool,
    ) -> (i64, i64) {
        let script = &scripts().acquire;
        let mut call = if queue {
            on_key(script)
        } else {
            let mut call = script.key("dlock:{k}");
            call.key("dlock:{k}:fence");
            call
        };
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

    /// First come, first served, at the script: a release that finds
    /// waiters hands the lock to the first in line, with a fence above
    /// the last, and to nobody else, whether or not the one asking queues
    /// (a plain `SET NX`, as Redlock's first attempt sends, included).
    #[tokio::test]
    async fn a_released_lock_goes_only_to_the_first_in_line() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = connect(&server).await;
        let (won, holder_fence) = acquire(&mut conn, "holder").await;
        assert_eq!(won, 1);
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
        let set: Option<String> = redis::cmd("SET")
            .arg("dlock:{k}")
            .arg("plain")
            .arg("NX")
            .arg("PX")
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .expect("SET");
        assert_eq!(set, None, "a plain SET NX took a handed lock");
        let (won, first_fence) = acquire(&mut conn, "first").await;
        assert_eq!(won, 1, "the first in line is refused");
        assert!(
            first_fence > holder_fence,
            "a handed lock's fence {first_fence} after {holder_fence}"
        );
        assert_eq!(release(&mut conn, "first").await, 1);
        assert_eq!(acquire(&mut conn, "second").await.0, 1, "then the second");
    }

    /// A waiter that gives up while the lock is handed to it passes the
    /// lock on to the next in line, and a lock released with nobody left
    /// in line is free.
    #[tokio::test]
    async fn a_handed_lock_given_up_passes_to_the_next() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = connect(&server).await;
        assert_eq!(acquire(&mut conn, "holder").await.0, 1);
        assert_eq!(acquire(&mut conn, "first").await.0, 0);
        assert_eq!(acquire(&mut conn, "second").await.0, 0);
        assert_eq!(release(&mut conn, "holder").await, 1);
        assert_eq!(
            release(&mut conn, "first").await,
            0,
            "a handed lock not yet taken is not held"
        );
        assert_eq!(acquire_queued(&mut conn, "newcomer", false).await.0, 2);
        assert_eq!(acquire(&mut conn, "second").await.0, 1, "passed on");
        assert_eq!(release(&mut conn, "second").await, 1);
        assert_eq!(
            acquire_queued(&mut conn, "newcomer", false).await.0,
            1,
            "free once nobody waits"
        );
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
