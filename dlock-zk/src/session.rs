//! The ZooKeeper session every lock node of a backend lives on: its
//! liveness is confirmed by a request every third of the session timeout,
//! which moves the lease end of every guard on it; its expiry loses them all.

use std::{
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use dlock_core::{
    backend::{ConnectionStates, SessionHolders},
    LostReason, Token,
};
use tokio::time::Instant;
use zookeeper_client::{Client, Connector, SessionState};

pub(crate) struct Session {
    /// `None` once the session was given up: the last clone of the client
    /// dropped closes the session, and its nodes go with it.
    client: Mutex<Option<Client>>,
    pub(crate) id: i64,
    pub(crate) timeout: Duration,
    /// The guards on this session; "renewed" is when the server last
    /// answered a request of it, so it lives until `timeout` later. Its
    /// `expired()` completes once the session expired or was given up.
    pub(crate) holders: SessionHolders<()>,
}

impl Session {
    pub(crate) async fn start(
        connector: Option<&Connector>,
        servers: &str,
        timeout: Duration,
        states: &ConnectionStates,
    ) -> Result<Arc<Session>, zookeeper_client::Error> {
        let sent = Instant::now();
        let client = connector
            .cloned()
            .unwrap_or_else(Client::connector)
            .with_session_timeout(timeout)
            .with_connection_timeout(timeout)
            .connect(servers)
            .await?;
        let session = Arc::new(Session {
            timeout: client.session_timeout(),
            id: client.session_id().0,
            client: Mutex::new(Some(client)),
            holders: SessionHolders::reporting_to(sent, states.clone()),
        });
        tokio::spawn(monitor(Arc::downgrade(&session)));
        Ok(session)
    }

    fn slot(&self) -> MutexGuard<'_, Option<Client>> {
        self.client.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The session's client; [`SessionExpired`](zookeeper_client::Error::SessionExpired)
    /// once the session was given up.
    pub(crate) fn client(&self) -> Result<Client, zookeeper_client::Error> {
        self.slot()
            .clone()
            .ok_or(zookeeper_client::Error::SessionExpired)
    }

    /// Gives the session up: every guard on it is lost now, waits on it
    /// end, and the client is dropped, which closes the session (or, with
    /// the servers unreachable, lets it expire within its timeout).
    pub(crate) fn abandon(&self) {
        if self.holders.expire() {
            tracing::warn!(session = self.id, "dlock zookeeper session abandoned");
        }
        self.slot().take();
    }

    /// Usable for new locks: not expired, and confirmed recently enough
    /// that a new lock would not be lost at once.
    pub(crate) fn is_usable(&self) -> bool {
        !self.holders.is_expired() && self.holders.renewed_at().elapsed() < self.timeout * 2 / 3
    }

    /// Stops tracking a lock that is being released.
    pub(crate) fn forget(&self, token: &Token) {
        self.holders.forget(token, LostReason::NotHeld);
    }

    fn expire(&self) {
        if self.holders.expire() {
            tracing::warn!("dlock zookeeper session expired");
        }
    }
}

/// Confirms the session every third of its timeout, and expires it on the
/// server's word or once a whole timeout passed unconfirmed. While
/// disconnected, guards stay held (not lost) until then.
async fn monitor(session: Weak<Session>) {
    let Some((mut states, period)) = session.upgrade().and_then(|s| {
        let client = s.client().ok()?;
        Some((client.state_watcher(), s.timeout / 3))
    }) else {
        return;
    };
    loop {
        let state = tokio::select! {
            _ = tokio::time::sleep(period) => None,
            state = states.changed() => Some(state),
        };
        let Some(session) = session.upgrade() else {
            return;
        };
        match state {
            Some(SessionState::Expired | SessionState::Closed | SessionState::AuthFailed) => {
                session.expire();
                return;
            }
            // Held by our clock until the session timeout runs out, but
            // nobody can tell meanwhile.
            Some(SessionState::Disconnected) => session.holders.unsure(),
            _ => {}
        }
        let Ok(client) = session.client() else {
            return;
        };
        let sent = Instant::now();
        // `sync` goes through the leader: a follower cut off from it cannot
        // answer, while a plain read would be served by the follower alone.
        match tokio::time::timeout(period, client.sync("/")).await {
            Ok(Ok(_)) => session.holders.renewed(sent, session.timeout),
            Ok(Err(zookeeper_client::Error::SessionExpired)) => {
                session.expire();
                return;
            }
            _ => {
                if session.holders.renewed_at().elapsed() >= session.timeout {
                    session.expire();
                    return;
                }
            }
        }
    }
}
