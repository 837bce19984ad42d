//! The plain lock's scripts: acquire (with the fence counter, and why its
//! tokens only grow), release and renew.

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
/// inside the script (`SET NX PX`, `TIME`, and `SET ... GET` on the
/// counter: see `fence_lua!`), and defines none of the line's functions.
/// An attempt that counts no fence (Redlock's first, and one node's with
/// `fence=off`) is a plain `SET NX PX` instead (see `Node::acquire`).
///
/// # The fence counter, and why its tokens only grow
///
/// Every token is `max(counter + 1, TIME in µs)`, written back to the
/// counter in the same command that reads it (`SET ... GET`). The
/// counter lives beside the lock with a TTL of twice the lease, but never
/// less than ten minutes (600 000 ms in the scripts), set at every
/// acquisition and renewal, so it goes away some time after the lock: a service that locks `order:{id}` for ever more ids does not
/// grow Redis for ever. The tokens of one key strictly increase, whatever
/// happened to the counter:
///
/// - While the counter lives and is current, each token is above the last
///   one: it is at least the last one plus 1, and the clock can only
///   raise it.
/// - No token is ahead of the server's clock by more than the number of
///   acquisitions made within the same microsecond. Each acquisition is a
///   script run of several microseconds of server time (BENCHMARKS.md,
///   "Figures the code's docs cite"), and a server runs one script at a
///   time, so that number is 0:
///   every token is at most the clock's reading when it was issued.
/// - So a counter that is set back (a failover to a replica that had not
///   seen the last writes, a restart from an older RDB or AOF) or lost
///   (expired, `FLUSHALL`, a restart without persistence) is overtaken by
///   the clock: the next token is at least `TIME` now, above every token
///   issued before, as long as the server's clock did not go backwards
///   since (the seed comes from the clock, not the data). After a
///   failover that means the new master's clock is not behind the old
///   one's by more than the time the failover took: keep the servers'
///   clocks in sync (NTP), as every clock-seeded counter needs.
/// - A clock that steps back is covered while the counter lives (the
///   counter keeps counting from the last token): the TTL floor keeps it
///   alive for ten minutes after the last use, however short the lease, so only a
///   key idle that long and a clock stepped back further than that meet.
pub(super) const ACQUIRE: &str = concat!(
    fence_lua!(),
    // The common case first, before the line's functions are defined: a
    // free key. Nobody is passed over by taking it, because the key is
    // never free while a live waiter stands in line: a release hands it
    // to the first waiter (see `hand_first`).
    r"
local token = ARGV[1]
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
    return {1, fence(ARGV[2], false)}
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
    return {1, fence(ARGV[2], false)}
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
/// KEYS: as [`ACQUIRE`] (the fence counter is not touched), the
/// proclaimed value, and the last release's token. ARGV: token, release
/// channel, place in line ("" to leave the line: a release or a cancelled
/// wait; otherwise the waiter's place, as in [`ACQUIRE`]), ticket lifetime
/// in ms, holder channel.
///
/// A release leaves its token behind for what was left of its lease, so
/// that the same release sent again (its reply was lost on a cut
/// connection, and a client retried) answers 1 and changes nothing, even
/// when the next owner holds the lock by then.
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
local holder = redis.call('GET', KEYS[1])
if ARGV[3] == '' and holder == ARGV[1] then
  remember_release()
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
  if ARGV[3] == '' then remember_release() end
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
  -- Sent again after a lost reply: released already.
  if released == 0 and KEYS[6] and redis.call('GET', KEYS[6]) == ARGV[1] then
    released = 1
  end
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

/// `renew(lock, counter, value, token, lease)`, the body of [`RENEW`] and
/// [`RENEW_MANY`]: extends the lease if the token holds the lock (its
/// value marked or not, see [`RELEASE`]), and the fence counter's life
/// with it (see [`ACQUIRE`]; a key without a counter, as on Redlock, is
/// left so). Returns 1 if renewed, else 0.
///
/// A proclaimed value (see [`PROCLAIM`](super::election::PROCLAIM))
/// lives twice the lease, and is kept alive with the counter (whose TTL
/// has a floor, see [`ACQUIRE`]).
macro_rules! renew_lua {
    () => {
        r"
local function renew(lock, counter, value, token, lease)
  local holder = redis.call('GET', lock)
  if holder == token or holder == token .. '+' then
    redis.call('PEXPIRE', counter, math.max(2 * lease, 600000))
    redis.call('PEXPIRE', value, 2 * lease)
    return redis.call('PEXPIRE', lock, lease)
  end
  return 0
end
"
    };
}

/// Renews one lock (see `renew_lua!`).
///
/// KEYS: lock, fence counter, proclaimed value. ARGV: token, lease in ms.
/// Returns 1 if renewed, else 0.
pub(super) const RENEW: &str = concat!(
    renew_lua!(),
    "return renew(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])\n"
);

/// Renews many locks of one node in one call (see `renew_lua!`): a
/// watchdog tick's renewals cost the server one script call per batch
/// rather than one per lock.
///
/// KEYS: each lock's lock, fence counter and proclaimed value, in turn.
/// ARGV: each lock's token and lease in ms, in the same order. Returns 1
/// or 0 for each lock, in order.
pub(super) const RENEW_MANY: &str = concat!(
    renew_lua!(),
    r"
local renewed = {}
for i = 1, #KEYS / 3 do
  renewed[i] = renew(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], ARGV[2 * i - 1], ARGV[2 * i])
end
return renewed
"
);

