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
    /// A txn that puts the key, valued with the token, if absent (on a
    /// lease) and must succeed + a txn that deletes it if it still holds
    /// the token.
    Etcd(Box<etcd_client::Client>, i64),
    /// Create an EPHEMERAL_SEQUENTIAL node under a container parent per
    /// key (with the parent in one multi when the server reaped it), sent
    /// back to back with the listing that shows it lowest; then delete it.
    /// The parent is of the kind dlock uses, so that both pay for its
    /// reaping alike.
    Zk(Arc<zookeeper_client::Client>),
    /// `pg_try_advisory_lock` + `pg_advisory_unlock` on one of 4
    /// connections by key, as dlock takes uncontended locks on its 4
    /// holder sessions.
    Postgres(Vec<tokio::sync::Mutex<sqlx::PgConnection>>),
    /// `GET_LOCK(name, 0)` + `RELEASE_LOCK(name)` on one of 4 connections
    /// by key, as dlock's 4 holder sessions.
    MySql(Vec<tokio::sync::Mutex<sqlx::MySqlConnection>>),
    /// Open the key's file in this directory (`O_NOFOLLOW`), `flock` it
    /// exclusively without blocking (its answer checked), unlock and
    /// close: the system calls a lock on one host needs, made inline, on
    /// the calling thread.
    File(std::path::PathBuf),
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

    pub(crate) async fn postgres(url: &str) -> Raw {
        use sqlx::Connection;
        let mut conns = Vec::new();
        for _ in 0..4 {
            conns.push(tokio::sync::Mutex::new(
                sqlx::PgConnection::connect(url).await.expect("postgres"),
            ));
        }
        Raw::Postgres(conns)
    }

    pub(crate) fn file(dir: std::path::PathBuf) -> Result<Raw, String> {
        std::fs::create_dir_all(&dir).map_err(|e| format!("file: {e}"))?;
        Ok(Raw::File(dir))
    }

    pub(crate) async fn mysql(url: &str) -> Raw {
        use sqlx::Connection;
        let mut conns = Vec::new();
        for _ in 0..4 {
            conns.push(tokio::sync::Mutex::new(
                sqlx::MySqlConnection::connect(url).await.expect("mysql"),
            ));
        }
        Raw::MySql(conns)
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
                use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
                let mut client = (**client).clone();
                let put = Txn::new()
                    .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(
                        key,
                        token,
                        Some(PutOptions::new().with_lease(*lease)),
                    )]);
                let put = client.txn(put).await.expect("txn put");
                assert!(put.succeeded(), "raw lock on a held key");
                let delete = Txn::new()
                    .when([Compare::value(key, CompareOp::Equal, token)])
                    .and_then([TxnOp::delete(key, None)]);
                let delete = client.txn(delete).await.expect("txn delete");
                assert!(delete.succeeded(), "raw unlock of a key not ours");
            }
            Raw::Postgres(conns) => {
                let id = advisory_id(key);
                let conn = &conns[(id as u64 % conns.len() as u64) as usize];
                let mut conn = conn.lock().await;
                let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(id)
                    .fetch_one(&mut *conn)
                    .await
                    .expect("pg_try_advisory_lock");
                assert!(locked, "raw lock on a held key");
                // Another task may use the connection in between, as
                // dlock's session serves every task between lock and unlock.
                drop(conn);
                let _ = token;
                let mut conn = conns[(id as u64 % conns.len() as u64) as usize]
                    .lock()
                    .await;
                let unlocked: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                    .bind(id)
                    .fetch_one(&mut *conn)
                    .await
                    .expect("pg_advisory_unlock");
                assert!(unlocked, "raw unlock of a key not ours");
            }
            Raw::MySql(conns) => {
                let _ = token;
                let name = format!("raw:{key}");
                let conn = &conns[(advisory_id(key) as u64 % conns.len() as u64) as usize];
                let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
                    .bind(&name)
                    .fetch_one(&mut *conn.lock().await)
                    .await
                    .expect("GET_LOCK");
                assert_eq!(locked, Some(1), "raw lock on a held key");
                // Another task may use the connection in between, as
                // dlock's session serves every task between lock and unlock.
                let unlocked: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
                    .bind(&name)
                    .fetch_one(&mut *conn.lock().await)
                    .await
                    .expect("RELEASE_LOCK");
                assert_eq!(unlocked, Some(1), "raw unlock of a key not ours");
            }
            Raw::File(dir) => {
                use rustix::fs::FlockOperation;
                use std::os::unix::fs::OpenOptionsExt;
                let _ = token;
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                    .open(dir.join(key.replace('/', "_")))
                    .expect("open the key's file");
                rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive)
                    .expect("raw lock on a held key");
                rustix::fs::flock(&file, FlockOperation::Unlock).expect("raw unlock");
            }
            Raw::Zk(client) => {
                use zookeeper_client::{Acls, CreateMode, Error, MultiWriteResult};
                let ephemeral = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
                let parent = format!("/raw/{}", key.replace(['/', ':'], "_"));
                let prefix = format!("{parent}/lock-");
                let create = client.create(&prefix, b"", &ephemeral);
                let listing = client.list_children(&parent);
                let (created, listed) = (create.await, listing.await);
                let (name, children) = match created {
                    Ok((_, seq)) => (format!("lock-{seq}"), listed.expect("list")),
                    Err(Error::NoNode) => {
                        let mut both = client.new_multi_writer();
                        let container = CreateMode::Container.with_acls(Acls::anyone_all());
                        both.add_create(&parent, b"", &container).expect("multi");
                        both.add_create(&prefix, b"", &ephemeral).expect("multi");
                        let results = both.commit().await.expect("create with parent");
                        let Some(MultiWriteResult::Create { path, .. }) = results.last() else {
                            panic!("no create result");
                        };
                        let name = path.rsplit('/').next().unwrap_or_default().to_owned();
                        (name, client.list_children(&parent).await.expect("list"))
                    }
                    Err(e) => panic!("create: {e}"),
                };
                assert!(
                    children.iter().all(|c| **c >= *name),
                    "raw lock on a held key"
                );
                client
                    .delete(&format!("{parent}/{name}"), None)
                    .await
                    .expect("delete");
            }
        }
    }
}

/// A 64-bit advisory lock id for `key` (any stable hash will do for the
/// floor and the peer).
pub(crate) fn advisory_id(key: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        hash = (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash as i64
}
