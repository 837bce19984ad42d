//! The ZooKeeper session every lock node of a backend lives on: its
//! liveness is confirmed by a request every third of the session timeout,
//! which moves the lease end of every guard on it; its expiry loses them all.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use dlock_core::{backend::LossReporter, LostReason, Token};
use tokio::time::Instant;
use zookeeper_client::{Client, SessionState};

pub(crate) struct Session {
    pub(crate) client: Client,
    pub(crate) timeout: Duration,
    state: Mutex<State>,
}

struct State {
    /// When the last request the server answered was sent: the server had
    /// heard from this session then, so it lives until `timeout` later.
    confirmed_at: Instant,
    expired: bool,
    holders: HashMap<Token, Holder>,
}

struct Holder {
    loss: LossReporter,
    /// A fixed lease's end: confirmations never extend the guard past it.
    ends: Option<Instant>,
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
            state: Mutex::new(State {
                confirmed_at: sent,
                expired: false,
                holders: HashMap::new(),
            }),
        });
        tokio::spawn(monitor(Arc::downgrade(&session)));
        Ok(session)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Usable for new locks: not expired, and confirmed recently enough
    /// that a new lock would not be lost at once.
    pub(crate) fn is_usable(&self) -> bool {
        let state = self.state();
        !state.expired && state.confirmed_at.elapsed() < self.timeout * 2 / 3
    }

    fn confirmed_at(&self) -> Instant {
        self.state().confirmed_at
    }

    /// Tracks a held lock (with a fixed lease, ending at `ends`), and
    /// returns when the session was last confirmed: every later
    /// confirmation, and the session's expiry, reach this guard. `None` if
    /// the session already expired.
    pub(crate) fn hold(
        &self,
        token: Token,
        loss: LossReporter,
        ends: Option<Instant>,
    ) -> Option<Instant> {
        let mut state = self.state();
        if state.expired {
            return None;
        }
        state.holders.insert(token, Holder { loss, ends });
        Some(state.confirmed_at)
    }

    /// Stops tracking a lock that is being released, telling its guard if
    /// one still listens (a release from elsewhere with its token).
    pub(crate) fn forget(&self, token: &Token) {
        if let Some(holder) = self.state().holders.remove(token) {
            holder.loss.report(LostReason::NotHeld);
        }
    }

    fn confirmed(&self, sent: Instant) {
        let mut state = self.state();
        state.confirmed_at = sent;
        for holder in state.holders.values() {
            let lease = match holder.ends {
                Some(ends) => self.timeout.min(ends.saturating_duration_since(sent)),
                None => self.timeout,
            };
            holder.loss.set_unsure(false);
            holder.loss.extend(sent, lease);
        }
    }

    fn unsure(&self) {
        for holder in self.state().holders.values() {
            holder.loss.set_unsure(true);
        }
    }

    fn expire(&self) {
        let mut state = self.state();
        if !state.expired {
            tracing::warn!("dlock zookeeper session expired");
        }
        state.expired = true;
        for (_, holder) in state.holders.drain() {
            holder.loss.report(LostReason::SessionExpired);
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
            Some(SessionState::Disconnected) => session.unsure(),
            _ => {}
        }
        let sent = Instant::now();
        // `sync` goes through the leader: a follower cut off from it cannot
        // answer, while a plain read would be served by the follower alone.
        match tokio::time::timeout(period, session.client.sync("/")).await {
            Ok(Ok(_)) => session.confirmed(sent),
            Ok(Err(zookeeper_client::Error::SessionExpired)) => {
                session.expire();
                return;
            }
            _ => {
                if session.confirmed_at().elapsed() >= session.timeout {
                    session.expire();
                    return;
                }
            }
        }
    }
}
