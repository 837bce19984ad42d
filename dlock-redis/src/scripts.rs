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
-- The first live ticket and when it lapses, or nil. Lapsed tickets met
-- on the way are dropped, however many `prune` left (it drops at most
-- 100 per run, to bound the script's time).
local function first_in_line(now)
  prune(now)
  for _ = 1, 100 do
    local first = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not first then return nil end
    local lapses = tonumber(redis.call('ZSCORE', KEYS[4], first))
    if lapses and lapses > now then return first, lapses end
    redis.call('ZREM', KEYS[3], first)
    redis.call('ZREM', KEYS[4], first)
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
/// Every token is `max(INCR counter, TIME in µs)`, and the larger value is
/// written back to the counter. The counter lives beside the lock with a
/// TTL of twice the lease, but never less than ten minutes (600 000 ms in
/// the scripts), set at every acquisition and renewal, so it goes away some time after
/// the lock: a service that locks `order:{id}` for ever more ids does not
/// grow Redis for ever. The tokens of one key strictly increase, whatever
/// happened to the counter:
///
/// - While the counter lives and is current, each token is above the last
///   one: `INCR` adds 1, and the clock can only raise it.
/// - No token is ahead of the server's clock by more than the number of
///   acquisitions made within the same microsecond. Each acquisition is a
///   script run of several microseconds (measured: 3 to 7 µs of server
///   time), and a server runs one script at a time, so that number is 0:
///   every token is at most the clock's reading when it was issued.
/// - So a counter that is set back (a failover to a replica that had not
///   seen the last `INCR`s, a restart from an older RDB or AOF) or lost
///   (expired, `FLUSHALL`, a restart without persistence) is overtaken by
///   the clock: the next token is at least `TIME` now, above every token
///   issued before, as long as the server's clock did not go backwards
///   since (the seed comes from the clock, not the data). After a
///   failover that means the new master's clock is not behind the old
///   one's by more than the time the failover took: keep the servers'
///   clocks in sync (NTP), as every clock-seeded counter needs.
/// - A clock that steps back is covered while the counter lives (`INCR`
///   keeps counting from the last token): the TTL floor keeps it alive for
///   ten minutes after the last use, however short the lease, so only a
///   key idle that long and a clock stepped back further than that meet.
const ACQUIRE: &str = concat!(
    // The common case first, before the line's functions are defined: a
    // free key. Nobody is passed over by taking it, because the key is
    // never free while a live waiter stands in line: a release hands it
    // to the first waiter (see `hand_first`).
    r"
local token = ARGV[1]
-- The fence: above every earlier one, even if the counter was set back
-- or lost (see the argument above).
local function fence()
  local value = redis.call('INCR', KEYS[2])
  local now = redis.call('TIME')
  local now_us = now[1] * 1000000 + now[2]
  if value < now_us then
    value = now_us
    redis.call('SET', KEYS[2], value)
  end
  redis.call('PEXPIRE', KEYS[2], math.max(2 * ARGV[2], 600000))
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
      redis.call('PEXPIRE', KEYS[2], math.max(2 * ARGV[2], 600000))
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
/// KEYS: as [`ACQUIRE`] (the fence counter is not touched), and the
/// proclaimed value. ARGV: token, release channel, place in line ("" to
/// leave the line: a release or a cancelled wait; otherwise the waiter's
/// place, as in [`ACQUIRE`]), ticket lifetime in ms, holder channel.
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
  if not KEYS[5] then
    redis.call('DEL', KEYS[1])
  -- A proclaimed value goes with the hold (one command for both), and
  -- its watchers are told.
  elseif redis.call('DEL', KEYS[1], KEYS[5]) == 2 then
    redis.call('PUBLISH', ARGV[5], '')
  end
  return 1
end
",
    queue_lua!(),
    r"
local released = 0
if holder == ARGV[1] or holder == ARGV[1] .. '+' then
  released = 1
  redis.call('DEL', KEYS[1])
  -- A proclaimed hold: its value goes with it, and its watchers are told.
  if KEYS[5] and redis.call('DEL', KEYS[5]) == 1 then
    redis.call('PUBLISH', ARGV[5], '')
  end
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
  local after = redis.call('GET', KEYS[1])
  if not after then
    hand_first(ARGV[2], ARGV[1])
  elseif string.sub(after, 1, 5) ~= 'next:' and string.sub(after, -1) ~= '+' then
    -- Someone else holds it, and now someone waits: marked, so that its
    -- release hands the lock on (see above).
    redis.call('SET', KEYS[1], after .. '+', 'KEEPTTL')
  end
end
return released
"
);

/// Extend the lease if the token holds the lock (its value marked or not,
/// see [`RELEASE`]), and the fence counter's
/// life with it (see [`ACQUIRE`]; a key without a counter, as on Redlock,
/// is left so).
///
/// A proclaimed value (see [`PROCLAIM`]) lives twice the lease, and is
/// kept alive with the counter (whose TTL has a floor, see [`ACQUIRE`]).
///
/// KEYS: lock, fence counter, proclaimed value. ARGV: token, lease in ms.
/// Returns 1 if renewed, else 0.
const RENEW: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or holder == ARGV[1] .. '+' then
  redis.call('PEXPIRE', KEYS[2], math.max(2 * ARGV[2], 600000))
  redis.call('PEXPIRE', KEYS[3], 2 * ARGV[2])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// Publish what the holder says (`dlock_core::backend::Backend::proclaim`)
/// if the token holds the lock.
///
/// The value key holds the token, `|`, and the value, so a value written
/// by an earlier holder is never read as the current one's (see
/// [`HOLDER`]); it lives twice the lock's remaining lease, and every
/// renewal extends it as it does the fence counter, so it goes away with
/// the lock.
///
/// The lock's value is left as it is: its `+` mark says only that someone
/// waits in line. Every release deletes the value key with the lock and
/// tells the holder's watchers if there was one; an empty message on the
/// holder channel wakes every watcher of the holder
/// (`Backend::holder_changed`).
///
/// KEYS: lock, fence counter, proclaimed value. ARGV: token, value,
/// holder channel. Returns 1 if written, else 0.
const PROCLAIM: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder ~= ARGV[1] and holder ~= ARGV[1] .. '+' then return 0 end
local ttl = math.max(redis.call('PTTL', KEYS[1]), 1)
redis.call('SET', KEYS[3], ARGV[1] .. '|' .. ARGV[2], 'PX', 2 * ttl)
redis.call('PUBLISH', ARGV[3], '')
return 1
";

/// Who holds the lock (`dlock_core::backend::Backend::holder`): its fence
/// (the counter, which the holder's acquisition set last) and the value it
/// proclaimed, if the value key is its own. A lock handed to a waiter that
/// has not taken it yet is free.
///
/// KEYS: lock, fence counter, proclaimed value. Returns nil if nobody
/// holds it, else `{fence, ms}` or `{fence, ms, value}`, `ms` the lease
/// left.
const HOLDER: &str = r"
local holder = redis.call('GET', KEYS[1])
if not holder or string.sub(holder, 1, 5) == 'next:' then return nil end
if string.sub(holder, -1) == '+' then holder = string.sub(holder, 1, -2) end
local fence = redis.call('GET', KEYS[2]) or '0'
local ttl = tostring(redis.call('PTTL', KEYS[1]))
local stored = redis.call('GET', KEYS[3])
local mine = holder .. '|'
if stored and string.sub(stored, 1, #mine) == mine then
  return {fence, ttl, string.sub(stored, #mine + 1)}
end
return {fence, ttl}
";

/// What read-write locks and semaphores share: an entry's mode, the
/// admission rule, and the fence counter.
///
/// A key's read-write lock and its semaphore are objects of their own
/// (`…:rw` and `…:sem`, beside the plain lock's names). Each has four
/// keys: `KEYS[1]` the holders (a sorted set of entries scored by when
/// their lease ends, in server ms), `KEYS[2]` the fence counter, and
/// `KEYS[3]` and `KEYS[4]` the waiting line as the plain lock has it. An
/// entry is the owner's token, `|`, and what it takes: `r`, `w` or
/// `p{count}/{limit}`.
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

/// A read-write lock's or a semaphore's acquire, in one round trip.
///
/// KEYS: holders, fence counter, line, ticket lapses (see
/// `shared_lua!`). ARGV: entry, lease in ms, "1" to stand in line if
/// refused, the place in line ("0": last, by the server's clock), ticket
/// lifetime in ms.
///
/// An entry holds when it is admitted behind every live holder and every
/// live waiter ahead of it in line (a newcomer: behind the whole line),
/// so a waiting writer keeps later readers out and permits go in order.
/// Returns `{1, fence}` when the entry holds (newly, or again after a
/// lost reply, with a new fence either way); `{0, ms}` when refused, with
/// how long until a holder's lease or a ticket ahead runs out (-1 if
/// none); `{3, limit}` when the semaphore's holders or waiters name
/// another limit (the entry leaves the line).
const SHARED_ACQUIRE: &str = concat!(
    queue_lua!(),
    shared_lua!(),
    r"
local entry, lease = ARGV[1], tonumber(ARGV[2])
local now_us, now = clock()
-- As `ACQUIRE`'s fence: above every earlier one.
local function fence()
  local value = redis.call('INCR', KEYS[2])
  if value < now_us then
    value = now_us
    redis.call('SET', KEYS[2], value)
  end
  keep(KEYS[2], math.max(2 * lease, 600000))
  return value
end
local function hold()
  redis.call('ZREM', KEYS[3], entry)
  redis.call('ZREM', KEYS[4], entry)
  redis.call('ZADD', KEYS[1], now + lease, entry)
  keep(KEYS[1], lease)
  return {1, fence()}
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
/// entry out of the holders and the line, then wakes, by a message naming
/// each, the waiters at the head of the line that are now admitted (and
/// none behind the first that is not). Returns 1 if the entry held,
/// else 0.
const SHARED_RELEASE: &str = concat!(
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

/// A read-write lock's or a semaphore's renewal: extends the entry's lease
/// if it still holds (its lease has not ended), and the fence counter's
/// life with it.
///
/// KEYS: holders, fence counter. ARGV: entry, lease in ms. Returns 1 if
/// renewed, else 0.
const SHARED_RENEW: &str = concat!(
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

/// Every script, in the order of [`Scripts`]' fields.
const SOURCES: [&str; 8] = [
    ACQUIRE,
    RELEASE,
    RENEW,
    SHARED_ACQUIRE,
    SHARED_RELEASE,
    SHARED_RENEW,
    PROCLAIM,
    HOLDER,
];

/// The compiled scripts (their SHA1 is computed once).
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
    pub(crate) shared_acquire: Script,
    pub(crate) shared_release: Script,
    pub(crate) shared_renew: Script,
    pub(crate) proclaim: Script,
    pub(crate) holder: Script,
    /// Their sources, to load.
    sources: Vec<String>,
}

impl Scripts {
    fn compile(sharded: bool) -> Scripts {
        let sources: Vec<String> = SOURCES
            .into_iter()
            .map(|lua| {
                if sharded {
                    to_sharded(lua)
                } else {
                    lua.to_owned()
                }
            })
            .collect();
        let script = |i: usize| Script::new(&sources[i]);
        Scripts {
            acquire: script(0),
            release: script(1),
            renew: script(2),
            shared_acquire: script(3),
            shared_release: script(4),
            shared_renew: script(5),
            proclaim: script(6),
            holder: script(7),
            sources,
        }
    }

    /// Loads every script into a node's cache in one round trip (into
    /// every master's, on a cluster), so that the first acquire, release
    /// and renewal need no `NOSCRIPT` retry.
    pub(crate) async fn load(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<()> {
        let mut pipe = redis::pipe();
        for source in &self.sources {
            pipe.cmd("SCRIPT").arg("LOAD").arg(source).ignore();
        }
        pipe.query_async(conn).await
    }
}

/// A script's source for Redis Cluster: its wake-ups go out on the key's
/// shard channel (`SPUBLISH`, Redis 7), which only the shard that owns the
/// slot serves, rather than to every node of the cluster.
fn to_sharded(lua: &str) -> String {
    lua.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
}

/// The scripts of one node, or (`sharded`) of a cluster.
pub(crate) fn scripts(sharded: bool) -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    static SHARDED: OnceLock<Scripts> = OnceLock::new();
    if sharded {
        SHARDED.get_or_init(|| Scripts::compile(true))
    } else {
        SCRIPTS.get_or_init(|| Scripts::compile(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_publish_of_a_cluster_script_is_sharded() {
        for lua in SOURCES {
            let publishes = lua.matches("redis.call('PUBLISH',").count();
            let sharded = to_sharded(lua);
            assert_eq!(sharded.matches("redis.call('SPUBLISH',").count(), publishes);
            // No other spelling of a classic publish is left.
            let calls = sharded.to_uppercase().replace(' ', "");
            assert!(!calls.contains("'PUBLISH'") && !calls.contains("\"PUBLISH\""));
        }
    }
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
        let script = &scripts(false).acquire;
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

    /// `script` on the names of key `k`.
    fn on_key(script: &Script) -> redis::ScriptInvocation<'_> {
        let mut call = script.key("dlock:{k}");
        call.key("dlock:{k}:fence")
            .key("dlock:{k}:queue")
            .key("dlock:{k}:tickets");
        call
    }

    async fn release(conn: &mut redis::aio::MultiplexedConnection, token: &str) -> i64 {
        on_key(&scripts(false).release)
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
        let mut conn = server.connection().await;
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
        let mut conn = server.connection().await;
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
        let mut conn = server.connection().await;
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

    /// A release hands the lock to the first live waiter, however many
    /// lapsed tickets stand ahead of it (pruning drops 100 per run; the
    /// rest are passed over, never handed the lock).
    #[tokio::test]
    async fn a_release_passes_over_any_number_of_lapsed_tickets() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = server.connection().await;
        assert_eq!(acquire(&mut conn, "holder").await.0, 1);
        // More than the two prunes before the hand-over drop (the live
        // waiter's refused attempt runs one, the release another).
        for i in 0..300 {
            let () = redis::pipe()
                .cmd("ZADD")
                .arg("dlock:{k}:queue")
                .arg(i + 1)
                .arg(format!("dead{i}"))
                .ignore()
                .cmd("ZADD")
                .arg("dlock:{k}:tickets")
                .arg(1)
                .arg(format!("dead{i}"))
                .ignore()
                .query_async(&mut conn)
                .await
                .expect("ZADD");
        }
        assert_eq!(acquire(&mut conn, "live").await.0, 0, "held: live queues");
        assert_eq!(release(&mut conn, "holder").await, 1);
        let handed: Option<String> = redis::cmd("GET")
            .arg("dlock:{k}")
            .query_async(&mut conn)
            .await
            .expect("GET");
        assert_eq!(handed.as_deref(), Some("next:live"));
    }

    async fn get(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
        redis::cmd("GET")
            .arg(key)
            .query_async(conn)
            .await
            .expect("GET")
    }

    /// A give-back (Redlock's, of a minority grant) that stays in line
    /// behind another holder marks that holder, so that its release hands
    /// the lock to the line instead of freeing it unannounced.
    #[tokio::test]
    async fn a_give_back_that_stays_in_line_marks_the_holder() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = server.connection().await;
        assert_eq!(acquire(&mut conn, "holder").await.0, 1);
        let released: i64 = on_key(&scripts(false).release)
            .arg("waiter")
            .arg("dlock:{k}:released")
            .arg("0")
            .arg(10_000)
            .arg("")
            .invoke_async(&mut conn)
            .await
            .expect("give back");
        assert_eq!(released, 0, "the waiter held nothing");
        assert_eq!(
            get(&mut conn, "dlock:{k}").await.as_deref(),
            Some("holder+")
        );
        assert_eq!(release(&mut conn, "holder").await, 1);
        assert_eq!(
            get(&mut conn, "dlock:{k}").await.as_deref(),
            Some("next:waiter")
        );
    }

    /// A proclaim leaves the waiting-line mark alone (it says only that
    /// someone waits), and a release with nobody in line still deletes
    /// the value.
    #[tokio::test]
    async fn a_proclaim_does_not_mark_the_line_and_its_value_goes_with_the_release() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = server.connection().await;
        assert_eq!(acquire(&mut conn, "holder").await.0, 1);
        let written: i64 = scripts(false)
            .proclaim
            .key("dlock:{k}")
            .key("dlock:{k}:fence")
            .key("dlock:{k}:value")
            .arg("holder")
            .arg("v")
            .arg("dlock:{k}:holder")
            .invoke_async(&mut conn)
            .await
            .expect("proclaim");
        assert_eq!(written, 1);
        assert_eq!(get(&mut conn, "dlock:{k}").await.as_deref(), Some("holder"));
        let released: i64 = on_key(&scripts(false).release)
            .key("dlock:{k}:value")
            .arg("holder")
            .arg("dlock:{k}:released")
            .arg("")
            .arg(0)
            .arg("dlock:{k}:holder")
            .invoke_async(&mut conn)
            .await
            .expect("release");
        assert_eq!(released, 1);
        assert_eq!(
            get(&mut conn, "dlock:{k}:value").await,
            None,
            "the value stayed"
        );
    }

    /// Runs a read-write lock's acquire for `entry` on key `k`, standing
    /// in line if refused.
    async fn shared(conn: &mut redis::aio::MultiplexedConnection, entry: &str) -> (i64, i64) {
        let mut call = scripts(false).shared_acquire.key("dlock:{k}:rw");
        call.key("dlock:{k}:rw:fence")
            .key("dlock:{k}:rw:queue")
            .key("dlock:{k}:rw:tickets");
        call.arg(entry).arg(10_000).arg("1").arg("0").arg(10_000);
        call.invoke_async(conn)
            .await
            .expect("shared acquire script")
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
        assert_eq!(shared(&mut conn, "holder|w").await.0, 1);
        for waiter in ["r1|r", "r2|r", "w2|w", "r3|r"] {
            assert_eq!(
                shared(&mut conn, waiter).await.0,
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
        let _: i64 = redis::cmd("PUBLISH")
            .arg("dlock:{k}:rw:released")
            .arg("end")
            .query_async(&mut conn)
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
        assert_eq!(shared(&mut conn, "r3|r").await.0, 0, "r3 passed w2");
        assert_eq!(shared(&mut conn, "r2|r").await.0, 1, "a woken reader holds");
    }
}
