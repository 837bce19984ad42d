//! The holder's scripts: proclaim a value beside the lock, and read the
//! holder back (its fence, lease left and value).

use std::time::Duration;

use redis::{ErrorKind, RedisError, RedisResult};

use super::{of, Keys};
use crate::{keys::Names, node::Node};

/// A plain lock's holder, as the holder script reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HolderRead {
    /// Its token.
    pub(crate) token: String,
    /// The fence counter, `None` if the key has none (locks without
    /// fences).
    pub(crate) fence: Option<u64>,
    /// The lease it has left, if the key has one.
    pub(crate) lease_left: Option<Duration>,
    /// The note stored with the grant, if any.
    pub(crate) note: Option<String>,
    /// What it proclaimed, if it has.
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

/// The plain lock's holder: its token, fence, the lease it has left, its
/// note and what it proclaimed.
pub(crate) async fn holder(node: &Node, names: &Names) -> RedisResult<Option<HolderRead>> {
    let (read, _): (Option<Vec<Vec<u8>>>, _) = node
        .run(&of(node).holder, false, |cmd| Keys::Value.write(cmd, names))
        .await?;
    read.map(parse_holder).transpose()
}

/// A holder from [`HOLDER`]'s answer.
fn parse_holder(mut read: Vec<Vec<u8>>) -> RedisResult<HolderRead> {
    if read.len() != 7 {
        return Err(RedisError::from((
            ErrorKind::Parse,
            "the holder script answered in an unknown shape",
        )));
    }
    let text = |at: usize| String::from_utf8_lossy(&read[at]).into_owned();
    let number = |at: usize| -> Option<u64> { std::str::from_utf8(&read[at]).ok()?.parse().ok() };
    let token = text(0);
    let fence = number(1).filter(|&fence| fence > 0);
    // A key without a TTL is not a lock of ours: no end to wait for.
    let lease_left = number(2).map(Duration::from_millis);
    let note = (read[3] == b"1").then(|| text(4));
    let value = (read[5] == b"1").then(|| std::mem::take(&mut read[6]));
    Ok(HolderRead {
        token,
        fence,
        lease_left,
        note,
        value,
    })
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
if not holder or string.match(holder, '^[^~+]*') ~= ARGV[1] then return 0 end
local ttl = math.max(redis.call('PTTL', KEYS[1]), 1)
redis.call('SET', KEYS[3], ARGV[1] .. '|' .. ARGV[2], 'PX', 2 * ttl)
redis.call('PUBLISH', ARGV[3], '')
return 1
";

/// Who holds the lock (`Backend::holder`): its token, fence, lease left,
/// note (the lock's value is the token, then `~`, the note and `~` if it
/// has one, then `+` if marked), and the value it proclaimed, if the value
/// key is its own; a lock handed to a waiter not yet taken is free.
/// KEYS: as [`PROCLAIM`]. Returns nil if nobody holds it, else `{token,
/// fence, ms, has_note, note, has_value, value}`, `ms` the lease left
/// (negative without one), `has_*` "1" or "0".
pub(super) const HOLDER: &str = r"
local holder = redis.call('GET', KEYS[1])
if not holder or string.sub(holder, 1, 5) == 'next:' then return nil end
if string.sub(holder, -1) == '+' then holder = string.sub(holder, 1, -2) end
local token = string.match(holder, '^[^~]*')
local note = {'0', ''}
if #holder > #token + 1 then note = {'1', string.sub(holder, #token + 2, -2)} end
local fence = redis.call('GET', KEYS[2]) or '0'
local ttl = tostring(redis.call('PTTL', KEYS[1]))
local stored = redis.call('GET', KEYS[3])
local mine = token .. '|'
local value = {'0', ''}
if stored and string.sub(stored, 1, #mine) == mine then
  value = {'1', string.sub(stored, #mine + 1)}
end
return {token, fence, ttl, note[1], note[2], value[1], value[2]}
";
