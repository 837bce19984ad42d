//! `RedisConfig`: which nodes, under which key prefix, with which timeouts;
//! parsed from one URL.

use std::time::Duration;

use dlock_core::{
    backend::{BackendUrl, TlsFiles},
    LockError,
};

/// Where and how to connect: the nodes, the key prefix, the timeouts.
///
/// Usually made from a URL by [`RedisConfig::from_url`]; the
/// [crate docs](crate#urls) list every URL form and parameter.
///
/// # Examples
///
/// ```
/// use dlock_redis::RedisConfig;
///
/// let single = RedisConfig::from_url("redis://127.0.0.1:6379/2")?;
/// assert_eq!(single.nodes(), ["redis://127.0.0.1:6379/2"]);
///
/// let redlock = RedisConfig::from_url("redis+redlock://a:7000,b:7001,c:7002?prefix=app")?;
/// assert_eq!(redlock.nodes().len(), 3);
/// assert_eq!(redlock.prefix(), "app");
///
/// let cluster = RedisConfig::from_url("redis+cluster://a:7000,b:7001")?;
/// assert!(cluster.is_cluster() && !cluster.is_redlock());
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    nodes: Vec<String>,
    redlock: bool,
    /// `redis+cluster://`: the nodes are a Redis Cluster's seed list.
    cluster: bool,
    /// `redis+sentinel://`: the nodes are the sentinels.
    sentinel: Option<Sentinel>,
    /// `Some` for `rediss://`: the files its TLS parameters name.
    tls: Option<TlsFiles>,
    prefix: String,
    connect_timeout: Duration,
    response_timeout: Duration,
    unwatched_poll: Duration,
    fences: bool,
    /// `fair=false`: plain locks are taken unfairly unless a lock asks.
    fair: bool,
    /// `wait_replicas` and `wait_timeout`: see
    /// [`wait_replicas`](RedisConfig::wait_replicas).
    wait: Option<(u32, Duration)>,
}

/// Shows the node URLs with their passwords replaced by `***`.
impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes: Vec<_> = self
            .nodes
            .iter()
            .map(|n| dlock_core::backend::redact_url(n))
            .collect();
        f.debug_struct("RedisConfig")
            .field("nodes", &nodes)
            .field("redlock", &self.redlock)
            .field("cluster", &self.cluster)
            .field("sentinel", &self.sentinel)
            .field("tls", &self.tls)
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("unwatched_poll", &self.unwatched_poll)
            .field("fences", &self.fences)
            .field("fair", &self.fair)
            .field("wait", &self.wait)
            .finish()
    }
}

/// A Sentinel deployment: the master's name, and how to log in to the
/// data nodes and to the sentinels. `Debug` shows no password.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Sentinel {
    pub(crate) master: String,
    pub(crate) db: i64,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) sentinel_user: Option<String>,
    pub(crate) sentinel_password: Option<String>,
}

impl std::fmt::Debug for Sentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |p: &Option<String>| p.as_ref().map(|_| "***");
        f.debug_struct("Sentinel")
            .field("master", &self.master)
            .field("db", &self.db)
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("sentinel_user", &self.sentinel_user)
            .field("sentinel_password", &hidden(&self.sentinel_password))
            .finish()
    }
}

