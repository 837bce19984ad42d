//! The ZooKeeper session every lock node of a backend lives on: its
//! liveness is confirmed by a request every third of the session timeout,
//! which moves the lease end of every guard on it; its expiry loses them all.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use dlock_core::{
    backend::{LossReporter, SessionHolders},
    LostReason, Token,
};
use tokio::time::Instant;
use zookeeper_client::{Client, SessionState};

pub(crate) struct Session {
    pub(crate) client: Client,
    pub(crate) timeout: Duration,
    /// The guards on this session; "renewed" is when the server last
    /// answered a request of it, so it lives until `timeout` later.
    holders: SessionHolders<()>,
}

impl Session {
    pub(crate) async fn start(
        servers: &str,
        timeout: Duration,
    ) -> Result<Arc<Session>, zookeeper_client::Error> {
        let sent = Instant::now();
        let client = Client::connector()
            .with_session_timeout(timeout)
            .with_connection_timeout(timeout)
            .connect(servers)
            .await?;
        let session = Arc::new(Session {
            timeout: client.session_timeout(),
            client,
            holders: SessionHolders::new(sent),
        });
        tokio::spawn(monitor(Arc::downgrade(&session)));
        Ok(session)
    }

    /// Usable for new locks: not expired, and confirmed recently enough
    /// that a new lock would not be lost at once.
    pub(crate) fn is_usable(&self) -> bool {
        !self.holders.is_expired() && self.holders.renewed_at().elapsed() < self.timeout * 2 / 3
    }

    /// Tracks a held lock (with a fixed lease, ending at `ends`), and
    /// returns when the session was last confirmed (see
    /// [`SessionHolders::hold`]).
    pub(crate) fn hold(
        &self,
        token: Token,
        loss: LossReporter,
        ends: Option<Instant>,
    ) -> Option<Instant> {
        self.holders.hold(token, loss, ends, ())
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
    let Some((mut states, period)) = session
        .upgrade()
        .map(|s| (s.client.state_watcher(), s.timeout / 3))
    else {
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
        let sent = Instant::now();
        // `sync` goes through the leader: a follower cut off from it cannot
        // answer, while a plain read would be served by the follower alone.
        match tokio::time::timeout(period, session.client.sync("/")).await {
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
