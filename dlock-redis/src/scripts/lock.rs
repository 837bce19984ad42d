//! The plain lock's acquire and release: their scripts, arguments and
//! answers.

use redis::RedisResult;

use super::{of, Keys};
use crate::{keys::Names, node::Node};

#[cfg(test)]
mod tests;

/// What one acquire attempt found on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Our token holds the lock; the fencing counter's value.
    Acquired(u64),
    /// Another token holds it: worth checking again in this many
    /// milliseconds, when its lease ends (`None` when the key has no TTL:
    /// someone wrote it without dlock, or an attempt that does not queue
    /// was refused, which does not ask how long).
    Held(Option<u64>),
    /// A release handed it to another waiter, the first in line, who has
    /// this many milliseconds left to take it.
    NotOurTurn(u64),
    /// Granted, but fewer replicas than `wait_replicas` asks for (this
    /// many) acknowledged the grant: it does not count.
    Unacknowledged(i64),
}

/// Where an attempt stands in the key's line of waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// A single attempt: it does not queue.
    None,
    /// An unfair waiter's attempt: it does not queue, and a refused one
    /// marks the holder's value, so that its release tells the waiters.
    Mark,
    /// Last in line, placed by the server's clock (one node).
    Last,
    /// At this score, the same on every node (Redlock: the waiter's clock
    /// in µs when it started waiting, so that every node orders the line
    /// alike).
    At(u64),
}

/// The script's argument: "" for none, "-" for an unfair waiter's, "0"
/// for last, else the score.
impl redis::ToRedisArgs for Place {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        match *self {
            // A release with it leaves no line: it has no place in one.
            Place::None => out.write_arg(b""),
            // The same, and a give-back: no record of a release.
            Place::Mark => out.write_arg(b"-"),
            Place::Last => out.write_arg(b"0"),
            Place::At(score) => out.write_arg_fmt(score.max(1)),
        }
    }
}

/// One acquire attempt; one that is refused takes (or refreshes) its
/// ticket at `place`, lapsing after `ticket_ms` (or, [`Place::Mark`],
/// marks the holder's value). One that neither queues, marks nor counts a
/// fence (Redlock's first, an unfair one's first) is a plain `SET NX PX`.
/// `value` is what the lock's key holds: the token and its note (see
/// [`value`]).
pub(crate) async fn acquire(
    node: &Node,
    names: &Names,
    value: &str,
    lease_ms: u64,
    fence: bool,
    place: Place,
    ticket_ms: u64,
) -> RedisResult<Attempt> {
    if place == Place::None && !fence {
        let mut set = redis::cmd("SET");
        set.arg(&names.lock)
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(lease_ms);
        let (set, acked): (Option<String>, _) = node.query(&set, true).await?;
        return Ok(match set {
            Some(_) => acknowledged(node, 0, acked),
            None => Attempt::Held(None),
        });
    }
    let in_line = !matches!(place, Place::None | Place::Mark);
    let keys = if in_line { Keys::Line } else { Keys::Lock };
    let ((status, value), acked): ((i64, i64), _) = node
        .run(&of(node).acquire, true, |cmd| {
            keys.write(cmd, names);
            cmd.arg(value)
                .arg(lease_ms)
                .arg(if fence { "1" } else { "0" });
            if place != Place::None {
                cmd.arg(names.channel());
            }
            if in_line {
                cmd.arg(place).arg(ticket_ms);
            }
        })
        .await?;
    Ok(match status {
        1 => acknowledged(node, u64::try_from(value).unwrap_or(0), acked),
        2 => Attempt::NotOurTurn(u64::try_from(value).unwrap_or(0)),
        _ => Attempt::Held(u64::try_from(value).ok()),
    })
}

/// What a plain lock's key holds: `token`, then `~`, `note` and `~` if
/// the note is not empty (a token never holds `~` or `+`; the `+` a
/// waiter's mark appends comes after).
pub(crate) fn value(token: &str, note: &str) -> String {
    if note.is_empty() {
        return token.to_owned();
    }
    let mut value = String::with_capacity(token.len() + note.len() + 2);
    value.push_str(token);
    value.push('~');
    value.push_str(note);
    value.push('~');
    value
}

/// A grant with `fence`, or [`Attempt::Unacknowledged`] if too few
/// replicas acknowledged it.
fn acknowledged(node: &Node, fence: u64, acked: Option<i64>) -> Attempt {
    match node.short_of_replicas(acked) {
        Some(acked) => Attempt::Unacknowledged(acked),
        None => Attempt::Acquired(fence),
    }
}

