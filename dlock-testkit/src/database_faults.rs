//! Fault checks shared by the database backends (PostgreSQL, MySQL), whose
//! locks live on server sessions that the server ends with their
//! connection: a restart, a cut connection, a wait through a restart, and
//! bad servers and logins.

use std::{future::Future, time::Duration};

use dlock_core::{backend::Mode, LockError, LockOptions, Locker};
use tokio::time::Instant;

use crate::fixture::{FixtureError, TcpProxy};

/// Restarts the server (a crash: it keeps its data) while `holder` holds
/// two locks: `other` gets the held key once the server is back, with a
/// greater fencing token, and both of the holder's guards report lost at
/// their session's next ping, within a third of `session` (the window in
/// which the server has already let the key go).
///
/// # Panics
///
/// When a check fails. Runs `restart` on a multi-threaded runtime's
/// worker ([`tokio::task::block_in_place`]).
pub async fn check_restart_loses_every_guard(
    holder: &Locker,
    other: &Locker,
    session: Duration,
    restart: impl FnOnce() -> Result<(), FixtureError>,
) {
    let held = holder.lock("restart").await.unwrap();
    let bystander = holder.lock("restart-bystander").await.unwrap();
    let before = held.fencing_token().unwrap();
    tokio::task::block_in_place(restart).expect("restart the server");
    let restarted = Instant::now();
    let next = other
        .lock_with("restart", LockOptions::new().wait(Duration::from_secs(30)))
        .await
        .expect("the key after the restart");
    assert!(next.fencing_token().unwrap() > before, "fencing went back");
    for guard in [&held, &bystander] {
        let learnt = tokio::time::timeout(session, guard.lost()).await;
        assert!(learnt.is_ok(), "a guard outlived its session's server");
    }
    let after = restarted.elapsed();
    println!("every guard lost {after:?} after the restart");
    assert!(after <= session / 3 + Duration::from_secs(1), "{after:?}");
    next.release().await.unwrap();
}

/// Cuts `cut`'s connections (through `proxy`, as a restarted connection
/// pooler or load balancer resets them) under a held lock: the server ends
/// the session and `other` gets the key at once, with a greater token, so
/// a store that checks tokens refuses the cut client's late writes; the
/// cut guard learns it is lost at its session's next ping, within a third
/// of `session`, and cannot release.
///
/// # Panics
///
/// When a check fails.
pub async fn check_cut_connection_hands_the_key_on(
    cut: &Locker,
    other: &Locker,
    proxy: &TcpProxy,
    session: Duration,
) {
    let guard = cut.lock("cut").await.unwrap();
    let cut_fence = guard.fencing_token().unwrap();
    proxy.block();
    let blocked = Instant::now();
    let next = other
        .lock_with("cut", LockOptions::new().wait(Duration::from_secs(5)))
        .await
        .expect("the server kept a cut session's lock");
    assert!(next.fencing_token().unwrap() > cut_fence);
    let learnt = tokio::time::timeout(session, guard.lost())
        .await
        .map(|_| blocked.elapsed());
    println!(
        "key handed on {:?} after the cut; the cut guard learnt it after {learnt:?}",
        blocked.elapsed()
    );
    assert!(
        learnt
            .as_ref()
            .is_ok_and(|after| *after <= session / 3 + Duration::from_millis(700)),
        "the cut guard did not learn it was lost within a third of its session: {learnt:?}"
    );
    assert!(guard.release().await.is_err(), "a lost guard released");
    next.release().await.unwrap();
}

/// Drops the traffic of `holed`'s connections (through `proxy`: nothing
/// is refused or reset, nothing arrives, as when a route goes dark) under
/// a held lock, while `other` waits for the key. The guard reports lost
/// within `session` by its own clock, and before `other` gets the key
/// (once the server ended the silent session), with a greater fence. A
/// `try_lock` sent through the black-holed client right away (on the
/// guard's session, with `holed` on one holder session), and the lost
/// guard's release, each answer within `bound` (without a deadline, a
/// statement waits for the operating system's TCP retries, about 15
/// minutes).
///
/// # Panics
///
/// When a check fails.
pub async fn check_a_black_holed_connection_is_bounded(
    holed: &Locker,
    other: &Locker,
    proxy: &TcpProxy,
    session: Duration,
    bound: Duration,
) {
    let guard = holed.lock("black-holed").await.expect("lock");
    let fence = guard.fencing_token();
    proxy.black_hole();
    let dark = Instant::now();
    let trying = holed.clone();
    let attempt = tokio::spawn(async move {
        tokio::time::timeout(bound, trying.try_lock("black-holed-other"))
            .await
            .map(|r| r.map(|g| g.is_some()))
    });
    let waiter = other.clone();
    let waiting = tokio::spawn(async move {
        let next = waiter
            .lock_with("black-holed", LockOptions::new().wait(6 * session))
            .await;
        (next, Instant::now())
    });
    tokio::time::timeout(session + Duration::from_secs(1), guard.lost())
        .await
        .expect("the guard did not report lost within its session timeout");
    let lost_at = Instant::now();
    let (next, taken_at) = waiting.await.expect("the waiter's task");
    let next = next.expect("the server kept a silent session's lock");
    println!(
        "black-holed guard lost after {:?}; the key taken after {:?}",
        lost_at - dark,
        taken_at - dark
    );
    assert!(
        lost_at <= taken_at,
        "the key was taken before the guard said lost"
    );
    assert!(next.fencing_token() > fence, "fencing went back");
    let attempt = attempt.await.expect("the attempt's task");
    println!("attempt after {:?}: {attempt:?}", dark.elapsed());
    assert!(
        matches!(attempt, Ok(Err(_))),
        "a try_lock through a black-holed connection, after {:?}: {attempt:?}",
        dark.elapsed()
    );
    let release = tokio::time::timeout(bound, guard.release()).await;
    assert!(
        matches!(release, Ok(Err(_))),
        "a lost guard's release through a black-holed connection: {release:?}"
    );
    next.release().await.expect("release");
}

