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
    let written: i64 = node
        .run(&of(node).proclaim, |cmd| {
            Keys::Value.write(cmd, names);
            cmd.arg(token).arg(value).arg(names.holder_channel());
        })
        .await?;
    Ok(written == 1)
}

/// The plain lock's holder: its fence, the lease it has left, and
/// what it proclaimed.
pub(crate) async fn holder(node: &Node, names: &Names) -> RedisResult<Option<HolderRead>> {
    let read: Option<Vec<Vec<u8>>> = node
        .run(&of(node).holder, |cmd| Keys::Value.write(cmd, names))
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
pub(super) const PROCLAIM: &str = r"
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