/// Releases the lock if `token` holds it (see [`RELEASE`]): with
/// `Place::None` the token also leaves the line, otherwise it stays at
/// `place` (a Redlock grant given back).
pub(crate) async fn release(
    node: &Node,
    names: &Names,
    token: &str,
    place: Place,
    ticket_ms: u64,
) -> RedisResult<bool> {
    release_with(node, Keys::Release, names, token, place, ticket_ms).await
}

/// [`release`] for `force_release`, with the holder's value (its token,
/// marked or not): it leaves no record of a release, so the holder's own
/// release still answers `false`.
pub(crate) async fn force_release(node: &Node, names: &Names, holder: &str) -> RedisResult<bool> {
    let token = holder.split(['~', '+']).next().unwrap_or(holder);
    release_with(node, Keys::LineAndValue, names, token, Place::None, 0).await
}

async fn release_with(
    node: &Node,
    keys: Keys,
    names: &Names,
    token: &str,
    place: Place,
    ticket_ms: u64,
) -> RedisResult<bool> {
    let (released, _): (i64, _) = node
        .run(&of(node).release, false, |cmd| {
            keys.write(cmd, names);
            cmd.arg(token)
                .arg(names.channel())
                .arg(place)
                .arg(ticket_ms)
                .arg(names.holder_channel());
        })
        .await?;
    Ok(released == 1)
}

/// Acquire in one round trip.
///
/// KEYS: lock, fence counter, line, ticket lapses. ARGV: token, lease in
/// ms, "1" to count a fencing token, and for an attempt that queues if
/// refused: release channel, place in line ("0": last, by the server's
/// clock; else the score), ticket lifetime in ms. An attempt that does not
/// queue leaves out those three arguments and the line's two keys; an
/// unfair waiter's passes the release channel alone, and if refused marks
/// the holder's value as a waiter in line does, so that its release
/// publishes (see [`RELEASE`]).
///
/// Returns `{1, fence}` when the token holds the lock (newly, handed over
/// by a release, or again after a lost reply; a fence asked for is never
/// 0); `{0, ms}` when another token holds it for `ms` more; `{2, ms}` when
/// a release handed it to another waiter, who has `ms` left to take it.
///
/// A free key goes to whoever asks first: it is never free while a live
/// waiter stands in line, because a release hands the lock to the first
/// waiter (`hand_first`); only a crash frees a key with waiters in line.
/// The common case costs three commands (`SET NX PX`, `TIME`, `SET ...
/// GET`). Why the fence only grows, whatever befalls its counter: the
/// crate docs, "How it locks".
pub(super) const ACQUIRE: &str = concat!(
    fence_lua!(),
    // The common case first, before the line's functions are defined.
    r"
-- ARGV[1]: the value to store, the token, and '~' note '~' if any.
local value = ARGV[1]
local token = string.match(value, '^[^~]*')
-- `in_line`: the token may have a ticket, to take out; if others still
-- wait, the lock's value is marked (see `RELEASE`), unless `marked`
-- already.
local function granted(in_line, marked)
  if in_line then
    redis.call('ZREM', KEYS[3], token)
    redis.call('ZREM', KEYS[4], token)
    if not marked and redis.call('EXISTS', KEYS[3]) == 1 then
      redis.call('SET', KEYS[1], value .. '+', 'KEEPTTL')
    end
  end
  if ARGV[3] == '1' then
    return {1, fence(ARGV[2], false)}
  end
  return {1, 0}
end
if redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2]) then
  return granted(ARGV[5])
end
",
    queue_lua!(),
    r"
local holder = redis.call('GET', KEYS[1])
if holder and string.match(holder, '^[^~+]*') == token then
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
    return {1, fence(ARGV[2], false)}
  end
  return {1, 0}
end
if holder == 'next:' .. token then
  -- Handed to us by a release: take it, with a new fence, marked
  -- whoever is left in line: an unfair waiter of the hold we follow
  -- heard nothing, and our release must tell it.
  redis.call('SET', KEYS[1], value .. '+', 'PX', ARGV[2])
  return granted(true, true)
end
local ttl = redis.call('PTTL', KEYS[1])
if not ARGV[5] then
  -- An attempt that does not queue: it names the lock and the counter
  -- only, and never touches the line.
  if string.sub(holder, 1, 5) == 'next:' then return {2, math.max(ttl, 0)} end
  if ARGV[4] and string.sub(holder, -1) ~= '+' then
    -- An unfair waiter: the holder's release must tell it.
    redis.call('SET', KEYS[1], holder .. '+', 'KEEPTTL')
  end
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

/// Wakes every waiter of the key without handing anyone the lock: for a
/// lease moved earlier ([`Backend::extend`](dlock_core::backend::Backend::extend),
/// a release before `hold_at_least`), which frees the key sooner than the
/// waiters were told. Woken, each looks again and learns the new end:
/// unfair waiters stand in no line, so naming the first would miss them.
pub(crate) async fn wake_first(node: &Node, names: &Names) -> RedisResult<()> {
    let (_, _): (i64, _) = node
        .run(&of(node).wake_first, false, |cmd| {
            Keys::Line.write(cmd, names);
            cmd.arg(names.channel());
        })
        .await?;
    Ok(())
}

