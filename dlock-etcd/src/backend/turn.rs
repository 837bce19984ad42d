//! With `layout=etcdctl`: a granted acquisition's turn at its key, which
//! keeps this process's next acquisition of the key out of etcd while the
//! hold may still use the entry's name (Go's layout names an entry by its
//! session's lease alone, so two acquisitions of a key on one session
//! would share one etcd key).

use std::sync::Arc;

use dlock_core::backend::LocalTurn;
use tokio::{sync::watch, time::Instant};

use crate::session::Session;

/// A granted acquisition's turn, kept by a task until the session its key
/// lives on ends (a next acquisition takes a new session, and another
/// name), its fixed lease ends as the guard counts it, or this is dropped
/// (at release), whichever comes first: a guard whose lease ended keeps no turn, though
/// it lives on. The key may outlive the guard's count a little (etcd
/// counts whole seconds from its own grant): the next acquisition finds it
/// under the name, on that lease, and waits until it is gone.
pub(super) struct KeptTurn(watch::Sender<Option<Instant>>);

impl KeptTurn {
    /// Keeps `turn` until the key's `session` ends, under the watchdog, or
    /// until `ends`, with a fixed lease.
    pub(super) fn start(
        turn: LocalTurn<String>,
        session: Option<Arc<Session>>,
        ends: Option<Instant>,
    ) -> KeptTurn {
        let (ends, mut moved) = watch::channel(ends);
        tokio::spawn(async move {
            let _turn = turn;
            loop {
                let until = *moved.borrow_and_update();
                let lease_ends = tokio::time::sleep_until(until.unwrap_or_else(Instant::now));
                let session_ends = async {
                    if let Some(session) = &session {
                        session.holders.expired().await;
                    }
                };
                tokio::select! {
                    // Ended, unless moved meanwhile.
                    () = lease_ends, if until.is_some() => {
                        if !moved.has_changed().unwrap_or(false) {
                            return;
                        }
                    }
                    changed = moved.changed() => if changed.is_err() {
                        return;
                    },
                    () = session_ends, if session.is_some() => return,
                }
            }
        });
        KeptTurn(ends)
    }

    /// Moves the end to `ends` (an extension, or now when the key is
    /// gone), unless the turn was given back already.
    pub(super) fn move_end(&self, ends: Instant) {
        let _ = self.0.send(Some(ends));
    }

    /// Whether the turn was given back: the lease or the session ended.
    pub(super) fn given_back(&self) -> bool {
        self.0.is_closed()
    }
}