#[cfg(test)]
mod tests {
    use dlock_testkit::fixture::RedisServer;
    use redis::Script;

    use crate::scripts::scripts;

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

    /// The fence is the server's clock in µs, written to the counter digit
    /// for digit, also when the µs part has fewer than six digits; and one
    /// more than the counter when the counter is ahead of the clock. The
    /// counter lives ten minutes for a short lease, twice a long one, and
    /// with `keep` never less than it had. The server's `TIME` is shadowed,
    /// so that each case is met every run.
    #[tokio::test]
    async fn the_fence_is_the_clock_in_microseconds_digit_for_digit() {
        let server = RedisServer::start().expect("redis-server");
        let mut conn = server.connection().await;
        let script = Script::new(&format!(
            "local real = redis\n\
             local redis = {{call = function(command, ...)\n\
               if command == 'TIME' then return {{ARGV[1], ARGV[2]}} end\n\
               return real.call(command, ...)\n\
             end}}\n{}\nreturn fence(ARGV[3], ARGV[4] == 'keep')",
            fence_lua!()
        ));
        let (secs, short, long) = ("1764250000", 30_000, 900_000);
        let cases = [
            // (the counter before and its TTL, TIME's µs, the lease,
            // `keep`, the fence, the counter's TTL after, at most and at
            // least)
            (
                None,
                "42",
                short,
                "",
                1_764_250_000_000_042_i64,
                (600_000, 599_000),
            ),
            (
                None,
                "0",
                short,
                "",
                1_764_250_000_000_000,
                (600_000, 599_000),
            ),
            (
                None,
                "999999",
                long,
                "",
                1_764_250_000_999_999,
                (1_800_000, 1_799_000),
            ),
            (
                Some(("1764250000000041", 5_000)),
                "42",
                short,
                "",
                1_764_250_000_000_042,
                (600_000, 599_000),
            ),
            (
                Some(("1764250009000005", 5_000)),
                "42",
                short,
                "",
                1_764_250_009_000_006,
                (600_000, 599_000),
            ),
            (
                Some(("1", 5_000_000)),
                "42",
                short,
                "keep",
                1_764_250_000_000_042,
                (5_000_000, 4_999_000),
            ),
            (
                Some(("1", 5_000)),
                "7",
                short,
                "keep",
                1_764_250_000_000_007,
                (600_000, 599_000),
            ),
        ];
        for (counter, us, lease, keep, expected, (most, least)) in cases {
            let _: () = redis::cmd("DEL")
                .arg("c")
                .query_async(&mut conn)
                .await
                .unwrap();
            if let Some((counter, ttl)) = counter {
                let _: () = redis::cmd("SET")
                    .arg("c")
                    .arg(counter)
                    .arg("PX")
                    .arg(ttl)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            let fence: i64 = script
                .key("lock")
                .key("c")
                .arg(secs)
                .arg(us)
                .arg(lease)
                .arg(keep)
                .invoke_async(&mut conn)
                .await
                .expect("fence");
            let (kept, ttl): (String, i64) = redis::pipe()
                .cmd("GET")
                .arg("c")
                .cmd("PTTL")
                .arg("c")
                .query_async(&mut conn)
                .await
                .unwrap();
            let case = format!("counter {counter:?}, µs {us}, lease {lease} {keep}");
            assert_eq!(fence, expected, "{case}");
            assert_eq!(kept, expected.to_string(), "{case}: the counter");
            assert!(
                (least..=most).contains(&ttl),
                "{case}: the counter's TTL {ttl}"
            );
        }
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
}
