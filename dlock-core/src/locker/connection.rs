//! What a backend knows of its connection to the servers:
//! [`ConnectionState`], as [`Locker::state`](crate::Locker::state) reports
//! it, and [`ConnectionStates`], which a backend feeds from its own
//! signals.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use tokio::sync::watch;

/// How often a backend that is not connected asks its servers (see
/// [`ConnectionStates::probe_while_disconnected`]).
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// What a backend knows of its connection to its servers, and so of the
/// leases of the locks it holds. These are the states of Curator's
/// `ConnectionStateListener`, for code that pauses its work while the
/// backend cannot vouch for its locks.
///
/// A guard still says what it knows of its own lock
/// ([`LockGuard::state`](crate::LockGuard::state),
/// [`lost`](crate::LockGuard::lost)); this is the backend's view across
/// all of them, and it changes only on what the backend sees: an idle
/// backend that sends nothing learns nothing. Each backend's docs say
/// which of its signals move it.
///
/// # Examples
///
/// ```
/// use dlock_core::{BackendExt, ConnectionState, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let locker = MemoryBackend::new().into_locker();
/// let state = locker.state();
/// assert_eq!(*state.borrow(), ConnectionState::Connected);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectionState {
    /// The servers answer; no trouble seen since the backend connected.
    Connected,
    /// The servers stopped answering: the leases may still live, but the
    /// backend cannot tell (guards on a session say
    /// [`HoldState::Unsure`](crate::HoldState::Unsure)). Work that must
    /// not run without the lock should pause.
    Suspended,
    /// The leases may be gone: a session expired or ended, or no renewal
    /// came within a lease. Guards that were lost say so.
    Lost,
    /// The servers answer again after [`Suspended`](ConnectionState::Suspended)
    /// or [`Lost`](ConnectionState::Lost). Locks held through a
    /// suspension may have been kept; those lost were reported.
    Reconnected,
}

impl ConnectionState {
    /// The state's name in metrics and traces: `connected`, `suspended`,
    /// `lost` or `reconnected`.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(dlock_core::ConnectionState::Suspended.label(), "suspended");
    /// ```
    pub fn label(self) -> &'static str {
        match self {
            ConnectionState::Connected => "connected",
            ConnectionState::Suspended => "suspended",
            ConnectionState::Lost => "lost",
            ConnectionState::Reconnected => "reconnected",
        }
    }

    /// Whether the servers answered last: `Connected` or `Reconnected`.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::ConnectionState;
    ///
    /// assert!(ConnectionState::Reconnected.is_connected());
    /// assert!(!ConnectionState::Lost.is_connected());
    /// ```
    pub fn is_connected(self) -> bool {
        matches!(
            self,
            ConnectionState::Connected | ConnectionState::Reconnected
        )
    }
}

impl fmt::Display for ConnectionState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A backend's [`ConnectionState`], fed by the backend: it calls
/// [`answered`](ConnectionStates::answered) when the servers answer,
/// [`suspended`](ConnectionStates::suspended) when they stop, and
/// [`lost`](ConnectionStates::lost) when its leases may be gone. Each
/// change is logged (`tracing`, target `dlock_core::connection`) and
/// counted ([`metrics::CONNECTION_STATES`](crate::metrics::CONNECTION_STATES)).
/// Clones share the state.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::ConnectionStates, ConnectionState};
///
/// let states = ConnectionStates::new("mybackend");
/// let seen = states.subscribe();
/// states.answered(); // still connected
/// states.suspended();
/// states.answered();
/// assert_eq!(*seen.borrow(), ConnectionState::Reconnected);
/// states.lost();
/// states.suspended(); // lost stays lost until the servers answer
/// assert_eq!(*seen.borrow(), ConnectionState::Lost);
/// ```
#[derive(Clone)]
pub struct ConnectionStates {
    backend: &'static str,
    state: Arc<watch::Sender<ConnectionState>>,
}

impl fmt::Debug for ConnectionStates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionStates")
            .field("backend", &self.backend)
            .field("state", &*self.state.borrow())
            .finish()
    }
}

impl ConnectionStates {
    /// [`Connected`](ConnectionState::Connected), for a backend named
    /// `backend` (its [`Backend::name`](crate::backend::Backend::name)).
    pub fn new(backend: &'static str) -> Self {
        ConnectionStates {
            backend,
            state: Arc::new(watch::Sender::new(ConnectionState::Connected)),
        }
    }

    /// A receiver of the state, for
    /// [`Backend::connection_state`](crate::backend::Backend::connection_state).
    pub fn subscribe(&self) -> watch::Receiver<ConnectionState> {
        self.state.subscribe()
    }

