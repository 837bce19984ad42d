//! One Redis node (or one Redis Cluster, which is one node to the lock
//! algorithm: each key's names live in one slot): a reconnecting
//! multiplexed connection, on which the scripts run (see `scripts`), and
//! its shared pub/sub subscriber.

use std::time::Duration;

use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    cluster::ClusterClient,
    Client, ErrorKind, RedisError, RedisResult,
};

mod conn;
mod replicas;

pub(crate) use conn::Conn;

use crate::{
    sentinel::{Following, Master},
    subscriber::{Source, Subscriber},
};

/// The reconnecting connection's settings.
fn manager_config(
    connect_timeout: Duration,
    response_timeout: Duration,
) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500))
}

pub(crate) struct Node {
    pub(crate) addr: String,
    conn: Conn,
    /// Wakes this process's waiters by the releases that name them.
    pub(crate) subscriber: Subscriber,
    /// A cluster: wake-ups on shard channels, and no pipeline across keys.
    pub(crate) cluster: bool,
    /// `wait_replicas`: how many replicas must acknowledge a grant or a
    /// renewal, and for how long to wait (see `replicas`).
    pub(crate) wait: Option<(u32, Duration)>,
}

impl Node {
    fn new(addr: String, conn: Conn, source: Source, timeouts: (Duration, Duration)) -> Node {
        Node {
            addr,
            cluster: matches!(conn, Conn::Cluster(_)),
            conn,
            subscriber: Subscriber::new(source, timeouts),
            wait: None,
        }
    }

    /// A node through `client`. With `eager`, connects now and fails if
    /// the node is unreachable; otherwise connects on first use.
    pub(crate) async fn from_client(
        client: Client,
        connect_timeout: Duration,
        response_timeout: Duration,
        eager: bool,
    ) -> RedisResult<Node> {
        let config = manager_config(connect_timeout, response_timeout);
        let conn = if eager {
            let mut conn = ConnectionManager::new_with_config(client.clone(), config).await?;
            crate::eviction::warn_if_evicting(&mut conn, &client).await;
            conn
        } else {
            // Connects in the background, at the first command.
            let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
            let mut check = conn.clone();
            let node = client.clone();
            tokio::spawn(async move { crate::eviction::warn_if_evicting(&mut check, &node).await });
            conn
        };
        let addr = client.get_connection_info().addr().to_string();
        let timeouts = (connect_timeout, response_timeout);
        Ok(Node::new(
            addr,
            Conn::Node(conn),
            Source::Node(client),
            timeouts,
        ))
    }

    /// The master of a Sentinel deployment, as one node: connects now to
    /// the master the sentinels name, and follows the next one they name
    /// (commands and wake-ups alike).
    pub(crate) async fn sentinel(
        sentinel: redis::sentinel::SentinelClient,
        name: &str,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Node> {
        let manager = manager_config(connect_timeout, response_timeout);
        let master = Master::connect(sentinel, name, manager, connect_timeout).await?;
        Ok(Node::new(
            format!("sentinel master `{name}`"),
            Conn::Sentinel(Following(master.clone())),
            Source::Sentinel(master),
            (connect_timeout, response_timeout),
        ))
    }

    /// A Redis Cluster through `client`, as one node: connects now, and
    /// fails if no node of the list answers. Commands go to the master of
    /// their key's slot, following the cluster as slots move and replicas
    /// take over; wake-ups come on shard channels (`SSUBSCRIBE`).
    pub(crate) async fn cluster(
        client: ClusterClient,
        subscriber: ClusterClient,
        connect_timeout: Duration,
        response_timeout: Duration,
        addr: String,
    ) -> RedisResult<Node> {
        let conn = tokio::time::timeout(connect_timeout, client.get_async_connection())
            .await
            .map_err(|_| RedisError::from((ErrorKind::Io, "cluster connect timed out")))??;
        let timeouts = (connect_timeout, response_timeout);
        Ok(Node::new(
            addr,
            Conn::Cluster(conn),
            Source::Cluster(subscriber),
            timeouts,
        ))
    }

    /// Runs `script` with the keys and arguments `args` writes in one
    /// `EVALSHA`, loading the script first if the node lost it (a restart,
    /// `SCRIPT FLUSH`); with `acked`, and `WAIT`'s answer as in
    /// [`query`](Node::query).
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        script: &redis::Script,
        acked: bool,
        args: impl FnOnce(&mut redis::Cmd),
    ) -> RedisResult<(T, Option<i64>)> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash());
        args(&mut cmd);
        match self.query(&cmd, acked).await {
            Err(e) if e.kind() == ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script.load_async(&mut self.conn.clone()).await?;
                self.query(&cmd, acked).await
            }
            answer => answer,
        }
    }

    /// A handle on the node's multiplexed connection.
    pub(crate) fn connection(&self) -> Conn {
        self.conn.clone()
    }
}