/// A waiter whose wait the server cut short by restarting waits again on a
/// new session, within its wait limit, and gets the key (its holder's
/// session went with the restart), with a token above the holder's.
///
/// # Panics
///
/// When a check fails. Runs `restart` on a multi-threaded runtime's
/// worker.
pub async fn check_wait_outlives_a_restart(
    holder: &Locker,
    waiter: Locker,
    restart: impl FnOnce() -> Result<(), FixtureError>,
) {
    let held = holder.lock("restart-wait").await.unwrap();
    let before = held.fencing_token().unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .lock_with(
                "restart-wait",
                LockOptions::new().wait(Duration::from_secs(30)),
            )
            .await
            .map(|guard| guard.fencing_token())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "granted while held");
    tokio::task::block_in_place(restart).expect("restart the server");
    let token = waiting
        .await
        .unwrap()
        .expect("the wait ended in an error at the restart");
    assert!(token.unwrap() > before, "fencing went back");
    drop(held);
}

/// The server ends every client session (an operator's
/// `pg_terminate_backend` or `KILL`, a failover) while `holder` holds the
/// one permit of a semaphore (kept in the queue table) and `waiter` waits
/// for it with a 30 s limit: the holder's guard reports lost, the waiter
/// gets the permit soon after (within 15 s: its retry must not take its
/// own entry, left behind by its ended session, for a live one ahead of
/// it), and a third client gets the key after the waiter released it.
///
/// # Panics
///
/// When a check fails.
pub async fn check_a_queued_wait_outlives_ended_sessions<F: Future<Output = ()>>(
    holder: &Locker,
    waiter: Locker,
    third: &Locker,
    mode: Mode,
    end_sessions: F,
) {
    const KEY: &str = "queued-through-ended-sessions";
    let held = holder
        .lock_mode(KEY, mode, LockOptions::new())
        .await
        .expect("the holder's lock");
    let waiting = tokio::spawn(async move {
        waiter
            .lock_mode(KEY, mode, LockOptions::new().wait(Duration::from_secs(30)))
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "granted while held");
    end_sessions.await;
    tokio::time::timeout(Duration::from_secs(10), held.lost())
        .await
        .expect("the holder's guard never said lost after its session ended");
    let granted = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("the waiter still waits 15 s after every session ended: wedged")
        .expect("the waiter's task")
        .expect("the waiter's lock");
    granted.release().await.expect("the waiter's release");
    let next = third
        .lock_mode(KEY, mode, LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .expect("a third client is kept out of a free key");
    next.release().await.expect("the third client's release");
}

/// A lock won by waiting gives its waiter slot back at the grant: with
/// `waits` a client whose URL allows one wait at a time (`max_waiters=1`),
/// it wins a key by waiting and keeps it, then waits for a second key,
/// which `other` releases after 300 ms: granted (a slot held for the life
/// of the first lock would leave the second wait no slot until its limit).
///
/// # Panics
///
/// When a check fails.
pub async fn check_a_lock_won_by_waiting_frees_its_waiter_slot(waits: &Locker, other: &Locker) {
    let patient = || LockOptions::new().wait(Duration::from_secs(10));
    for round in 0..2 {
        let first = format!("slot-first-{round}");
        let second = format!("slot-second-{round}");
        let held = other.lock(first.as_str()).await.expect("the first key");
        let (w, key) = (waits.clone(), first.clone());
        let waiting = tokio::spawn(async move { w.lock_with(&key, patient()).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        held.release().await.expect("release the first key");
        let won = waiting
            .await
            .expect("the waiter's task")
            .expect("the first key, won by waiting");
        let held = other.lock(second.as_str()).await.expect("the second key");
        let releasing = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            held.release().await
        });
        let next = waits
            .lock_with(
                second.as_str(),
                LockOptions::new().wait(Duration::from_secs(3)),
            )
            .await
            .unwrap_or_else(|e| {
                panic!("round {round}: a second wait beside a lock won by waiting: {e}")
            });
        releasing
            .await
            .expect("the releasing task")
            .expect("release the second key");
        next.release()
            .await
            .expect("release the second key's grant");
        won.release().await.expect("release the first key's grant");
    }
}

/// Connects to each `(what, url)` with `connect`: each must be a
/// [`LockError::Backend`] within 4 s (the URLs set a connect timeout of
/// 2 s), with no panic, and its message must not show `password`.
///
/// # Panics
///
/// When a check fails.
pub async fn check_bad_servers_are_typed_errors<F, Fut, T>(
    connect: F,
    cases: &[(&str, String)],
    password: &str,
) where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<T, LockError>>,
{
    for (what, url) in cases {
        let started = Instant::now();
        let answer = connect(format!("{url}?connect_timeout=2s")).await;
        let message = match answer {
            Err(e @ LockError::Backend { .. }) => e.to_string(),
            Err(other) => panic!("{what}: expected a backend error, got {other}"),
            Ok(_) => panic!("{what}: connected"),
        };
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{what} took {:?}",
            started.elapsed()
        );
        assert!(
            !message.contains(password),
            "{what} printed the password: {message}"
        );
    }
}

/// A loopback port that accepts connections and answers bytes no database
/// speaks, until the runtime ends.
///
/// # Panics
///
/// If no port can be bound.
pub async fn garbage_speaker() -> u16 {
    let other = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = other.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = other.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = stream.write_all(b"-ERR not a database\r\n").await;
        }
    });
    port
}
