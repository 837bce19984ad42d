//! Fault checks shared by the database backends (PostgreSQL, MySQL), whose
//! locks live on server sessions that the server ends with their
//! connection: a restart, a cut connection, a wait through a restart, and
//! bad servers and logins.

use std::{future::Future, time::Duration};

use dlock_core::{LockError, LockOptions, Locker};
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
