//! Releasing: deleting our key, and revoking a fixed lease of its own.

use dlock_core::{backend::ReleaseOutcome, Result, Token};

use super::{retried, EtcdBackend};

impl EtcdBackend {
    /// Revokes `lease` once, without waiting: if etcd does not answer, the
    /// lease expires by itself.
    pub(super) fn revoke_in_background(&self, lease: i64) {
        let mut client = self.client();
        tokio::spawn(async move {
            if let Err(error) = client.lease_revoke(lease).await {
                tracing::debug!(%error, lease, "dlock etcd lease revoke failed; it will expire");
            }
        });
    }

    pub(super) async fn delete_owned(&self, token: &Token) -> Result<ReleaseOutcome> {
        let (name, session, own_lease) = {
            let owned = self.owned();
            let Some(owned) = owned.get(token) else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            (owned.name.clone(), owned.session.clone(), owned.own_lease)
        };
        session.forget(token);
        // Forgotten only once deleted: a release that fails (or is dropped)
        // can be sent again, rather than leave a key that blocks the queue
        // for as long as the session lives.
        let deleted = retried(|| {
            let (mut client, name) = (self.client(), name.clone());
            async move { client.delete(name, None).await }
        })
        .await?;
        self.owned().remove(token);
        if let Some(lease) = own_lease {
            self.revoke_in_background(lease);
        }
        Ok(if deleted.deleted() > 0 {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        })
    }
}
