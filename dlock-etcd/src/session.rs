//! The session: one lease per backend (per TTL), kept alive by one task,
//! shared by every lock taken under the watchdog. Its keepalives move the
//! lease end of every guard on it; its expiry loses them all.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use dlock_core::{
    backend::{ConnectionStates, SessionHolders},
    LostReason,
};
use etcd_client::{Client, TxnOp};
use tokio::time::Instant;

/// Keep-alive this many times per TTL, so two can fail before it runs out.
const KEEPALIVES_PER_TTL: u32 = 3;
/// Existence checks per transaction (etcd allows 128 operations).
const CHECKS_PER_TXN: usize = 64;

pub(crate) struct Session {
    pub(crate) lease: i64,
    pub(crate) ttl: Duration,
    /// The guards on this lease, by token, with their key names: its
    /// `expired()` completes once the session expired or was abandoned.
    pub(crate) holders: SessionHolders<String>,
}

impl Session {
    /// Grants a lease of `ttl` and starts keeping it alive.
    pub(crate) async fn start(
        client: &Client,
        ttl: Duration,
        states: &ConnectionStates,
    ) -> Result<Arc<Session>, etcd_client::Error> {
        let sent = Instant::now();
        let ttl_secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let grant = client.clone().lease_grant(ttl_secs, None).await?;
        let granted = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(1));
        let session = Arc::new(Session {
            lease: grant.id(),
            ttl: granted,
            holders: SessionHolders::reporting_to(sent, states.clone()),
        });
        tokio::spawn(keep_alive(client.clone(), Arc::downgrade(&session)));
        Ok(session)
    }

    /// Whether the lease can still be used for new keys: not expired, and
    /// renewed recently enough that it has most of its TTL left.
    pub(crate) fn is_usable(&self) -> bool {
        !self.holders.is_expired() && self.holders.renewed_at().elapsed() < self.ttl / 2
    }

    /// Gives the session up: no more keepalives, so its lease (and every key
    /// on it) expires within one TTL; every guard on it is lost now.
    pub(crate) fn abandon(&self) {
        if self.holders.expire() {
            tracing::warn!(
                lease = self.lease,
                "dlock etcd session abandoned; its lease will expire"
            );
        }
    }

    /// Reports holders whose key was deleted behind their back.
    async fn check_holders(&self, client: &Client) -> Result<(), etcd_client::Error> {
        let held = self.holders.snapshot();
        for chunk in held.chunks(CHECKS_PER_TXN) {
            let gets: Vec<TxnOp> = chunk
                .iter()
                .map(|(_, name)| {
                    TxnOp::get(
                        name.as_str(),
                        Some(etcd_client::GetOptions::new().with_count_only()),
                    )
                })
                .collect();
            let answer = client
                .clone()
                .txn(etcd_client::Txn::new().and_then(gets))
                .await?;
            for ((token, _), op) in chunk.iter().zip(answer.op_responses()) {
                if let etcd_client::TxnOpResponse::Get(get) = op {
                    if get.count() == 0 {
                        self.holders.forget(token, LostReason::NotHeld);
                    }
                }
            }
        }
        Ok(())
    }
}

async fn keep_alive(client: Client, session: Weak<Session>) {
    let Some((lease, ttl)) = session.upgrade().map(|s| (s.lease, s.ttl)) else {
        return;
    };
    let period = ttl / KEEPALIVES_PER_TTL;
    let mut stream = None;
    loop {
        tokio::time::sleep(period).await;
        let Some(session) = session.upgrade() else {
            return;
        };
        if session.holders.is_expired() {
            // Abandoned: dropping the stream stops the keepalives.
            return;
        }
        let sent = Instant::now();
        if stream.is_none() {
            stream = tokio::time::timeout(period, client.clone().lease_keep_alive(lease))
                .await
                .ok()
                .and_then(Result::ok);
        }
        let answer = match &mut stream {
            Some((keeper, responses)) => {
                let round = async {
                    keeper.keep_alive().await?;
                    responses.message().await
                };
                tokio::time::timeout(period, round).await.ok()
            }
            None => None,
        };
        match answer {
            Some(Ok(Some(response))) if response.ttl() > 0 => {
                let granted = Duration::from_secs(u64::try_from(response.ttl()).unwrap_or(1));
                session.holders.renewed(sent, granted);
            }
            Some(Ok(Some(_))) => {
                tracing::warn!(lease, "dlock etcd session lease expired");
                session.holders.expire();
                return;
            }
            _ => {
                stream = None;
                // Unanswered: the lease may live, but nobody can tell.
                session.holders.unsure();
                if session.holders.renewed_at().elapsed() >= session.ttl {
                    tracing::warn!(lease, "dlock etcd session could not be kept alive");
                    session.holders.expire();
                    return;
                }
                continue;
            }
        }
        // Bounded, so that a slow check never delays the next keepalive.
        match tokio::time::timeout(period, session.check_holders(&client)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::debug!(%error, "dlock etcd holder check failed"),
            Err(_) => tracing::debug!("dlock etcd holder check timed out"),
        }
    }
}