impl RedisConfig {
    /// Parses a URL of any form the [crate docs](crate#urls) list.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong: another scheme
    /// (or `rediss://` without the `tls` feature), no host, a bad port or
    /// percent escape, an unknown query parameter (the error lists the
    /// valid ones) or a malformed duration, or fewer than three Redlock
    /// nodes. Names and values are percent-decoded
    /// ([`BackendUrl`](dlock_core::backend::BackendUrl)).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_redis::RedisConfig;
    /// use std::time::Duration;
    ///
    /// let config = RedisConfig::from_url(
    ///     "redis://127.0.0.1:6379/?prefix=app&connect_timeout=500ms&response_timeout=2s",
    /// )?;
    /// assert_eq!(config.prefix(), "app");
    /// assert_eq!(config.connect_timeout(), Duration::from_millis(500));
    /// assert_eq!(config.response_timeout(), Duration::from_secs(2));
    /// assert!(RedisConfig::from_url("redis://h:1?response_timeout=5").is_err());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn from_url(url: &str) -> Result<RedisConfig, LockError> {
        let mut parts = BackendUrl::parse("Redis", url)?;
        let scheme = parts.scheme().to_owned();
        let (tls, kind) = match scheme.strip_prefix("rediss") {
            Some(kind) => (true, kind),
            None => (false, scheme.strip_prefix("redis").unwrap_or(&scheme)),
        };
        let (redlock, cluster, sentinel) = match kind {
            "" => (false, false, false),
            "+redlock" => (true, false, false),
            "+cluster" => (false, true, false),
            "+sentinel" => (false, false, true),
            _ => {
                return Err(parts.invalid(&format!(
                    "unknown scheme `{scheme}`; expected `redis` or `rediss`, alone or with \
                     `+redlock`, `+cluster` or `+sentinel`"
                )))
            }
        };
        if tls && !cfg!(feature = "tls") {
            return Err(parts
                .invalid("TLS (`rediss://`) needs dlock-redis's `tls` feature (dlock's `tls`)"));
        }
        let path = parts.path().trim_matches('/').to_owned();
        // A Sentinel URL's path is the master's name, then the database.
        let (master, db) = match path.split_once('/') {
            _ if !sentinel => (String::new(), path),
            Some((master, db)) => (master.to_owned(), db.to_owned()),
            None => (path, String::new()),
        };
        if sentinel && master.is_empty() {
            return Err(
                parts.invalid("no master name: `redis+sentinel://host:port,host:port/MASTER_NAME`")
            );
        }
        if !db.is_empty() && db.parse::<u16>().is_err() {
            return Err(parts.invalid(&format!("the database `{db}` is not a number")));
        }
        let prefix = match parts.take("prefix") {
            Some(prefix) if prefix.contains(['{', '}']) => {
                return Err(parts.invalid(
                    "the prefix may not contain `{` or `}`: Redis would take the \
                     hash tag from the prefix instead of the key",
                ));
            }
            Some(prefix) if prefix.is_empty() => {
                return Err(parts.invalid("the prefix is empty"));
            }
            prefix => prefix.unwrap_or_else(|| "dlock".to_owned()),
        };
        let connect_timeout = parts
            .take_duration("connect_timeout")?
            .unwrap_or(Duration::from_secs(2));
        let response_timeout = parts
            .take_duration("response_timeout")?
            .unwrap_or(Duration::from_secs(5));
        let fences = match parts.take("fence").as_deref() {
            None => !redlock,
            Some("on") if redlock => {
                return Err(parts.invalid(
                    "Redlock gives no fencing tokens (per-node counters taken by different \
                     majorities can go backwards): leave out `fence=on`",
                ))
            }
            Some("on") => true,
            Some("off") => false,
            Some(other) => return Err(parts.invalid(&format!("`fence={other}` is not on or off"))),
        };
        let fair = match parts.take("fair").as_deref() {
            None | Some("true") => true,
            Some("false") => false,
            Some(other) => {
                return Err(parts.invalid(&format!("`fair={other}` is not true or false")))
            }
        };
        let wait = match parts.take("wait_replicas") {
            None => None,
            Some(n) => {
                let Some(n) = n.parse::<u32>().ok().filter(|n| *n > 0) else {
                    return Err(parts.invalid(&format!(
                        "`wait_replicas={n}` is not a positive number of replicas"
                    )));
                };
                if redlock || cluster {
                    return Err(parts.invalid(
                        "`wait_replicas` is for one node or Sentinel (`redis://`, \
                         `redis+sentinel://`)",
                    ));
                }
                let timeout = parts
                    .take_duration("wait_timeout")?
                    .unwrap_or(Duration::from_millis(100));
                if timeout.is_zero() || timeout >= response_timeout {
                    return Err(parts.invalid(&format!(
                        "`wait_timeout` must be above zero and below `response_timeout` \
                         ({response_timeout:?}): the wait holds the connection"
                    )));
                }
                Some((n, timeout))
            }
        };
        if wait.is_none() && parts.take("wait_timeout").is_some() {
            return Err(parts.invalid("`wait_timeout` needs `wait_replicas`"));
        }
        let sentinel = sentinel.then(|| Sentinel {
            master,
            db: db.parse().unwrap_or(0),
            user: parts.user().map(str::to_owned),
            password: parts.password().map(str::to_owned),
            sentinel_user: parts.take("sentinel_user"),
            sentinel_password: parts.take("sentinel_password"),
        });
        let files = parts.take_tls_files(tls, "rediss")?;
        let mut valid = vec![
            "prefix",
            "connect_timeout",
            "response_timeout",
            "tls_ca",
            "tls_cert",
            "tls_key",
            "fence",
            "fair",
            "wait_replicas",
            "wait_timeout",
        ];
        if sentinel.is_some() {
            valid.extend(["sentinel_user", "sentinel_password"]);
        }
        parts.finish(&valid)?;
        // A Sentinel URL's login and database are the data nodes' (above);
        // its hosts are the sentinels.
        let auth = match parts.userinfo() {
            Some(userinfo) if sentinel.is_none() => format!("{userinfo}@"),
            _ => String::new(),
        };
        let db_path = match db.as_str() {
            "" => String::new(),
            _ if sentinel.is_some() => String::new(),
            db => format!("/{db}"),
        };
        let node_scheme = if tls { "rediss" } else { "redis" };
        let nodes: Vec<String> = parts
            .hosts()
            .iter()
            .map(|host| format!("{node_scheme}://{auth}{host}{db_path}"))
            .collect();
        let mut distinct = nodes.clone();
        distinct.sort();
        distinct.dedup();
        if distinct.len() != nodes.len() {
            return Err(
                parts.invalid("a Redlock node is listed twice; the nodes must be independent")
            );
        }
        if redlock && nodes.len() < 3 {
            return Err(parts.invalid("Redlock needs at least three independent nodes"));
        }
        if !redlock && !cluster && sentinel.is_none() && nodes.len() != 1 {
            return Err(parts.invalid(
                "several hosts need `redis+redlock://` (independent nodes), \
                 `redis+cluster://` (one cluster's seed nodes) or `redis+sentinel://` \
                 (the sentinels)",
            ));
        }
        if cluster && !db.is_empty() && db != "0" {
            return Err(parts.invalid("a Redis Cluster has only database 0"));
        }
        Ok(RedisConfig {
            nodes,
            redlock,
            cluster,
            sentinel,
            tls: tls.then_some(files),
            prefix,
            connect_timeout,
            response_timeout,
            unwatched_poll: Duration::from_secs(1),
            fences,
            fair,
            wait,
        })
    }

    /// With `?wait_replicas=N[&wait_timeout=100ms]` (one node or
    /// Sentinel): a grant or renewal counts only once `N` replicas have
    /// acknowledged it (`WAIT`, pipelined with the write on its
    /// connection). An acquisition they do not acknowledge in time fails
    /// with [`LockError::Backend`] and gives the lock back; such a renewal
    /// counts as unanswered. This narrows the window in which a failover
    /// loses a grant, it does not close it (dlock's guide, "Redis
    /// failover"). Each `WAIT` holds the multiplexed connection: keep the
    /// timeout short (it must be below `response_timeout`).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_redis::RedisConfig;
    /// use std::time::Duration;
    ///
    /// let config = RedisConfig::from_url("redis+sentinel://s1:26379,s2:26379/locks?wait_replicas=1&wait_timeout=50ms")?;
    /// assert_eq!(config.wait_replicas(), Some((1, Duration::from_millis(50))));
    /// assert_eq!(RedisConfig::from_url("redis://h:6379")?.wait_replicas(), None);
    /// assert!(RedisConfig::from_url("redis+redlock://a:1,b:1,c:1?wait_replicas=1").is_err());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn wait_replicas(&self) -> Option<(u32, Duration)> {
        self.wait
    }

    /// Whether each lock carries a fencing token (`fence=on`, the default
    /// but on Redlock, which has none). With `fence=off` an uncontended
    /// acquire is one plain `SET NX PX`, every
    /// [`fencing_token`](dlock_core::LockGuard::fencing_token) is `None`,
    /// and elections, `proclaim` and `holder` answer
    /// [`LockError::Unsupported`]; the line, exclusion and owner-only
    /// release are unchanged.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_redis::RedisConfig;
    ///
    /// assert!(RedisConfig::from_url("redis://127.0.0.1:6379/")?.fences());
    /// assert!(!RedisConfig::from_url("redis://127.0.0.1:6379/?fence=off")?.fences());
    /// assert!(!RedisConfig::from_url("redis+redlock://a:1,b:2,c:3")?.fences());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn fences(&self) -> bool {
        self.fences
    }

    /// The same config with fencing tokens on or off (see
    /// [`fences`](RedisConfig::fences)); Redlock stays without.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_redis::RedisConfig;
    ///
    /// let config = RedisConfig::from_url("redis://127.0.0.1:6379/")?.with_fences(false);
    /// assert!(!config.fences());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    #[must_use]
    pub fn with_fences(mut self, fences: bool) -> Self {
        self.fences = fences && !self.redlock;
        self
    }

    /// Whether plain locks wait in line by default (`fair=true`, the
    /// default) or are taken unfairly (`?fair=false`; see
    /// [`LockOptions::fair`](dlock_core::LockOptions::fair), which a lock
    /// may set either way). Unfair, a lock is one plain attempt (the same
    /// `SET NX PX` or fenced script as an uncontended fair one), and a
    /// waiter takes no place in the key's line: it marks the holder's
    /// value, so that the release tells every waiter at once, and tries
    /// again; it also tries again when the holder's lease runs out. Fences,
    /// the owner token and the lost signal are kept, and on Redlock the
    /// rules are the same on a majority. A waiter may be passed over again
    /// and again. Read-write locks and semaphores are fair either way.
    ///
    /// The backend's `Capabilities::is_fifo` is this default: a lock that
    /// sets `LockOptions::fair(false)` on a fair backend is not served in
    /// order, and one that sets `fair(true)` on an unfair one is (among
    /// the waiters that stand in line).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_redis::RedisConfig;
    ///
    /// assert!(RedisConfig::from_url("redis://127.0.0.1:6379/")?.fair());
    /// assert!(!RedisConfig::from_url("redis://127.0.0.1:6379/?fair=false")?.fair());
    /// assert!(RedisConfig::from_url("redis://127.0.0.1:6379/?fair=no").is_err());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn fair(&self) -> bool {
        self.fair
    }

    /// The same config with plain locks fair or not by default (see
    /// [`fair`](RedisConfig::fair)).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_redis::RedisConfig;
    ///
    /// let config = RedisConfig::from_url("redis://127.0.0.1:6379/")?.with_fair(false);
    /// assert!(!config.fair());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    #[must_use]
    pub fn with_fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }

    /// Whether the nodes are a Redis Cluster's seed nodes
    /// (`redis+cluster://`).
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// Whether the nodes are sentinels that name the master
    /// (`redis+sentinel://`).
    pub fn is_sentinel(&self) -> bool {
        self.sentinel.is_some()
    }

    pub(crate) fn sentinel(&self) -> Option<&Sentinel> {
        self.sentinel.as_ref()
    }

    /// Whether the nodes are reached over TLS (`rediss://`).
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// For TLS: the CA and client certificate the URL names, read now;
    /// `None` without either. Installs ring as the process's default
    /// crypto provider unless the application installed one (redis reads
    /// only the process default; install aws-lc-rs before connecting to
    /// use it).
    #[cfg(feature = "tls")]
    fn certificates(&self) -> Result<Option<redis::TlsCertificates>, LockError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let Some(files) = self
            .tls
            .as_ref()
            .filter(|f| f.ca.is_some() || f.cert.is_some())
        else {
            return Ok(None);
        };
        let read = |path: &std::path::PathBuf| TlsFiles::read(path);
        let client_tls = match (&files.cert, &files.key) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read(cert)?,
                client_key: read(key)?,
            }),
            _ => None,
        };
        Ok(Some(redis::TlsCertificates {
            client_tls,
            root_cert: files.ca.as_ref().map(read).transpose()?,
        }))
    }

    /// The client of node `node` (one of [`nodes`](RedisConfig::nodes)),
    /// with the URL's CA and client certificate read now.
    pub(crate) fn client(&self, node: &str) -> Result<redis::Client, LockError> {
        #[cfg(feature = "tls")]
        if self.tls.is_some() {
            if let Some(certificates) = self.certificates()? {
                return redis::Client::build_with_tls(node, certificates)
                    .map_err(|e| LockError::backend("redis", e));
            }
        }
        redis::Client::open(node).map_err(|e| LockError::backend("redis", e))
    }

    /// `builder` with the URL's TLS: every node over TLS, trusting the
    /// URL's CA (or the system's roots) and presenting its client
    /// certificate, read now. Unchanged without `rediss+cluster://`.
    pub(crate) fn cluster_tls(
        &self,
        builder: redis::cluster::ClusterClientBuilder,
    ) -> Result<redis::cluster::ClusterClientBuilder, LockError> {
        #[cfg(feature = "tls")]
        if self.tls.is_some() {
            let builder = builder.tls(redis::TlsMode::Secure);
            return Ok(match self.certificates()? {
                Some(certificates) => builder.certs(certificates),
                None => builder,
            });
        }
        Ok(builder)
    }

    /// The client that asks the sentinels for the master, and connects to
    /// it with the data nodes' login and TLS; `None` unless
    /// `redis+sentinel://`.
    pub(crate) fn sentinel_client(
        &self,
    ) -> Result<Option<redis::sentinel::SentinelClient>, LockError> {
        use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
        let Some(target) = &self.sentinel else {
            return Ok(None);
        };
        let invalid = |e: redis::RedisError| LockError::backend("redis", e);
        let sentinels = self
            .nodes
            .iter()
            .map(|url| {
                redis::IntoConnectionInfo::into_connection_info(url.as_str())
                    .map(|info| info.addr().clone())
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(invalid)?;
        let mut builder =
            SentinelClientBuilder::new(sentinels, &target.master, SentinelServerType::Master)
                .map_err(invalid)?
                .set_client_to_redis_db(target.db);
        if let Some(user) = &target.user {
            builder = builder.set_client_to_redis_username(user);
        }
        if let Some(password) = &target.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(user) = &target.sentinel_user {
            builder = builder.set_client_to_sentinel_username(user);
        }
        if let Some(password) = &target.sentinel_password {
            builder = builder.set_client_to_sentinel_password(password);
        }
        #[cfg(feature = "tls")]
        if self.tls.is_some() {
            builder = builder
                .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
            if let Some(certificates) = self.certificates()? {
                builder = builder
                    .set_client_to_redis_certificates(certificates.clone())
                    .set_client_to_sentinel_certificates(certificates);
            }
        }
        builder.build().map(Some).map_err(invalid)
    }

    /// The node URLs, one per node, passwords included (their percent
    /// escapes are decoded when the node is connected); `Debug` shows them
    /// redacted.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Whether this is Redlock over several nodes.
    pub fn is_redlock(&self) -> bool {
        self.redlock
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// How long one connection attempt may take (default 2 s).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How long a command may wait for its reply (default 5 s).
    pub fn response_timeout(&self) -> Duration {
        self.response_timeout
    }

    /// Sets how long one connection attempt may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets how long a command may wait for its reply.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// The longest a waiter that cannot subscribe to the key's releases
    /// sleeps between attempts (default 1 s; it starts at 40 ms and
    /// doubles); otherwise a release or the holder's TTL wakes it.
    pub fn unwatched_poll(&self) -> Duration {
        self.unwatched_poll
    }

    /// Sets [`unwatched_poll`](RedisConfig::unwatched_poll): longer means
    /// fewer requests while pub/sub is down, and later grants. At least
    /// 20 ms.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use dlock_redis::RedisConfig;
    ///
    /// let config = RedisConfig::from_url("redis://127.0.0.1/")?
    ///     .with_unwatched_poll(Duration::from_secs(5));
    /// assert_eq!(config.unwatched_poll(), Duration::from_secs(5));
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn with_unwatched_poll(mut self, max: Duration) -> Self {
        self.unwatched_poll = max.max(Duration::from_millis(20));
        self
    }
}

#[cfg(test)]
mod tests;
