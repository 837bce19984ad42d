//! The Lua scripts: each runs atomically on the server, so checking the
//! owner and acting on the key can never be split by another client.
//!
//! Deliberately not used: `SETNX` followed by `EXPIRE` (a crash between the
//! two leaves a lock that never expires), the `SETNX`/`GETSET` timestamp
//! scheme (it trusts every client's clock to agree), and a plain `DEL` on
//! release (after a lease ran out it deletes the next owner's lock).

use std::sync::OnceLock;

use redis::Script;

/// Acquire in one round trip.
///
/// KEYS: lock, fence counter. ARGV: token, lease in ms, "1" to count a
/// fencing token. Returns `{1, fence}` when the token holds the lock (newly,
/// or again after a reply was lost), else `{0, pttl}`. With fencing asked
/// for, the fence is never 0.
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
///
/// The common case, a free key with a live counter, costs three commands
/// inside the script (`SET NX PX`, `INCR`, `PEXPIRE`).
const ACQUIRE: &str = r"
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
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if ARGV[3] == '1' then
    return {1, fence()}
  end
  return {1, 0}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
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
return {0, redis.call('PTTL', KEYS[1])}
";

/// Release if the token holds the lock, and publish it on the channel.
///
/// KEYS: lock. ARGV: token, channel, "1" to publish. A Redlock round that
/// won too few nodes gives them back without publishing: nobody was
/// waiting for a lock that was never held, and waking the waiters (itself
/// included) would make them spin.
/// Returns 1 if released, else 0.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[3] == '1' then
    redis.call('PUBLISH', ARGV[2], '')
  end
  return 1
end
return 0
";

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
        scripts()
            .acquire
            .key("dlock:{k}")
            .key("dlock:{k}:fence")
            .arg(token)
            .arg(10_000)
            .arg("1")
            .invoke_async(conn)
            .await
            .expect("acquire script")
    }

    /// The branch for a token that holds the lock already (its first reply
    /// was lost) never answers a fence of 0, or one below an earlier token,
    /// though the counter is gone.
    #[tokio::test]
    async fn re_acquiring_without_a_counter_gives_a_greater_fence() {
        let server = RedisServer::start().expect("redis-server");
        let client = redis::Client::open(server.url()).expect("url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
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
