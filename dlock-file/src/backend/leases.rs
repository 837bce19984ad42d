//! The thread that ends leases.
//!
//! A lease is this process's: the kernel keeps a `flock` lock for as long
//! as its file is open. The watchdog renews a lease by moving its end
//! here; a lease not renewed in time (a fixed one, or one whose runtime
//! stopped or hangs) is ended by a plain thread, not a task, so that a
//! runtime that no longer runs cannot keep its locks: the thread tells the
//! guard, then unlocks.

use std::{
    sync::{mpsc, Weak},
    thread::Thread,
    time::{Duration, Instant},
};

use dlock_core::{LockError, LostReason, Result, Token};

use super::{lock, Inner};
use crate::NAME;

/// How long the lease thread sleeps with nothing to end: how soon it
/// notices that its backend is gone.
const IDLE: Duration = Duration::from_secs(1);

/// Starts the thread that ends the leases of the backend it is then sent.
pub(super) fn start_reaper() -> Result<(Thread, mpsc::Sender<Weak<Inner>>)> {
    let (tx, rx) = mpsc::channel::<Weak<Inner>>();
    let thread = std::thread::Builder::new()
        .name("dlock-file-leases".to_owned())
        .spawn(move || {
            if let Ok(backend) = rx.recv() {
                end_leases(&backend);
            }
        })
        .map_err(|e| LockError::backend(NAME, e))?;
    Ok((thread.thread().clone(), tx))
}

/// Ends each lease at its end, until the backend is gone. Each round
/// sleeps until the next end, at most [`IDLE`]; a new grant wakes it.
fn end_leases(backend: &Weak<Inner>) {
    loop {
        let Some(inner) = backend.upgrade() else {
            return;
        };
        let now = Instant::now();
        let (ended, next) = {
            let mut owned = lock(&inner.owned);
            let over: Vec<Token> = owned
                .iter()
                .filter(|(_, o)| o.ends <= now)
                .map(|(token, _)| *token)
                .collect();
            let ended: Vec<_> = over.iter().filter_map(|t| owned.remove(t)).collect();
            (ended, owned.values().map(|o| o.ends).min())
        };
        for lease in ended {
            // Told first, unlocked then: never after another could take it.
            lease.loss.report(LostReason::LeaseExpired);
            drop(lease);
        }
        drop(inner);
        let sleep = next.map_or(IDLE, |next| {
            next.saturating_duration_since(Instant::now()).min(IDLE)
        });
        std::thread::park_timeout(sleep);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The lease thread ends now rather than at its next round.
        self.reaper.unpark();
    }
}
