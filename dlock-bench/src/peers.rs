//! The lock recipes the client crates ship, measured beside dlock on the
//! same servers: `rslock` (Redlock over redis-rs) on Redis, etcd's
//! server-side lock API (through `etcd-client`) and `zookeeper-client`'s
//! lock recipe.

use std::{sync::Arc, time::Duration};

use dlock_etcd::etcd_client;
use dlock_zk::zookeeper_client;
use futures_util::future::BoxFuture;

use crate::{
    lockable::{Lockable, Unlock},
    Target,
};

/// The peers that run on `target`'s servers.
pub(crate) async fn of(target: &Target) -> Vec<Arc<dyn Lockable>> {
    let redis = target.redis_urls();
    if !redis.is_empty() {
        return vec![Arc::new(RsLock(rslock::LockManager::new(redis)))];
    }
    let Some(endpoint) = target.endpoint() else {
        return Vec::new();
    };
    match target.name {
        "etcd" => vec![Arc::new(EtcdLockApi::connect(&endpoint).await)],
        "zookeeper" => vec![Arc::new(ZkRecipe::connect(&endpoint).await)],
        "postgres" => vec![Arc::new(SqlxAdvisoryLock::connect(&endpoint).await)],
        _ => Vec::new(),
    }
}

/// `rslock` as its documentation uses it: `acquire` loops over `lock` (3
/// tries a call, a random 0–200 ms sleep between tries) until it holds;
/// a quorum of the given nodes (one node: that one).
struct RsLock(rslock::LockManager);

impl Lockable for RsLock {
    fn label(&self) -> &str {
        "rslock"
    }

    fn lock<'a>(&'a self, _task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let guard = self
                .0
                .acquire(key, Duration::from_secs(30))
                .await
                .expect("rslock acquire");
            Unlock(Box::pin(guard.release()))
        })
    }

    /// `SET NX PX` to lock, a script to unlock.
    fn redis_commands(&self) -> &'static [&'static str] {
        &["set", "evalsha", "eval"]
    }
}

/// Tasks that may lock at once; each has a lease of its own, since etcd's
/// lock API makes one owner of every holder of a lease.
const TASKS: usize = 64;

/// etcd's `Lock` / `Unlock` RPCs (v3lock), one lease per task.
struct EtcdLockApi {
    client: etcd_client::Client,
    leases: Vec<i64>,
}

impl EtcdLockApi {
    async fn connect(endpoint: &str) -> EtcdLockApi {
        let mut client = etcd_client::Client::connect([endpoint], None)
            .await
            .expect("etcd");
        let mut leases = Vec::with_capacity(TASKS);
        for _ in 0..TASKS {
            leases.push(client.lease_grant(3600, None).await.expect("lease").id());
        }
        EtcdLockApi { client, leases }
    }
}

impl Lockable for EtcdLockApi {
    fn label(&self) -> &str {
        "etcd lock API"
    }

    fn lock<'a>(&'a self, task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let mut client = self.client.clone();
            let options = etcd_client::LockOptions::new().with_lease(self.leases[task]);
            let owned = client
                .lock(key, Some(options))
                .await
                .expect("etcd lock")
                .key()
                .to_vec();
            Unlock(Box::pin(async move {
                client.unlock(owned).await.expect("etcd unlock");
            }))
        })
    }
}

/// `zookeeper-client`'s lock recipe (Curator-compatible prefix); its lock is
/// released by dropping it, which deletes the node in the background. Each
/// key's directory is a container under a persistent `/peer`, as dlock's
/// parents are (and the floor's), so that all three pay alike for the
/// server reaping an empty one and the next lock creating it again.
struct ZkRecipe(zookeeper_client::Client);

impl ZkRecipe {
    async fn connect(endpoint: &str) -> ZkRecipe {
        let client = zookeeper_client::Client::connector()
            .with_session_timeout(std::time::Duration::from_secs(10))
            .connect(endpoint)
            .await
            .expect("zookeeper");
        let root = zookeeper_client::CreateMode::Persistent
            .with_acls(zookeeper_client::Acls::anyone_all());
        match client.create("/peer", b"", &root).await {
            Ok(_) | Err(zookeeper_client::Error::NodeExists) => {}
            Err(e) => panic!("/peer: {e}"),
        }
        ZkRecipe(client)
    }
}

impl Lockable for ZkRecipe {
    fn label(&self) -> &str {
        "zk lock recipe"
    }

    fn lock<'a>(&'a self, _task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let dir = format!("/peer/{}", key.replace(['/', ':'], "_"));
            let prefix = zookeeper_client::LockPrefix::new_curator(&dir, "lock-").expect("prefix");
            let acls = zookeeper_client::Acls::anyone_all();
            let options = zookeeper_client::LockOptions::new(acls)
                .with_ancestor_options(zookeeper_client::CreateMode::Container.with_acls(acls))
                .expect("options");
            let lock = self.0.lock(prefix, b"", options).await.expect("zk lock");
            Unlock(Box::pin(async move { drop(lock) }))
        })
    }
}

/// sqlx's `PgAdvisoryLock`, as its documentation uses it: a connection
/// from a pool (sqlx's default of 10), `acquire` (a blocking
/// `pg_advisory_lock` on it), and `release_now` (`pg_advisory_unlock`),
/// which gives the connection back to the pool.
///
/// A guard borrows its `PgAdvisoryLock`, so each key's lock is made once
/// and kept for the run (the bench names a few dozen keys).
struct SqlxAdvisoryLock(
    sqlx::PgPool,
    std::sync::Mutex<std::collections::HashMap<String, &'static sqlx::postgres::PgAdvisoryLock>>,
);

impl SqlxAdvisoryLock {
    async fn connect(url: &str) -> SqlxAdvisoryLock {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(10)
            .connect(url)
            .await
            .expect("postgres pool");
        SqlxAdvisoryLock(pool, Default::default())
    }
}

impl Lockable for SqlxAdvisoryLock {
    fn label(&self) -> &str {
        "sqlx PgAdvisoryLock"
    }

    fn lock<'a>(&'a self, _task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let lock = *self
                .1
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(key.to_owned())
                .or_insert_with(|| {
                    Box::leak(Box::new(sqlx::postgres::PgAdvisoryLock::with_key(
                        sqlx::postgres::PgAdvisoryLockKey::BigInt(crate::raw::advisory_id(key)),
                    )))
                });
            let conn = self.0.acquire().await.expect("a pooled connection");
            let guard = lock.acquire(conn).await.expect("pg_advisory_lock");
            Unlock(Box::pin(async move {
                guard.release_now().await.expect("pg_advisory_unlock");
            }))
        })
    }
}
