//! With `layout=etcdctl`: this backend's turn at a plain lock's entry
//! name (Go's layout names an entry by its session's lease alone, so two
//! acquisitions of a key on one session would share one etcd key).

use std::sync::Arc;

use dlock_core::backend::{LocalTurn, Mode, Share, Wait};
use tokio::{sync::watch, time::Instant};

use super::EtcdBackend;

/// This backend's turn at a plain lock's entry name.
pub(super) type Turn = Arc<LocalTurn<String>>;

/// A fixed-lease grant's share of its turn, kept by a task until the
/// lease ends (as the guard counts it) or this is dropped (at release),
/// whichever comes first: a guard whose lease ended keeps no turn, though
/// it lives on. The key may outlive the guard's count a little (etcd
/// counts whole seconds from its own grant): the next acquisition finds it
/// under the name, on that lease, and waits until it is gone.
pub(super) struct TurnUntil(watch::Sender<Instant>);

impl TurnUntil {
    /// Keeps `turn` until `ends`.
    pub(super) fn start(turn: Turn, ends: Instant) -> TurnUntil {
        let (ends, mut moved) = watch::channel(ends);
        tokio::spawn(async move {
            let _turn = turn;
            loop {
                let until = *moved.borrow_and_update();
                tokio::select! {
                    () = tokio::time::sleep_until(until) => {
                        // Ended, unless moved meanwhile (or dropped).
                        if !moved.has_changed().unwrap_or(false) {
                            return;
                        }
                    }
                    changed = moved.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        TurnUntil(ends)
    }

    /// Moves the end to `ends` (an extension, or now when the key is
    /// gone), unless the turn was given back already.
    pub(super) fn move_end(&self, ends: Instant) {
        let _ = self.0.send(ends);
    }

    /// Whether the turn was given back: the lease ended.
    pub(super) fn given_back(&self) -> bool {
        self.0.is_closed()
    }
}

impl EtcdBackend {
    /// With `layout=etcdctl`, waits for this backend's turn at a plain
    /// lock's entry `name`, until `deadline` (`None` if it passed);
    /// otherwise no turn is needed.
    pub(super) async fn turn(&self, name: &str, mode: Mode, wait: Wait) -> Option<Option<Turn>> {
        if !self.go_layout(mode) {
            return Some(None);
        }
        let turn = self
            .inner
            .turns
            .take(&name.to_owned(), Share::Alone, wait)
            .await?;
        Some(Some(Arc::new(turn)))
    }
}