/// KEYS: as [`ACQUIRE`]'s that queue. ARGV: release channel. Returns 0.
/// The empty message wakes every waiter of the key, in line or not.
pub(super) const WAKE_FIRST: &str = r"
redis.call('PUBLISH', ARGV[1], '')
return 0
";

/// Release, or give back a grant and stay in line.
///
/// KEYS: as [`ACQUIRE`] (the counter untouched), the proclaimed value, and
/// the last release's token. ARGV: token, release channel, place in line
/// ("" to leave the line; "-" the same for an unfair waiter's give-back,
/// which leaves no record of a release; else the waiter's place, as in
/// [`ACQUIRE`]),
/// ticket lifetime in ms, holder channel. Returns 1 if the token held the
/// lock, else 0.
///
/// A release leaves its token for what was left of the lease, so the same
/// release sent again after a lost reply answers 1 and changes nothing. A
/// holder's value is marked (`+`) once someone stands in line, so an
/// unmarked release needs no read of the line (`GET` and `DEL`). A lock
/// left free goes to the first waiter in line, whom a message naming it
/// wakes; a give-back (Redlock) never hands it to its own waiter.
pub(super) const RELEASE: &str = concat!(
    // The common case first: a holder's release with nobody in line (its
    // value is unmarked).
    r"
local function remember_release()
  if KEYS[6] then
    local left = redis.call('PTTL', KEYS[1])
    if left > 0 then redis.call('SET', KEYS[6], ARGV[1], 'PX', left) end
  end
end
-- The token of a lock's value (see `ACQUIRE`), marked or not.
local function owner(v) return v and string.match(v, '^[^~+]*') end
local holder = redis.call('GET', KEYS[1])
-- '': a release; '-': an unfair waiter's give-back, which leaves no
-- record; else a give-back that stays in line at that place.
local leave = ARGV[3] == '' or ARGV[3] == '-'
if leave and owner(holder) == ARGV[1] and string.sub(holder, -1) ~= '+' then
  if KEYS[6] and ARGV[3] == '' then
    -- The token becomes the last release's, with what was left of the
    -- lease (`RENAME` keeps the TTL, which every lock key has): one
    -- command for `remember_release` and the `DEL`.
    redis.call('RENAME', KEYS[1], KEYS[6])
  else
    redis.call('DEL', KEYS[1])
  end
  -- A proclaimed value goes with the hold, and its watchers are told.
  if KEYS[5] and redis.call('DEL', KEYS[5]) == 1 then
    redis.call('PUBLISH', ARGV[5], '')
  end
  return 1
end
",
    queue_lua!(),
    r"
local released = 0
if owner(holder) == ARGV[1] then
  released = 1
  if ARGV[3] == '' then remember_release() end
  redis.call('DEL', KEYS[1])
  -- A proclaimed hold: its value goes with it, and its watchers are told.
  if KEYS[5] and redis.call('DEL', KEYS[5]) == 1 then
    redis.call('PUBLISH', ARGV[5], '')
  end
elseif holder == 'next:' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
end
if leave then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  -- Free, with nobody in line to hand it to: a marked hold may have had
  -- unfair waiters, whom an empty message wakes.
  if redis.call('EXISTS', KEYS[1]) == 0 and not hand_first(ARGV[2], nil)
      and string.sub(holder or '', -1) == '+' then
    redis.call('PUBLISH', ARGV[2], '')
  end
  -- Sent again after a lost reply: released already.
  if released == 0 and ARGV[3] == '' and KEYS[6]
      and owner(redis.call('GET', KEYS[6])) == ARGV[1] then
    released = 1
  end
else
  local now_us, now = clock()
  enqueue(ARGV[1], ARGV[3], ARGV[4], now_us, now)
  local after = redis.call('GET', KEYS[1])
  if not after then
    -- Free: the first waiter but us is handed it; if none, a marked
    -- hold's unfair waiters are told, as a release tells them.
    if not hand_first(ARGV[2], ARGV[1]) and string.sub(holder or '', -1) == '+' then
      redis.call('PUBLISH', ARGV[2], '')
    end
  elseif string.sub(after, 1, 5) ~= 'next:' and string.sub(after, -1) ~= '+' then
    -- Someone else holds it, and now someone waits: marked, so that its
    -- release hands the lock on (see above).
    redis.call('SET', KEYS[1], after .. '+', 'KEEPTTL')
  end
end
return released
"
);
