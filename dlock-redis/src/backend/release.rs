//! Releasing: on every node, and out of the key's line.

use std::time::Duration;

use dlock_core::{
    backend::{Mode, ReleaseOutcome},
    LockKey, Result, Token,
};

use super::{backend_error, timed_out, RedisBackend, REDLOCK_NODE_TIMEOUT_MAX};
use crate::{
    keys::{entry, names, shared_names, Names},
    node::Place,
};

impl RedisBackend {
    /// Releases `token` on every node, and takes it out of the key's line.
    pub(super) async fn release_names(
        &self,
        names: &Names,
        token: &str,
        timeout: Option<Duration>,
    ) -> Result<ReleaseOutcome> {
        let answers = self
            .on_every_node(timeout, |node| node.release(names, token, Place::None, 0))
            .await;
        // The token held the lock only if it held a majority: a stale
        // guard's leftover key on a node or two is not the lock.
        let released = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        if released >= self.inner.quorum {
            return Ok(ReleaseOutcome::Released);
        }
        if answers.iter().any(|a| a.is_ok()) {
            return Ok(ReleaseOutcome::NotHeld);
        }
        // No node answered: the lock, if held, expires with its lease.
        Err(backend_error(
            answers
                .into_iter()
                .find_map(|a| a.err())
                .unwrap_or_else(timed_out),
        ))
    }

    pub(super) async fn release_inner(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
    ) -> Result<ReleaseOutcome> {
        if mode != Mode::Exclusive {
            let names = shared_names(&self.inner.prefix, key, mode);
            let held = self.inner.nodes[0]
                .release_shared(&names, &entry(token, mode))
                .await
                .map_err(backend_error)?;
            return Ok(if held {
                ReleaseOutcome::Released
            } else {
                ReleaseOutcome::NotHeld
            });
        }
        let names = names(&self.inner.prefix, key);
        let timeout = self.inner.redlock.then_some(REDLOCK_NODE_TIMEOUT_MAX);
        self.release_names(&names, &token.to_string(), timeout)
            .await
    }

    /// Reads each node's holder token and releases it there: the release
    /// script checks the token, so a holder that changed in between is
    /// left alone, and the first waiter in line is told, as after a
    /// release. `true` if a node released.
    pub(super) async fn force_release_inner(&self, key: &LockKey) -> Result<bool> {
        let names = names(&self.inner.prefix, key);
        let names = &names;
        let timeout = self.inner.redlock.then_some(REDLOCK_NODE_TIMEOUT_MAX);
        let answers = self
            .on_every_node(timeout, |node| async move {
                let mut conn = node.connection();
                let holder: Option<String> = redis::cmd("GET")
                    .arg(&names.lock)
                    .query_async(&mut conn)
                    .await?;
                match holder {
                    Some(token) => node.force_release(names, &token).await,
                    None => Ok(false),
                }
            })
            .await;
        if answers.iter().any(|a| matches!(a, Ok(true))) {
            return Ok(true);
        }
        // "Free" only when a quorum said so; otherwise the nodes' error.
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        match answers.into_iter().find_map(|a| a.err()) {
            Some(error) if answered < self.inner.quorum => Err(backend_error(error)),
            _ => Ok(false),
        }
    }
}
