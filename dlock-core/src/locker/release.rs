//! How a release reaches the server: inline for `release().await`, or in a
//! task of its own for a dropped guard or an abandoned step. Either way it
//! goes through the hold's own token, and is counted as pending on the
//! locker until the server answers.
//!
//! A release that fails is sent again, with backoff, until the server
//! answers or the lock's lease has passed since the first failure. Then the
//! backend is told to [abandon](crate::backend::Backend::abandon) the
//! token, so that whatever keeps its lock alive (a session) lets it expire.

use std::{sync::Arc, time::Duration};

use tokio::{runtime::Handle, time::Instant};
use tracing::Instrument;

use crate::{
    backend::{Backoff, DynBackend, Mode, ReleaseOutcome},
    error::Result,
    key::LockKey,
    locker::shared::Shared,
    token::Token,
};

/// The first pause before a failed release is sent again; it doubles up to
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Releases `release`'s lock once, tracing the outcome. Before its
/// [`until`](Release::until), the release leaves the lock held until then
/// instead: the server's lease is set to end at that time, and nothing
/// renews it.
pub(crate) async fn release_traced(
    backend: &dyn DynBackend,
    release: &Release,
) -> Result<ReleaseOutcome> {
    let Release {
        key, mode, token, ..
    } = release;
    let left = release
        .until
        .map(|until| until.saturating_duration_since(Instant::now()))
        .filter(|left| !left.is_zero());
    let outcome = match left {
        Some(left) => backend
            .extend(key, *mode, token, left)
            .await
            .map(|held| match held {
                Some(_) => ReleaseOutcome::Released,
                None => ReleaseOutcome::NotHeld,
            }),
        None => backend.release(key, *mode, token).await,
    };
    match &outcome {
        Ok(ReleaseOutcome::Released) if left.is_some() => {
            tracing::debug!(
                ?left,
                "dlock lock left held until its time (hold_at_least, lock_delay)"
            )
        }
        Ok(ReleaseOutcome::Released) => tracing::debug!("dlock lock released"),
        Ok(ReleaseOutcome::NotHeld) => {
            tracing::debug!("dlock release found the lock no longer held")
        }
        Err(error) => tracing::warn!(%error, "dlock release failed; retrying"),
    }
    outcome
}

/// Sends the release again, with backoff, until it is answered or `lease`
/// has passed; then abandons the token.
async fn retry_release(backend: &dyn DynBackend, release: &Release) {
    let Release {
        key,
        mode,
        token,
        lease,
        ..
    } = release;
    let give_up = Instant::now() + *lease;
    let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
    loop {
        let now = Instant::now();
        if now >= give_up {
            tracing::warn!(
                ?lease,
                "dlock release still failing after a lease; abandoning the token, the lock expires"
            );
            backend.abandon(key, *mode, token).await;
            return;
        }
        tokio::time::sleep_until((now + backoff.next_delay()).min(give_up)).await;
        if release_traced(backend, release).await.is_ok() {
            return;
        }
    }
}

/// Whether a release has been sent yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Not yet: send it now.
    No,
    /// Sent, and it failed: send it again after a pause.
    Failed,
}

/// Releases `key` for `token` in a task of its own on `runtime`, so the
/// release completes though nobody waits for it; a failed release is sent
/// again for up to the lease (see the module docs). If that runtime is gone,
/// the lease expires on the server instead.
///
/// The release counts as pending on `shared` until it is answered or given
/// up (see [`Locker::wait_for_releases`](crate::Locker::wait_for_releases)).
pub(crate) fn spawn_release(
    runtime: &Handle,
    shared: Arc<Shared>,
    release: Release,
    sent: Sent,
    span: tracing::Span,
) {
    let pending = shared.start_release();
    let task = async move {
        let _pending = pending;
        settle(&shared, &release).await;
        let backend = &*shared.backend;
        if sent == Sent::Failed || release_traced(backend, &release).await.is_err() {
            retry_release(backend, &release).await;
        }
    };
    drop(runtime.spawn(task.instrument(span)));
}

/// What a release needs: the key, the token, and the lease the lock was
/// held for (how long a failing release is retried).
#[derive(Debug, Clone)]
pub(crate) struct Release {
    pub(crate) key: LockKey,
    pub(crate) mode: Mode,
    pub(crate) token: Token,
    pub(crate) lease: Duration,
    /// Until when the lock stays held whenever it is released
    /// ([`LockOptions::hold_at_least`](crate::LockOptions::hold_at_least)).
    pub(crate) until: Option<Instant>,
    /// The watchdog's id for the lock, if the watchdog renewed it.
    pub(crate) renewed_by: Option<u64>,
}

/// Before a release that leaves the lock held until a set time: waits for
/// a watchdog renewal of it already on its way (the watchdog no longer
/// renews it), which would otherwise set the lease back to a whole one
/// after the release set its end.
pub(crate) async fn settle(shared: &Shared, release: &Release) {
    if let (Some(_), Some(id)) = (release.until, release.renewed_by) {
        shared.watchdog.renewal_settled(id).await;
    }
}

/// Releases a token when dropped while armed: for a step whose outcome on
/// the server is uncertain until it answers (an acquire that may have won
/// with its reply in flight, a release that may not have been sent).
pub(crate) struct ReleaseOnDrop<'a> {
    pub(crate) runtime: &'a Handle,
    pub(crate) shared: &'a Arc<Shared>,
    pub(crate) release: Release,
    pub(crate) armed: bool,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!("dlock step abandoned; releasing its token");
            spawn_release(
                self.runtime,
                self.shared.clone(),
                self.release.clone(),
                Sent::No,
                tracing::Span::current(),
            );
        }
    }
}
