//! The holder's scripts: proclaim a value beside the lock, and read the
//! holder back (its fence, lease left and value).

use std::time::Duration;

use redis::{ErrorKind, RedisError, RedisResult};

use super::{of, Keys};
use crate::{keys::Names, node::Node};

/// A plain lock's holder, as the holder script reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HolderRead {
    pub(crate) fence: u64,
    /// The lease it has left, if the key has one.
    pub(crate) lease_left: Option<Duration>,
    pub(crate) value: Option<Vec<u8>>,
}

/// Publishes `value` as what `token`, the holder of the plain lock,
/// says; `false` if it does not hold it.
pub(crate) async fn proclaim(
    node: &Node,
    names: &Names,
    token: &str,
    value: &[u8],
) -> RedisResult<bool> {
    let (written, _): (i64, _) = node
        .run(&of(node).proclaim, false, |cmd| {
            Keys::Value.write(cmd, names);
            cmd.arg(token).arg(value).arg(names.holder_channel());
        })
        .await?;
    Ok(written == 1)
}

/// The plain lock's holder: its fence, the lease it has left, and
/// what it proclaimed.
pub(crate) async fn holder(node: &Node, names: &Names) -> RedisResult<Option<HolderRead>> {
    let (read, _): (Option<Vec<Vec<u8>>>, _) = node
        .run(&of(node).holder, false, |cmd| Keys::Value.write(cmd, names))
        .await?;
    let Some(mut read) = read else {
        return Ok(None);
    };
    let value = (read.len() > 2).then(|| read.swap_remove(2));
    let number =
        |at: usize| -> Option<i64> { std::str::from_utf8(read.get(at)?).ok()?.parse().ok() };
    let fence = number(0)
        .and_then(|fence| u64::try_from(fence).ok())
        .filter(|&fence| fence > 0)
        .ok_or_else(|| {
            RedisError::from((
                ErrorKind::Parse,
                "the lock is held, but its fence counter is missing",
            ))
        })?;
    // A key without a TTL is not a lock of ours: no end to wait for.
    let lease_left = number(1)
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis);
    Ok(Some(HolderRead {
        fence,
        lease_left,
        value,
    }))
}

/// Publish what the holder says (`Backend::proclaim`) if the token holds
/// the lock.
///
/// The value key holds the token, `|`, and the value, so an earlier
/// holder's value is never read as the current one's; it lives twice the
/// lock's remaining lease, renewed with the lock, and every release
/// deletes it and tells the holder's watchers (an empty message on the
/// holder channel). The lock's value, and its `+` mark, are left alone.
///
/// KEYS: lock, fence counter, proclaimed value. ARGV: token, value,
/// holder channel. Returns 1 if written, else 0.
pub(super) const PROCLAIM: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder ~= ARGV[1] and holder ~= ARGV[1] .. '+' then return 0 end
local ttl = math.max(redis.call('PTTL', KEYS[1]), 1)
redis.call('SET', KEYS[3], ARGV[1] .. '|' .. ARGV[2], 'PX', 2 * ttl)
redis.call('PUBLISH', ARGV[3], '')
return 1
";

/// Who holds the lock (`Backend::holder`): its fence and the value it
/// proclaimed, if the value key is its own; a lock handed to a waiter not
/// yet taken is free. KEYS: as [`PROCLAIM`]. Returns nil if nobody holds
/// it, else `{fence, ms}` or `{fence, ms, value}`, `ms` the lease left.
pub(super) const HOLDER: &str = r"
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
