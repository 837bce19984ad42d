//! How a release reaches the server: inline for `release().await`, or in a
//! task of its own for a dropped guard or an abandoned step. Either way it
//! goes through the hold's own token, and is counted as pending on the
//! locker until the server answers.

use std::sync::Arc;

use tokio::runtime::Handle;
use tracing::Instrument;

use crate::{
    backend::{Backend, ReleaseOutcome},
    error::Result,
    key::LockKey,
    shared::Shared,
    token::Token,
};

/// Releases `key` for `token`, tracing the outcome.
pub(crate) async fn release_traced(
    backend: &dyn Backend,
    key: &LockKey,
    token: &Token,
) -> Result<ReleaseOutcome> {
    let outcome = backend.release(key, token).await;
    match &outcome {
        Ok(ReleaseOutcome::Released) => tracing::debug!("dlock lock released"),
        Ok(ReleaseOutcome::NotHeld) => {
            tracing::debug!("dlock release found the lock no longer held")
        }
        Err(error) => tracing::warn!(%error, "dlock release failed; the lease will expire"),
    }
    outcome
}

/// Releases `key` for `token` in a task of its own on `runtime`, so the
/// release completes though nobody waits for it. If that runtime is gone,
/// the lease expires on the server instead.
///
/// The release counts as pending on `shared` until it is answered (see
/// [`Locker::wait_for_releases`](crate::Locker::wait_for_releases)).
pub(crate) fn spawn_release(
    runtime: &Handle,
    shared: Arc<Shared>,
    key: LockKey,
    token: Token,
    span: tracing::Span,
) {
    let pending = shared.start_release();
    let release = async move {
        let _pending = pending;
        release_traced(&*shared.backend, &key, &token).await
    };
    drop(runtime.spawn(release.instrument(span)));
}

/// Releases a token when dropped while armed: for a step whose outcome on
/// the server is uncertain until it answers (an acquire that may have won
/// with its reply in flight, a release that may not have been sent).
pub(crate) struct ReleaseOnDrop<'a> {
    pub(crate) runtime: &'a Handle,
    pub(crate) shared: &'a Arc<Shared>,
    pub(crate) key: &'a LockKey,
    pub(crate) token: Token,
    pub(crate) armed: bool,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!("dlock step abandoned; releasing its token");
            spawn_release(
                self.runtime,
                self.shared.clone(),
                self.key.clone(),
                self.token,
                tracing::Span::current(),
            );
        }
    }
}
