//! The raw floor: the same round trips a lock and unlock need, made with
//! the backend's own client and nothing else, measured in the same run.

use std::{sync::Arc, time::Duration};

use dlock_etcd::etcd_client;
use dlock_redis::redis;
use dlock_zk::zookeeper_client;
use futures_util::future::join_all;

/// One lock + unlock with the bare client.
pub(crate) enum Raw {
    /// `SET key token NX PX` + an EVALSHA compare-and-delete, per node.
    Redis(Vec<redis::aio::MultiplexedConnection>, Arc<redis::Script>),
    /// A txn that puts the key if absent (on a lease) + a delete.
    Etcd(Box<etcd_client::Client>, i64),
    /// Create an EPHEMERAL_SEQUENTIAL node + delete it.
    Zk(Arc<zookeeper_client::Client>),
}

const COMPARE_AND_DELETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

impl Raw {
    pub(crate) async fn redis(urls: &[String]) -> Raw {
        let mut conns = Vec::new();
        for url in urls {
            let client = redis::Client::open(url.as_str()).expect("redis url");
            conns.push(
                client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("redis"),
            );
        }
        Raw::Redis(conns, Arc::new(redis::Script::new(COMPARE_AND_DELETE)))
    }

    pub(crate) async fn etcd(endpoint: &str) -> Raw {
        let mut client = etcd_client::Client::connect([endpoint], None)
            .await
            .expect("etcd");
        let lease = client.lease_grant(3600, None).await.expect("lease").id();
        Raw::Etcd(Box::new(client), lease)
    }

    pub(crate) async fn zk(endpoint: &str) -> Raw {
        let client = zookeeper_client::Client::connector()
            .with_session_timeout(Duration::from_secs(10))
            .connect(endpoint)
            .await
            .expect("zookeeper");
        let options = zookeeper_client::CreateMode::Persistent
            .with_acls(zookeeper_client::Acls::anyone_all());
        let _ = client.create("/raw", b"", &options).await;
        Raw::Zk(Arc::new(client))
    }

    /// Locks and unlocks `key` once.
    pub(crate) async fn lock_unlock(&self, key: &str, token: &str) {
        match self {
            Raw::Redis(conns, script) => {
                join_all(conns.iter().map(|c| async move {
                    let mut c = c.clone();
                    let set: Option<String> = redis::cmd("SET")
                        .arg(key)
                        .arg(token)
                        .arg("NX")
                        .arg("PX")
                        .arg(30_000)
                        .query_async(&mut c)
                        .await
                        .expect("SET NX PX");
                    assert!(set.is_some(), "raw lock on a held key");
                }))
                .await;
                join_all(conns.iter().map(|c| async move {
                    let mut c = c.clone();
                    let _: i64 = script
                        .key(key)
                        .arg(token)
                        .invoke_async(&mut c)
                        .await
                        .expect("compare and delete");
                }))
                .await;
            }
            Raw::Etcd(client, lease) => {
                let mut client = (**client).clone();
                let put = etcd_client::Txn::new()
                    .when([etcd_client::Compare::create_revision(
                        key,
                        etcd_client::CompareOp::Equal,
                        0,
                    )])
                    .and_then([etcd_client::TxnOp::put(
                        key,
                        "",
                        Some(etcd_client::PutOptions::new().with_lease(*lease)),
                    )]);
                client.txn(put).await.expect("txn put");
                client.delete(key, None).await.expect("delete");
            }
            Raw::Zk(client) => {
                let options = zookeeper_client::CreateMode::EphemeralSequential
                    .with_acls(zookeeper_client::Acls::anyone_all());
                let path = format!("/raw/{}-", key.replace('/', "_"));
                let (_, seq) = client.create(&path, b"", &options).await.expect("create");
                client
                    .delete(&format!("{path}{seq}"), None)
                    .await
                    .expect("delete");
            }
        }
    }
}
