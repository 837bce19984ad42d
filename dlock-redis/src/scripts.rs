//! The Lua scripts: each runs atomically on the server, so checking the
//! owner and acting on the key can never be split by another client.
//! Each script's module holds its Lua, its arguments and the decoding of
//! its answer; this one, what they share: the fence's and the line's Lua,
//! the names a script takes as `KEYS`, and the compiled scripts.

use std::sync::OnceLock;

use redis::Script;

/// The fence of both acquire scripts: `fence(lease, keep)` takes
/// `max(last + 1, TIME in µs)` from the counter (`KEYS[2]`) with one `SET
/// ... GET` (Redis 6.2), writes it back with a TTL of twice `lease` (at
/// least ten minutes; with `keep`, never shorter than it was: shared
/// holders share the counter), and returns it. Why its tokens only grow:
/// the crate docs, "How it locks". The clock and TTL go to Redis as text:
/// a Lua number passed to `redis.call` costs a `%.17g` conversion.
macro_rules! fence_lua {
    () => {
        r"
local function fence(lease, keep)
  local t = redis.call('TIME')
  local us = t[2]
  local now = t[1] .. string.rep('0', 6 - #us) .. us
  local ttl = '600000'
  if 2 * lease > 600000 then ttl = 2 * lease end
  if keep then ttl = math.max(ttl, redis.call('PTTL', KEYS[2])) end
  local last = tonumber(redis.call('SET', KEYS[2], now, 'PX', ttl, 'GET'))
  local value = tonumber(now)
  if last and last >= value then
    value = last + 1
    redis.call('SET', KEYS[2], value, 'PX', ttl)
  end
  return value
end
"
    };
}

/// The waiting line of the acquire and release scripts: `KEYS[3]` orders
/// the tickets by place, `KEYS[4]` holds when each lapses (server ms);
/// both live as long as the longest ticket.
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

pub(crate) mod election;
pub(crate) mod lock;
pub(crate) mod renew;
pub(crate) mod shared;

use election::{HOLDER, PROCLAIM};
use lock::{ACQUIRE, RELEASE, WAKE_FIRST};
use renew::{RENEW, RENEW_MANY};
use shared::{SHARED_ACQUIRE, SHARED_RELEASE, SHARED_RENEW};

use crate::{keys::Names, node::Node};

/// The compiled scripts (their SHA1 is computed once).
pub(crate) struct Scripts {
    acquire: Script,
    release: Script,
    wake_first: Script,
    renew: Script,
    renew_many: Script,
    shared_acquire: Script,
    shared_release: Script,
    shared_renew: Script,
    proclaim: Script,
    holder: Script,
    /// Their sources, to load.
    sources: Vec<String>,
}

impl Scripts {
    fn compile(sharded: bool) -> Scripts {
        let mut sources = Vec::new();
        let mut script = |lua: &str| {
            let lua = if sharded {
                to_sharded(lua)
            } else {
                lua.to_owned()
            };
            let script = Script::new(&lua);
            sources.push(lua);
            script
        };
        Scripts {
            acquire: script(ACQUIRE),
            release: script(RELEASE),
            wake_first: script(WAKE_FIRST),
            renew: script(RENEW),
            renew_many: script(RENEW_MANY),
            shared_acquire: script(SHARED_ACQUIRE),
            shared_release: script(SHARED_RELEASE),
            shared_renew: script(SHARED_RENEW),
            proclaim: script(PROCLAIM),
            holder: script(HOLDER),
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

/// The scripts of `node`: sharded on a cluster.
fn of(node: &Node) -> &'static Scripts {
    scripts(node.cluster)
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
    /// The lock, its fence counter, its waiting line and its value.
    LineAndValue,
    /// As `LineAndValue`, and the token of the lock's last release.
    Release,
}

impl Keys {
    fn write(self, cmd: &mut redis::Cmd, names: &Names) {
        let all = [
            names.queue(),
            names.tickets(),
            names.value(),
            names.released_by(),
        ];
        let more = match self {
            Keys::Lock => &all[..0],
            Keys::Value => &all[2..3],
            Keys::Line => &all[..2],
            Keys::LineAndValue => &all[..3],
            Keys::Release => &all[..],
        };
        cmd.arg(2 + more.len()).arg(&names.lock).arg(names.fence());
        for name in more {
            cmd.arg(name);
        }
    }
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
        let sources = &scripts(false).sources;
        for lua in sources {
            let publishes = lua.matches("redis.call('PUBLISH',").count();
            let sharded = to_sharded(lua);
            assert_eq!(sharded.matches("redis.call('SPUBLISH',").count(), publishes);
            // No other spelling of a classic publish is left.
            let calls = sharded.to_uppercase().replace(' ', "");
            assert!(!calls.contains("'PUBLISH'") && !calls.contains("\"PUBLISH\""));
        }
    }
}
