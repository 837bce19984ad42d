//! The plain lock's scripts, run on a real server.

use dlock_testkit::fixture::RedisServer;
use redis::{AsyncCommands, Script};

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
    // (the counter before and its TTL, TIME's µs, the lease, `keep`, the
    // fence minus `secs` in µs, the counter's TTL after in s, at most and
    // less than a second under)
    let cases = [
        (None, "42", short, "", 42, 600),
        (None, "0", short, "", 0, 600),
        (None, "999999", long, "", 999_999, 1_800),
        (Some(("1764250000000041", 5_000)), "42", short, "", 42, 600),
        (
            Some(("1764250009000005", 5_000)),
            "42",
            short,
            "",
            9_000_006,
            600,
        ),
        (Some(("1", 5_000_000)), "42", short, "keep", 42, 5_000),
        (Some(("1", 5_000)), "7", short, "keep", 7, 600),
    ];
    for (counter, us, lease, keep, fence_past, ttl_s) in cases {
        let expected = 1_764_250_000_000_000_i64 + fence_past;
        let (most, least) = (ttl_s * 1000, ttl_s * 1000 - 1000);
        let () = conn.del("c").await.unwrap();
        if let Some((counter, ttl)) = counter {
            let () = conn.pset_ex("c", counter, ttl).await.unwrap();
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
        let (kept, ttl): (String, i64) = (
            get(&mut conn, "c").await.unwrap(),
            conn.pttl("c").await.unwrap(),
        );
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
    let () = conn.del("dlock:{k}:fence").await.expect("DEL");
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
        let dead = format!("dead{i}");
        let () = conn
            .zadd("dlock:{k}:queue", &dead, i + 1)
            .await
            .expect("ZADD");
        let () = conn
            .zadd("dlock:{k}:tickets", &dead, 1)
            .await
            .expect("ZADD");
    }
    assert_eq!(acquire(&mut conn, "live").await.0, 0, "held: live queues");
    assert_eq!(release(&mut conn, "holder").await, 1);
    let handed = get(&mut conn, "dlock:{k}").await;
    assert_eq!(handed.as_deref(), Some("next:live"));
}

async fn get(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    conn.get(key).await.expect("GET")
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

/// An unfair Redlock waiter's give-back (`Place::Mark`) leaves no record
/// of a release: the same token's later release on that node must not
/// count it as released (it would help a majority it never held).
#[tokio::test]
async fn an_unfair_give_back_is_not_remembered_as_a_release() {
    use crate::scripts::lock::Place;
    let server = RedisServer::start().expect("redis-server");
    let mut conn = server.connection().await;
    let release = |place: Place| {
        let mut call = on_key(&scripts(false).release);
        call.key("dlock:{k}:value")
            .key("dlock:{k}:released_by")
            .arg("tok")
            .arg("dlock:{k}:released")
            .arg(place)
            .arg(0)
            .arg("dlock:{k}:holder");
        call
    };
    assert_eq!(acquire_queued(&mut conn, "tok", false).await.0, 1);
    let gave: i64 = release(Place::Mark)
        .invoke_async(&mut conn)
        .await
        .expect("give back");
    assert_eq!(gave, 1, "the give-back released the partial grant");
    assert_eq!(get(&mut conn, "dlock:{k}").await, None);
    let again: i64 = release(Place::None)
        .invoke_async(&mut conn)
        .await
        .expect("release");
    assert_eq!(again, 0, "a give-back counted as the token's release");
}
