//! Holders: recording a lock's holder in the holders' table, and reading
//! it back.

use dlock_core::{
    backend::{unsupported_holder, Holder, Mode},
    LockKey, Result, Token,
};
use tokio::time::Instant;

use super::{backend_error, lock, SqlBackend};
use crate::Dialect;

impl<D: Dialect> SqlBackend<D> {
    /// Whether holders can be recorded and read: the dialect records them,
    /// and grants carry fencing tokens.
    pub(super) fn records_holders(&self) -> bool {
        self.inner.dialect.records_holders() && self.inner.dialect.fences()
    }

    /// [`Backend::proclaim`](dlock_core::backend::Backend::proclaim): the
    /// record, behind the lock's entry lock, on the session that holds it.
    pub(super) async fn proclaim_inner(
        &self,
        key: &LockKey,
        token: &Token,
        value: &[u8],
    ) -> Result<bool> {
        if !self.records_holders() {
            return Err(unsupported_holder(D::NAME));
        }
        let Some(releasing) = lock(&self.inner.owned)
            .get(token)
            .map(|o| o.releasing.clone())
        else {
            return Ok(false);
        };
        // Not while its release runs: that would leave a record the
        // release did not delete.
        let _not_releasing = releasing.lock().await;
        let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
        let Some(session) = lock(&self.inner.owned)
            .get(token)
            .map(|o| o.session.clone())
        else {
            return Ok(false);
        };
        let (backend, token, value) = (self.clone(), *token, value.to_vec());
        let written = session
            .run(move |d, c| {
                Box::pin(async move {
                    // Checked and marked by the statement itself,
                    // right before it is sent: a release queued behind
                    // it deletes what it writes, and one that ran
                    // first leaves nothing to write for.
                    let fence = {
                        let mut owned = lock(&backend.inner.owned);
                        let Some(o) = owned.get_mut(&token).filter(|o| {
                            o.mode == Mode::Exclusive
                                && o.id == id
                                && o.fixed_end.is_none_or(|end| Instant::now() < end)
                        }) else {
                            return Ok(false);
                        };
                        o.proclaimed = true;
                        o.fence
                    };
                    d.proclaim(c, &id, &token, fence, &value).await?;
                    Ok(true)
                })
            })
            .await;
        match written {
            Ok((_, written)) => Ok(written),
            // The session ended meanwhile: its locks went with it.
            Err(_) if !session.is_usable() => Ok(false),
            Err(e) => Err(backend_error::<D>(e)),
        }
    }

    /// [`Backend::holder`](dlock_core::backend::Backend::holder), on the
    /// key's holder session.
    pub(super) async fn holder_inner(&self, key: &LockKey) -> Result<Option<Holder>> {
        if !self.records_holders() {
            return Err(unsupported_holder(D::NAME));
        }
        let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
        let session = self.holder(&id).await?;
        let (_, read) = session
            .run(move |d, c| Box::pin(async move { d.holder(c, &id).await }))
            .await
            .map_err(backend_error::<D>)?;
        Ok(
            read.map(|(fence, value)| {
                Holder::new(fence.and_then(|f| u64::try_from(f).ok()), value)
            }),
        )
    }

    /// Ends the holder's server session, from the key's holder session. A
    /// lock this backend holds itself (on its holder session, or on a
    /// waiter session it won by waiting) is released instead, on the
    /// session that holds it, and its guard is told: ending that session
    /// would take this backend's other locks with it.
    pub(super) async fn force_release_inner(&self, key: &LockKey) -> Result<bool> {
        let id = self.inner.dialect.lock_id(key, Mode::Exclusive);
        let own = lock(&self.inner.owned)
            .iter()
            .find(|(_, owned)| owned.id == id && owned.mode == Mode::Exclusive)
            .map(|(token, _)| *token);
        if let Some(token) = own {
            let released = self.unlock(&token).await?;
            return Ok(released == dlock_core::backend::ReleaseOutcome::Released);
        }
        let session = self.holder(&id).await?;
        let (_, ended) = session
            .run(move |d, c| Box::pin(async move { d.end_holder(c, &id).await }))
            .await
            .map_err(|e| match self.inner.dialect.missing_right(&e) {
                Some(right) => dlock_core::LockError::PermissionDenied {
                    backend: D::NAME,
                    source: std::sync::Arc::new(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!("ending the holder's session takes {right}: {e}"),
                    )),
                },
                None => backend_error::<D>(e),
            })?;
        Ok(ended)
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// The permits of the semaphore's live queue entries that are
    /// admitted, oldest first (see [`dlock_core::backend::permits_taken`]),
    /// read on the key's holder session: an entry is live while its
    /// owner's session holds its entry lock.
    pub(super) async fn permits_taken_inner(&self, key: &LockKey, limit: u32) -> Result<u32> {
        let mode = Mode::Permits { count: 1, limit };
        let id = self.inner.dialect.lock_id(key, mode);
        let session = self.holder(&id).await?;
        let (_, (entries, _)) = session
            .run(move |d, c| Box::pin(async move { d.ahead(c, &id, i64::MAX).await }))
            .await
            .map_err(backend_error::<D>)?;
        let modes = entries
            .iter()
            .filter(|entry| entry.live)
            .map(|entry| Mode::from_tag(&entry.tag).unwrap_or(Mode::Exclusive));
        Ok(dlock_core::backend::permits_taken(modes))
    }
}
