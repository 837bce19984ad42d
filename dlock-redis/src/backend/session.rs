//! Connecting to the node(s), and the connection state, which follows
//! what the backend's own requests find (Redis has no session to watch):
//! a step a quorum does not serve is `Suspended`, renewals that find no
//! quorum for longer than their lease `Lost`, the next answered step
//! `Reconnected`.

use std::{sync::Arc, time::Duration};

use dlock_core::{LockError, Result};
use futures_util::future::join_all;
use redis::RedisResult;

use super::{backend_error, Inner, RedisBackend, NAME};
use crate::{config::RedisConfig, node::Node, scripts::scripts, sentinel::not_served};

/// The oldest Redis the scripts run on (`SET … GET`, 6.2).
const OLDEST_REDIS: (u32, u32) = (6, 2);

/// The version an `INFO server` answer names, if older than [`OLDEST_REDIS`].
fn too_old(info: &str) -> Option<&str> {
    let version = info
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))?
        .trim();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let (major, minor) = (parts.next()??, parts.next()??);
    ((major, minor) < OLDEST_REDIS).then_some(version)
}

impl RedisBackend {
    /// Connects to what the URL names (see [`RedisConfig::from_url`]).
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a malformed URL;
    /// [`LockError::Backend`] if the node (for Redlock: a majority of the
    /// nodes) cannot be reached within the connect timeout;
    /// [`LockError::UnsafeDeployment`] for a Redis older than 6.2.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), dlock_core::LockError> {
    /// let single = dlock_redis::RedisBackend::connect("redis://127.0.0.1/").await?;
    /// let redlock = dlock_redis::RedisBackend::connect("redis+redlock://h1:6379,h2:6379,h3:6379").await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<RedisBackend> {
        Self::connect_with(RedisConfig::from_url(url)?).await
    }

    /// Connects with a prepared [`RedisConfig`].
    ///
    /// # Errors
    ///
    /// As [`connect`](RedisBackend::connect).
    pub async fn connect_with(config: RedisConfig) -> Result<RedisBackend> {
        if let (Some(sentinel), Some(target)) = (config.sentinel_client()?, config.sentinel()) {
            // Boxed: inline, its deep futures push callers' layouts past
            // rustc's recursion limit.
            let node = Box::pin(Node::sentinel(
                sentinel,
                &target.master,
                config.connect_timeout(),
                config.response_timeout(),
            ))
            .await
            .map_err(backend_error)?;
            return Self::on_nodes(vec![node], &config).await;
        }
        if config.is_cluster() {
            let client = |resp3: bool| {
                let mut builder = redis::cluster::ClusterClient::builder(config.nodes().to_vec())
                    .connection_timeout(config.connect_timeout())
                    .response_timeout(config.response_timeout())
                    .retries(3);
                if resp3 {
                    builder = builder.use_protocol(redis::ProtocolVersion::RESP3);
                }
                builder = config.cluster_tls(builder)?;
                builder.build().map_err(backend_error)
            };
            let node = Node::cluster(
                client(false)?,
                client(true)?,
                config.connect_timeout(),
                config.response_timeout(),
                config.nodes().join(","),
            )
            .await
            .map_err(backend_error)?;
            return Self::on_nodes(vec![node], &config).await;
        }
        let eager = !config.is_redlock();
        let clients = config
            .nodes()
            .iter()
            .map(|url| config.client(url))
            .collect::<Result<Vec<_>>>()?;
        let connecting = clients.into_iter().map(|client| {
            Node::from_client(
                client,
                config.connect_timeout(),
                config.response_timeout(),
                eager,
            )
        });
        let nodes = join_all(connecting)
            .await
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(backend_error)?;
        Self::on_nodes(nodes, &config).await
    }

    /// A single-node backend on a client the application already has (its
    /// node, credentials and TLS), with the prefix `dlock` and the default
    /// timeouts; it opens its own connections through the client.
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] if the node cannot be reached within the
    /// connect timeout.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use dlock_core::BackendExt;
    /// use dlock_redis::{redis, RedisBackend};
    ///
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let locker = RedisBackend::from_client(client).await?.into_locker();
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_client(client: redis::Client) -> Result<RedisBackend> {
        Self::from_client_with(client, &RedisConfig::from_url("redis://127.0.0.1/")?).await
    }

    /// [`from_client`](RedisBackend::from_client) with the prefix and the
    /// timeouts of `config` (a one-node config: its node is the client's
    /// business).
    ///
    /// # Errors
    ///
    /// As [`from_client`](RedisBackend::from_client);
    /// [`LockError::InvalidOptions`] for a Redlock config (build Redlock
    /// from a URL).
    pub async fn from_client_with(
        client: redis::Client,
        config: &RedisConfig,
    ) -> Result<RedisBackend> {
        if config.is_redlock() {
            return Err(dlock_core::InvalidReason::Other(
                "a client names one node: Redlock is built from a `redis+redlock://` URL"
                    .to_owned(),
            )
            .into());
        }
        let node = Node::from_client(
            client,
            config.connect_timeout(),
            config.response_timeout(),
            true,
        )
        .await
        .map_err(backend_error)?;
        Self::on_nodes(vec![node], config).await
    }

    async fn on_nodes(mut nodes: Vec<Node>, config: &RedisConfig) -> Result<RedisBackend> {
        for node in &mut nodes {
            node.wait = config.wait_replicas();
            // Preloaded, so the first calls need no `NOSCRIPT` retry (not
            // fatal: a call loads a missing script). Redlock's nodes
            // connect in the background.
            let mut conn = node.connection();
            let scripts = scripts(node.cluster);
            let preload = async move {
                if let Err(error) = scripts.load(&mut conn).await {
                    tracing::debug!(%error, "dlock redis could not preload its scripts");
                }
            };
            if config.is_redlock() {
                tokio::spawn(preload);
            } else {
                preload.await;
            }
        }
        let backend = RedisBackend {
            inner: Arc::new(Inner {
                quorum: nodes.len() / 2 + 1,
                nodes,
                prefix: config.prefix().to_owned(),
                redlock: config.is_redlock(),
                fences: config.fences(),
                fair: config.fair(),
                subscribe_timeout: config.response_timeout(),
                unreachable_after: config.connect_timeout() + config.response_timeout(),
                unwatched_poll: config.unwatched_poll(),
                local: dlock_core::backend::LocalTurns::new(),
                states: dlock_core::backend::ConnectionStates::new(NAME),
                answered_at: std::sync::Mutex::new(tokio::time::Instant::now()),
                probe: std::sync::atomic::AtomicUsize::new(0),
            }),
        };
        if config.is_redlock() {
            backend.ping_quorum(config.connect_timeout()).await?;
        }
        if !config.is_cluster() {
            // A cluster needs Redis 7 (shard channels), and its `INFO`
            // goes to one node of many.
            backend.refuse_old_servers(config.connect_timeout()).await?;
        }
        let weak = Arc::downgrade(&backend.inner);
        backend.inner.states.probe_while_disconnected(move || {
            let backend = RedisBackend {
                inner: weak.upgrade()?,
            };
            Some(async move {
                let _ = dlock_core::backend::Backend::check_servers(&backend).await;
            })
        });
        Ok(backend)
    }

    /// Refuses a node that answers with a Redis older than
    /// [`OLDEST_REDIS`] (the fence's `SET … GET` is a syntax error there)
    /// with [`LockError::UnsafeDeployment`]; a node that does not answer,
    /// or say its version, is not refused here.
    async fn refuse_old_servers(&self, within: Duration) -> Result<()> {
        let answers = self
            .on_every_node(Some(within), |node| {
                let mut conn = node.connection();
                async move {
                    redis::cmd("INFO")
                        .arg("server")
                        .query_async::<String>(&mut conn)
                        .await
                }
            })
            .await;
        for (node, answer) in self.inner.nodes.iter().zip(answers) {
            let Ok(info) = answer else { continue };
            if let Some(version) = too_old(&info) {
                return Err(LockError::UnsafeDeployment {
                    backend: NAME,
                    reason: format!(
                        "{} runs Redis {version}; dlock's scripts need {}.{} or later \
                         (the fencing counter is written with `SET … GET`): upgrade the server",
                        node.addr, OLDEST_REDIS.0, OLDEST_REDIS.1
                    ),
                });
            }
        }
        Ok(())
    }

    /// Feeds the connection state from one step's answers: `answered` if
    /// a quorum served it (even with a script's error), else `suspended`.
    pub(super) fn observe<T>(&self, answers: &[RedisResult<T>]) {
        let reached = answers
            .iter()
            .filter(|a| !matches!(a, Err(e) if not_served(e)))
            .count();
        if reached >= self.inner.quorum {
            *self.answered_at() = tokio::time::Instant::now();
            self.inner.states.answered();
        } else {
            self.inner.states.suspended();
        }
    }

    fn answered_at(&self) -> std::sync::MutexGuard<'_, tokio::time::Instant> {
        self.inner
            .answered_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// After renewals a quorum did not answer: `lost` at the end of
    /// `lease` unless a quorum answers by then.
    fn lost_unless_answered_within(&self, lease: Duration) {
        let answered = *self.answered_at();
        let inner = Arc::downgrade(&self.inner);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            tokio::time::sleep_until(answered + lease).await;
            if let Some(inner) = inner.upgrade() {
                let backend = RedisBackend { inner };
                if *backend.answered_at() == answered {
                    backend.inner.states.lost();
                }
            }
        });
    }
}

/// A renewal round in flight: dropped unanswered (the watchdog gives a
/// round one period, which a black-holed node outlasts), it counts so.
pub(super) struct RenewalInFlight<'a> {
    pub(super) backend: &'a RedisBackend,
    pub(super) lease: Duration,
    pub(super) answered: bool,
}

impl Drop for RenewalInFlight<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.backend.inner.states.suspended();
            self.backend.lost_unless_answered_within(self.lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::too_old;

    #[test]
    fn servers_before_6_2_are_too_old() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        assert_eq!(too_old(&info("6.0.16")), Some("6.0.16"));
        assert_eq!(too_old(&info("5.0.14")), Some("5.0.14"));
        for fine in ["6.2.0", "6.2.14", "7.0.15", "7.2.4", "8.0.0"] {
            assert_eq!(too_old(&info(fine)), None, "{fine}");
        }
        assert_eq!(too_old("# Server\r\nredis_mode:standalone\r\n"), None);
        assert_eq!(too_old(&info("unknown")), None);
    }
}
