//! Releasing: deleting our key, and revoking a fixed lease of its own.

use dlock_core::{backend::ReleaseOutcome, Result, Token};
use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

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
        let (name, session, own_lease, created) = {
            let owned = self.owned();
            let Some(owned) = owned.get(token) else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            let (name, session) = (owned.name.clone(), owned.session.clone());
            (name, session, owned.own_lease, owned.created)
        };
        session.forget(token);
        // Only the key we made: the one created at the revision we know,
        // or before we know it, the one on our session's lease (with
        // `layout=etcdctl`, a name may be another acquisition's: see
        // `enter`).
        let ours = match created {
            Some(revision) => Compare::create_revision(name.as_str(), CompareOp::Equal, revision),
            None => Compare::lease(name.as_str(), CompareOp::Equal, session.lease),
        };
        let delete = Txn::new()
            .when([ours])
            .and_then([TxnOp::delete(name.as_str(), None)]);
        // Forgotten only once deleted: a release that fails (or is dropped)
        // can be sent again, rather than leave a key that blocks the queue
        // for as long as the session lives.
        let answer = retried(|| {
            let (mut client, delete) = (self.client(), delete.clone());
            async move { client.txn(delete).await }
        })
        .await?;
        self.owned().remove(token);
        if let Some(lease) = own_lease {
            self.revoke_in_background(lease);
        }
        let deleted = answer.op_responses().into_iter().any(|op| match op {
            TxnOpResponse::Delete(delete) => delete.deleted() > 0,
            _ => false,
        });
        Ok(if deleted {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        })
    }
}
