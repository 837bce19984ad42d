//! Releasing: deleting our node, and every stray node of ours.

use dlock_core::{backend::ReleaseOutcome, Result, Token};
use zookeeper_client::{Client, Error as ZkError};

use super::{backend_error, ZkBackend};

/// Deletes `path`, or without it (the create unanswered, or strays
/// possible) every child of `parent` whose name starts with `mine`, our
/// token's prefix. Once: a failure is
/// sent again by core, with backoff (see `Backend::abandon`).
async fn delete_ours(
    client: &Client,
    parent: &str,
    path: Option<String>,
    mine: &str,
) -> Result<ReleaseOutcome, ZkError> {
    let paths = match path {
        Some(path) => vec![path],
        // The create may still be in flight: this listing runs after it on
        // the same session. Synced first: after a reconnect the session may
        // read from another server, which may not have applied every write
        // of ours yet.
        None => {
            match client.sync(parent).await {
                Ok(()) | Err(ZkError::NoNode) => {}
                Err(e) => return Err(e),
            }
            match client.list_children(parent).await {
                Ok(children) => children
                    .into_iter()
                    .filter(|c| c.starts_with(mine))
                    .map(|c| format!("{parent}/{c}"))
                    .collect(),
                Err(ZkError::NoNode) => Vec::new(),
                Err(e) => return Err(e),
            }
        }
    };
    let mut outcome = ReleaseOutcome::NotHeld;
    for path in paths {
        match client.delete(&path, None).await {
            Ok(()) => outcome = ReleaseOutcome::Released,
            Err(ZkError::NoNode) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(outcome)
}

/// Deletes our nodes other than `name` among `children` (best effort: what
/// is left is deleted on release, which then lists every node of ours).
pub(super) async fn delete_strays(
    client: &Client,
    parent: &str,
    mine: &str,
    name: &str,
    children: &[String],
) {
    for stray in children
        .iter()
        .filter(|c| c.starts_with(mine) && *c != name)
    {
        match client.delete(&format!("{parent}/{stray}"), None).await {
            Ok(()) => tracing::debug!(stray, "dlock zookeeper deleted a stray node of ours"),
            Err(ZkError::NoNode) => {}
            Err(error) => {
                tracing::debug!(%error, stray, "dlock zookeeper stray node not deleted yet")
            }
        }
    }
}

impl ZkBackend {
    /// Deletes our node, and every stray one of ours if there may be some.
    /// The entry is forgotten only once that worked (or the session that
    /// held them is gone), so a failed or dropped release can be sent again
    /// instead of leaving a node that blocks the key for as long as the
    /// session lives. `release` is false for the end of a fixed lease,
    /// which is no release.
    ///
    /// A release sent again after a send whose answer was lost, which
    /// finds no node of ours on the session that holds it, released it:
    /// the node is ephemeral and the session lives, so it was deleted, by
    /// that send or after it was sent (the hold lasted until the release
    /// either way). ZooKeeper does not say who deleted a node: one deleted
    /// by `force_release` or by hand just before such a release also
    /// reads as released.
    pub(super) async fn delete_owned(
        &self,
        token: &Token,
        release: bool,
    ) -> Result<ReleaseOutcome> {
        let (parent, path, mine, session, resent) = {
            let mut owned = self.owned();
            let Some(owned) = owned.get_mut(token) else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            let sent_before = owned.release_sent;
            owned.release_sent |= release;
            (
                owned.parent.clone(),
                owned.path.clone().filter(|_| !owned.strays),
                owned.mine.clone(),
                owned.session.clone(),
                release && sent_before && owned.granted,
            )
        };
        session.forget(token);
        let outcome = async { delete_ours(&session.client()?, &parent, path, &mine).await };
        let outcome = match outcome.await {
            // Answered on the node's own session, which still lives.
            Ok(ReleaseOutcome::NotHeld) if resent => ReleaseOutcome::Released,
            Ok(outcome) => outcome,
            // The session is gone, and its ephemeral nodes with it.
            Err(ZkError::SessionExpired) => ReleaseOutcome::NotHeld,
            Err(e) => return Err(backend_error(e)),
        };
        self.owned().remove(token);
        self.inner.lease_ends.cancel(*token);
        Ok(outcome)
    }
}
