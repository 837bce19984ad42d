//! The holder's scripts: proclaim a value beside the lock, and read the
//! holder back (its fence, lease left and value).

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
