//! The requests dlock sends etcd: sent again while no live member
//! answers, watches from the current revision, leases in whole seconds.

use std::time::Duration;

use dlock_core::{backend::Backoff, LockError, Result};
use etcd_client::{
    Client, Compare, CompareOp, GetOptions, GetResponse, PutOptions, Txn, TxnOp, TxnResponse,
    WatchOptions, WatchResponse, WatchStream,
};

use super::{backend_error, EtcdBackend, NAME};

/// A transaction that puts `value` at `name` with `options` only while the
/// key is the one created at `revision` (ours, granted then): a key lost
/// meanwhile is never recreated, nor another's written.
pub(super) fn put_if_created(
    name: &str,
    revision: i64,
    value: impl Into<Vec<u8>>,
    options: PutOptions,
) -> Txn {
    Txn::new()
        .when([Compare::create_revision(name, CompareOp::Equal, revision)])
        .and_then([TxnOp::put(name, value, Some(options))])
}

/// A transaction that deletes `name` only if `ours` holds.
pub(super) fn delete_if(name: impl Into<Vec<u8>>, ours: Compare) -> Txn {
    Txn::new()
        .when([ours])
        .and_then([TxnOp::delete(name, None)])
}

/// gRPC's `UNAVAILABLE`: the request reached no live member.
const GRPC_UNAVAILABLE: i32 = 14;

/// Whether `e` says the request reached no live member (a member just died
/// or is being balanced away from): worth sending again, to another one.
fn is_unavailable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => i32::from(status.code()) == GRPC_UNAVAILABLE,
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// Runs an idempotent request, sending it again a few times while no live
/// member was reached.
pub(super) async fn retried<T, F, Fut>(mut request: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(300));
    for _ in 0..4 {
        match request().await {
            Err(e) if is_unavailable(&e) => {
                tokio::time::sleep(backoff.next_delay()).await;
            }
            other => return other.map_err(backend_error),
        }
    }
    request().await.map_err(backend_error)
}

/// Waits on `watch` for a response that `wanted` picks: an error if the
/// watch ends first.
pub(super) async fn watched(
    watch: &mut WatchStream,
    wanted: impl Fn(&WatchResponse) -> bool,
) -> Result<()> {
    loop {
        match watch.message().await.map_err(backend_error)? {
            Some(response) if response.canceled() => break,
            Some(response) if wanted(&response) => return Ok(()),
            Some(_) => {}
            None => break,
        }
    }
    Err(LockError::backend(
        NAME,
        std::io::Error::other("the watch ended"),
    ))
}

impl EtcdBackend {
    pub(super) fn client(&self) -> Client {
        self.inner.client.clone()
    }

    /// A transaction, [`retried`].
    pub(super) async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        retried(|| {
            let (mut client, txn) = (self.client(), txn.clone());
            async move { client.txn(txn).await }
        })
        .await
    }

    /// A read, [`retried`].
    pub(super) async fn get(&self, key: &str, options: GetOptions) -> Result<GetResponse> {
        retried(|| {
            let (mut client, options) = (self.client(), options.clone());
            async move { client.get(key, Some(options)).await }
        })
        .await
    }

    /// A read of a key given as bytes, [`retried`].
    pub(super) async fn get_bytes(&self, key: &[u8], options: GetOptions) -> Result<GetResponse> {
        retried(|| {
            let (mut client, options) = (self.client(), options.clone());
            async move { client.get(key, Some(options)).await }
        })
        .await
    }

    /// A watch of `key` (with `options`) from the current revision, once
    /// etcd has made it: events from then on.
    pub(super) async fn watch_from_now(
        &self,
        key: impl Into<Vec<u8>>,
        options: Option<WatchOptions>,
    ) -> Result<WatchStream> {
        let watch = self.client().watch(key, options).await;
        let mut watch = watch.map_err(backend_error)?;
        watched(&mut watch, WatchResponse::created).await?;
        Ok(watch)
    }

    /// How long `lease` has left, [`retried`]; `None` if it is gone.
    pub(super) async fn lease_left(&self, lease: i64) -> Result<Option<Duration>> {
        let answer = retried(|| {
            let mut client = self.client();
            async move { client.lease_time_to_live(lease, None).await }
        })
        .await?;
        Ok(u64::try_from(answer.ttl()).ok().map(Duration::from_secs))
    }

    /// A new etcd lease of `lease`, rounded up to whole seconds as etcd
    /// counts.
    pub(super) async fn grant_lease(&self, lease: Duration) -> Result<i64> {
        let secs = lease.as_secs_f64().ceil().max(1.0) as i64;
        let grant = retried(|| {
            let mut client = self.client();
            async move { client.lease_grant(secs, None).await }
        })
        .await?;
        Ok(grant.id())
    }
}