    /// The state now.
    pub fn get(&self) -> ConnectionState {
        *self.state.borrow()
    }

    /// The servers answered: `Suspended` and `Lost` become `Reconnected`.
    pub fn answered(&self) {
        self.set(|now| match now {
            ConnectionState::Suspended | ConnectionState::Lost => ConnectionState::Reconnected,
            other => other,
        });
    }

    /// The servers stopped answering: `Connected` and `Reconnected`
    /// become `Suspended`; `Lost` stays.
    pub fn suspended(&self) {
        self.set(|now| match now {
            ConnectionState::Connected | ConnectionState::Reconnected => ConnectionState::Suspended,
            other => other,
        });
    }

    /// The leases may be gone: `Lost`.
    pub fn lost(&self) {
        self.set(|_| ConnectionState::Lost);
    }

    /// While the state is `Suspended` or `Lost`, calls `probe` once a
    /// second until it is connected again: a backend passes its
    /// [`check_servers`](crate::backend::Backend::check_servers), whose
    /// answer feeds the state, so that a backend with nothing to renew
    /// still learns the servers answer again. `probe` answers `None` once
    /// the backend is gone (it holds a weak reference), which ends the
    /// task. Does nothing outside a Tokio runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::backend::ConnectionStates;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let states = ConnectionStates::new("mybackend");
    /// let probed = states.clone();
    /// states.probe_while_disconnected(move || {
    ///     let states = probed.clone();
    ///     Some(async move { states.answered() }) // a check that answered
    /// });
    /// # }
    /// ```
    pub fn probe_while_disconnected<F, Fut>(&self, probe: F)
    where
        F: Fn() -> Option<Fut> + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut state = self.subscribe();
        runtime.spawn(async move {
            loop {
                // Ends when the backend, and with it the sender, is gone.
                if state.wait_for(|s| !s.is_connected()).await.is_err() {
                    return;
                }
                while !state.borrow().is_connected() {
                    tokio::time::sleep(PROBE_EVERY).await;
                    match probe() {
                        Some(check) => check.await,
                        None => return,
                    }
                }
            }
        });
    }

    fn set(&self, next: impl Fn(ConnectionState) -> ConnectionState) {
        // The fast path, taken on every answered request: a read lock.
        let now = *self.state.borrow();
        if next(now) == now {
            return;
        }
        let mut change = None;
        self.state.send_if_modified(|state| {
            let to = next(*state);
            if to == *state {
                return false;
            }
            change = Some((*state, to));
            *state = to;
            true
        });
        if let Some((from, to)) = change {
            match to {
                ConnectionState::Suspended | ConnectionState::Lost => tracing::warn!(
                    backend = self.backend,
                    from = from.label(),
                    to = to.label(),
                    "dlock connection state"
                ),
                _ => tracing::info!(
                    backend = self.backend,
                    from = from.label(),
                    to = to.label(),
                    "dlock connection state"
                ),
            }
            crate::metrics::connection_state(self.backend, to.label());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions_follow_curators_states() {
        use ConnectionState::*;
        let states = ConnectionStates::new("test");
        let seen = states.subscribe();
        for (signal, after) in [
            (
                ConnectionStates::answered as fn(&ConnectionStates),
                Connected,
            ),
            (ConnectionStates::suspended, Suspended),
            (ConnectionStates::suspended, Suspended),
            (ConnectionStates::answered, Reconnected),
            (ConnectionStates::answered, Reconnected),
            (ConnectionStates::lost, Lost),
            (ConnectionStates::suspended, Lost),
            (ConnectionStates::answered, Reconnected),
            (ConnectionStates::suspended, Suspended),
            (ConnectionStates::lost, Lost),
        ] {
            signal(&states);
            assert_eq!(*seen.borrow(), after);
        }
    }

    #[cfg(feature = "metrics")]
    #[test]
    fn each_change_is_counted_by_the_state_entered() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let states = ConnectionStates::new("test");
            states.answered(); // no change: not counted
            states.suspended();
            states.suspended();
            states.answered();
            states.lost();
            states.answered();
        });
        let mut counted = std::collections::BTreeMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            assert_eq!(key.key().name(), crate::metrics::CONNECTION_STATES);
            let state = key
                .key()
                .labels()
                .find(|l| l.key() == "state")
                .map(|l| l.value().to_owned())
                .expect("a state label");
            let DebugValue::Counter(n) = value else {
                panic!("not a counter: {value:?}");
            };
            counted.insert(state, n);
        }
        assert_eq!(
            counted.into_iter().collect::<Vec<_>>(),
            [
                ("lost".to_owned(), 1),
                ("reconnected".to_owned(), 2),
                ("suspended".to_owned(), 1)
            ]
        );
    }
}
