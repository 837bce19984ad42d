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
/// or again after a reply was lost), else `{0, pttl}`.
///
/// A missing counter starts at the server's time in microseconds, not at 1:
/// a server restarted without persistence (or a failover to a replica that
/// lagged) then keeps handing out larger tokens than before, as long as the
/// server's own clock does not go backwards.
/// The common case, a free key, costs two commands inside the script
/// (`SET NX PX`, `INCR`); a counter that `INCR` had to create (it answers 1)
/// is then seeded from `TIME`.
const ACQUIRE: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if ARGV[3] == '1' then
    local fence = redis.call('INCR', KEYS[2])
    if fence == 1 then
      local now = redis.call('TIME')
      fence = now[1] * 1000000 + now[2]
      redis.call('SET', KEYS[2], fence)
    end
    return {1, fence}
  end
  return {1, 0}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
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

/// Extend the lease if the token holds the lock.
///
/// KEYS: lock. ARGV: token, lease in ms. Returns 1 if renewed, else 0.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
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
