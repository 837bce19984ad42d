//! Releasing: deleting our key, and revoking a fixed lease of its own.

use dlock_core::{backend::ReleaseOutcome, LostReason, Result, Token};
use etcd_client::{Compare, CompareOp, TxnOpResponse};

use super::{delete_if, retried, EtcdBackend};

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
        let (name, session, own_lease, created, own_name, held, sent_before) = {
            let mut owned = self.owned();
            let Some(owned) = owned.get_mut(token) else {
                return Ok(ReleaseOutcome::NotHeld);
            };
            // The lease the key lives on while it is held.
            let held = owned.granted.map(|_| match owned.own_lease {
                Some(own) if owned.on_own_lease => own,
                _ => owned.session.lease,
            });
            (
                owned.name.clone(),
                owned.session.clone(),
                owned.own_lease,
                owned.created,
                owned.own_name,
                held,
                std::mem::replace(&mut owned.release_sent, true),
            )
        };
        session.holders.forget(token, LostReason::NotHeld);
        // Sent more than once (here, or by an earlier call that failed):
        // the answer of one that ran may have been lost.
        let mut sends = u32::from(sent_before);
        // Forgotten only once deleted: a release that fails (or is dropped)
        // can be sent again, rather than leave a key that blocks the queue
        // for as long as the session lives.
        let deleted = if own_name {
            // The name carries our token and our session's lease: only this
            // acquisition's requests make a key of it. (An enqueue retried
            // after a lost reply may make it again after this delete; its
            // caller has gone then, and the enqueue deletes it itself. An
            // extend or a proclaim checks the create revision, so neither
            // makes it again.) So a plain delete removes only ours, and
            // etcd applies it faster than a transaction with a comparison
            // (BENCHMARKS.md).
            let answer = retried(|| {
                sends += 1;
                let (mut client, name) = (self.client(), name.clone());
                async move { client.delete(name, None).await }
            })
            .await?;
            answer.deleted() > 0
        } else {
            // Only the key we made: the one created at the revision we
            // know, or before we know it, the one on our session's lease
            // (with `layout=etcdctl`, a name may be another acquisition's:
            // see `enter`).
            let ours = match created {
                Some(revision) => {
                    Compare::create_revision(name.as_str(), CompareOp::Equal, revision)
                }
                None => Compare::lease(name.as_str(), CompareOp::Equal, session.lease),
            };
            let delete = delete_if(name.as_str(), ours);
            let answer = retried(|| {
                sends += 1;
                let (mut client, delete) = (self.client(), delete.clone());
                async move { client.txn(delete).await }
            })
            .await?;
            answer.op_responses().into_iter().any(|op| match op {
                TxnOpResponse::Delete(delete) => delete.deleted() > 0,
                _ => false,
            })
        };
        let released = match held {
            Some(lease) if !deleted && sends > 1 => self.lease_lives(lease).await?,
            _ => deleted,
        };
        self.owned().remove(token);
        if let Some(lease) = own_lease {
            self.revoke_in_background(lease);
        }
        Ok(if released {
            ReleaseOutcome::Released
        } else {
            ReleaseOutcome::NotHeld
        })
    }

    /// Whether a release sent again, which found our held key gone,
    /// released it: an earlier send whose answer was lost deleted it, or
    /// someone did after that send (the hold lasted until the release
    /// either way). Told apart from a lock lost before (its lease ended:
    /// the session expired, or a fixed lease ran out) by the lease the key
    /// lived on, which outlives its key only if the key was deleted.
    ///
    /// A key deleted by `force_release` or by hand just before the release
    /// was sent (before the session's check saw it gone) reads as released
    /// too: etcd does not say who deleted a key.
    async fn lease_lives(&self, lease: i64) -> Result<bool> {
        let alive = retried(|| {
            let mut client = self.client();
            async move { client.lease_time_to_live(lease, None).await }
        })
        .await?;
        Ok(alive.ttl() > 0)
    }
}
