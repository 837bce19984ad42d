//! Checks of a dialect's statements on real servers, which every
//! dialect's tests run.

use std::{fmt, time::Duration};

use dlock_core::{backend::Mode, LockError, LockKey, Token};

use crate::{Dialect, Refusal, ServerSession};

/// The dialect of `url`, and a session of it with the dialect's setup done.
///
/// # Panics
///
/// If the URL is refused, or the session or the setup fails.
pub async fn set_up<D: Dialect>(url: &str) -> (D, D::Conn) {
    let dialect = D::new(D::parse_url(url).expect("the URL"));
    let (mut session, _) = dialect.open().await.expect("open a session");
    dialect.setup(&mut session).await.expect("set up");
    (dialect, session)
}

/// A dropped wait's session is ended by identifier from another
/// connection, which may reach another server (a failover, a virtual IP)
/// where that identifier is another client's session. Aimed at server A's
/// session, an end sent to server B, where a session holding a lock has
/// the same identifier, ends nothing there; nor does one aimed at an
/// earlier session of the identifier on B (a restart). Aimed right, it
/// ends the session. `a` and `b` are the URLs of two servers.
///
/// # Panics
///
/// If the dialect fails the check.
pub async fn ending_a_session_by_id_ends_nothing_on_another_server<D: Dialect>(a: &str, b: &str) {
    let a = D::new(D::parse_url(a).expect("A's URL"));
    let (mut killer_a, _) = a.open().await.expect("A's session");
    let (b, mut killer_b) = set_up::<D>(b).await;
    let (mut aimed_conn, aimed) = a.open().await.expect("A's waiter session");
    let (mut victim, on_b) = b.open().await.expect("B's session");
    let id = b.lock_id(&LockKey::new("victim").unwrap(), Mode::Exclusive);
    let held = b.try_lock(&mut victim, &id, Mode::Exclusive).await;
    assert!(held.unwrap().is_some(), "B's session takes the free key");
    assert_ne!(aimed.incarnation, on_b.incarnation);

    // The identifiers of two servers collide by chance: made here by
    // giving B's session's identifier with A's session's incarnation.
    let collided = ServerSession {
        id: on_b.id,
        incarnation: aimed.incarnation.clone(),
    };
    let restarted = ServerSession {
        id: on_b.id,
        incarnation: format!("{}0", on_b.incarnation),
    };
    for (what, target) in [("A's", &collided), ("an earlier", &restarted)] {
        b.end_session(&mut killer_b, target)
            .await
            .expect("end_session");
        tokio::time::sleep(Duration::from_millis(300)).await;
        b.ping(&mut victim).await.unwrap_or_else(|e| {
            panic!("a kill aimed at {what} session ended B's session of the same id: {e}")
        });
        let taken = b.try_lock(&mut killer_b, &id, Mode::Exclusive).await;
        assert_eq!(taken.unwrap(), None, "B's lock was freed");
    }

    a.end_session(&mut killer_a, &aimed)
        .await
        .expect("end_session");
    // Ending one is a signal the server takes in its own time.
    for _ in 0..50 {
        if a.ping(&mut aimed_conn).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the session aimed at lives on");
}

/// Every statement that takes or gives back a lock, and the ping, on
/// `session`, whose recorded server session the caller changed (as if a
/// pooler had moved the connection to another server session): each
/// answers [`Refusal::SessionMoved`]. The caller then checks
/// that they took nothing (no lock, no queue entry, no fencing token, no
/// holder record).
///
/// # Panics
///
/// If a statement answers anything else.
pub async fn statements_off_their_session_answer_moved<D: Dialect>(
    dialect: &D,
    session: &mut D::Conn,
) {
    let key = LockKey::new("moved").unwrap();
    let token = Token::generate();
    let moved = |what: &str, e: sqlx::Error| {
        let moved = matches!(Refusal::of(&e), Some(Refusal::SessionMoved { .. }));
        assert!(moved, "{what}: {e}");
    };
    moved("ping", dialect.ping(session).await.unwrap_err());
    for mode in [Mode::Exclusive, Mode::Read, Mode::Write] {
        let id = dialect.lock_id(&key, mode);
        if dialect.queues(mode) {
            let e = dialect.enqueue(session, &id, mode, &token).await;
            moved("enqueue", e.unwrap_err());
            continue;
        }
        moved(
            "try_lock",
            dialect.try_lock(session, &id, mode).await.unwrap_err(),
        );
        let limit = Some(Duration::from_millis(10));
        let e = dialect.wait(session, &id, mode, limit).await;
        moved("wait", e.unwrap_err());
        moved(
            "unlock",
            dialect.unlock(session, &id, mode).await.unwrap_err(),
        );
    }
    let permits = Mode::Permits { count: 1, limit: 1 };
    let id = dialect.lock_id(&key, permits);
    let e = dialect.enqueue(session, &id, permits, &token).await;
    moved("enqueue", e.unwrap_err());
    moved(
        "dequeue",
        dialect.dequeue(session, &token).await.unwrap_err(),
    );
    let plain = dialect.lock_id(&key, Mode::Exclusive);
    let e = dialect.proclaim(session, &plain, &token, 1, b"v").await;
    moved("proclaim", e.unwrap_err());
    let e = dialect.disclaim(session, &plain, &token).await;
    moved("disclaim", e.unwrap_err());
}

/// The config of `url`, whose user is `app`, host `db` and password
/// `s3cr@t` (written `s3cr%40t`), and malformed URLs of its scheme with
/// the password `s3cret`: no config's `Debug`, and no error, shows the
/// password.
///
/// # Panics
///
/// If one does.
pub fn configs_never_show_the_password<D: Dialect>(url: &str)
where
    D::Config: fmt::Debug,
{
    let shown = format!("{:?}", D::parse_url(url).unwrap());
    assert!(!shown.contains("s3cr"), "{shown}");
    assert!(
        shown.contains("\"app\"") && shown.contains("\"db\""),
        "{shown}"
    );
    let (scheme, _) = url.split_once("://").unwrap();
    for bad in [
        "app:s3cret@h:port/d",
        "app:s3cret@h:1/d?session_timeout=10",
        "app:s3cret@h:1/d?lock_prefix=Bad",
        "app:s3cret@h:1/d?unknown_driver_option=1",
        "app:s3cr%4@h:1/d",
    ] {
        let bad = format!("{scheme}://{bad}");
        let shown = match D::parse_url(&bad) {
            Ok(config) => vec![format!("{config:?}")],
            Err(e) => vec![e.to_string(), format!("{e:?}")],
        };
        for shown in shown {
            assert!(!shown.contains("s3cr"), "{bad}: {shown}");
        }
    }
}

/// Each of `urls` is refused with [`LockError::InvalidOptions`].
///
/// # Panics
///
/// If one is not.
pub fn urls_are_refused<D: Dialect>(urls: &[&str]) {
    for url in urls {
        let refused = matches!(D::parse_url(url), Err(LockError::InvalidOptions { .. }));
        assert!(refused, "{url}");
    }
}
