//! Following the master of a Sentinel deployment. Commands go to the
//! master named last. Every second one sentinel is asked the master's
//! address on a kept connection; an error a failover explains (see
//! [`not_served`]) asks the sentinels in full, with the named master's
//! `ROLE` checked. A new master gets a new connection, and the subscriber
//! follows it ([`Master::changes`]). One question at a time.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard, Weak,
    },
    time::Duration,
};

use redis::{
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection},
    sentinel::SentinelClient,
    Client, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};
use tokio::{sync::watch, time::Instant};

/// How often the sentinels are asked, without an error to prompt it.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The least time between two refreshes prompted by errors.
const REFRESH_GAP: Duration = Duration::from_millis(100);

/// How the sentinels are asked: in full through the client, or for the
/// address alone on a kept connection to one sentinel.
struct Asking {
    client: SentinelClient,
    sentinel: Option<MultiplexedConnection>,
}

impl Asking {
    /// `host:port` of the master the sentinels name `name`, from one
    /// sentinel.
    async fn master_addr(&mut self, name: &str) -> RedisResult<String> {
        if self.sentinel.is_none() {
            let client = self.client.async_get_sentinel_client().await?;
            self.sentinel = Some(client.get_multiplexed_async_connection().await?);
        }
        let Some(conn) = self.sentinel.as_mut() else {
            return Err(timed_out());
        };
        let named: RedisResult<Option<(String, u16)>> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(name)
            .query_async(conn)
            .await;
        match named {
            Ok(Some((host, port))) => Ok(format!("{host}:{port}")),
            Ok(None) => Err(RedisError::from((
                ErrorKind::Server(ServerErrorKind::ResponseError),
                "the sentinel knows no master by this name",
            ))),
            Err(e) => {
                // Asked again on another connection, perhaps another
                // sentinel.
                self.sentinel = None;
                Err(e)
            }
        }
    }
}

/// The master now: its address, and a connection to it.
struct Current {
    addr: String,
    client: Client,
    conn: ConnectionManager,
}

/// The master of one Sentinel deployment, as its sentinels name it.
pub(crate) struct Master {
    /// Held across a question and the change it makes, so that a late
    /// answer never replaces a newer one.
    asking: tokio::sync::Mutex<Asking>,
    /// A refresh prompted by an error runs: no second one is started.
    refreshing: AtomicBool,
    current: Mutex<Current>,
    /// Counts the masters followed: bumped at each change.
    changes: watch::Sender<u64>,
    manager: ConnectionManagerConfig,
    connect_timeout: Duration,
    /// When the last refresh started.
    refreshed: Mutex<Instant>,
    /// The master's name, for logs.
    pub(crate) name: String,
}

fn timed_out() -> RedisError {
    RedisError::from((ErrorKind::Io, "the sentinels did not answer in time"))
}

/// Whether `e` says the server did not serve the command: the connection
/// failed, or a demoted (or replaced) master refused it.
pub(crate) fn not_served(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}

impl Master {
    /// Asks the sentinels for the master and connects to it, within
    /// `connect_timeout`; then checks every second.
    pub(crate) async fn connect(
        mut sentinel: SentinelClient,
        name: &str,
        manager: ConnectionManagerConfig,
        connect_timeout: Duration,
    ) -> RedisResult<Arc<Master>> {
        let client = tokio::time::timeout(connect_timeout, sentinel.async_get_client())
            .await
            .map_err(|_| timed_out())??;
        let mut conn = tokio::time::timeout(
            connect_timeout,
            ConnectionManager::new_with_config(client.clone(), manager.clone()),
        )
        .await
        .map_err(|_| timed_out())??;
        crate::eviction::warn_if_evicting(&mut conn, &client).await;
        let master = Arc::new(Master {
            asking: tokio::sync::Mutex::new(Asking {
                client: sentinel,
                sentinel: None,
            }),
            refreshing: AtomicBool::new(false),
            current: Mutex::new(Current {
                addr: client.get_connection_info().addr().to_string(),
                client,
                conn,
            }),
            changes: watch::Sender::new(0),
            manager,
            connect_timeout,
            refreshed: Mutex::new(Instant::now()),
            name: name.to_owned(),
        });
        tokio::spawn(check(Arc::downgrade(&master)));
        Ok(master)
    }

    fn current(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The master's client now, for the subscriber.
    pub(crate) fn client(&self) -> Client {
        self.current().client.clone()
    }

    /// Changes each time a new master is followed.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Asks the sentinels again, soon, unless a refresh runs or started
    /// within [`REFRESH_GAP`].
    fn suspect(self: &Arc<Self>) {
        {
            let mut refreshed = self.refreshed.lock().unwrap_or_else(|e| e.into_inner());
            if refreshed.elapsed() < REFRESH_GAP {
                return;
            }
            if self.refreshing.swap(true, Ordering::SeqCst) {
                return;
            }
            *refreshed = Instant::now();
        }
        let master = self.clone();
        tokio::spawn(async move {
            let answer = {
                let mut asking = master.asking.lock().await;
                master.follow(&mut asking).await
            };
            master.refreshing.store(false, Ordering::SeqCst);
            if let Err(error) = answer {
                tracing::debug!(%error, master = %master.name, "dlock redis: asking the sentinels failed");
            }
        });
    }

    /// Asks the sentinels in full which server is master (and that server
    /// whether it is); follows it if it is another one.
    async fn follow(&self, asking: &mut Asking) -> RedisResult<()> {
        let client = tokio::time::timeout(self.connect_timeout, asking.client.async_get_client())
            .await
            .map_err(|_| timed_out())??;
        let addr = client.get_connection_info().addr().to_string();
        if addr == self.current().addr {
            return Ok(());
        }
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), self.manager.clone())?;
        let old = std::mem::replace(
            &mut *self.current(),
            Current {
                addr: addr.clone(),
                client,
                conn,
            },
        );
        tracing::warn!(
            master = %self.name,
            from = %old.addr,
            to = %addr,
            "dlock redis: the sentinels name a new master; following it"
        );
        self.changes.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Asks one sentinel the master's address; follows it, in full, if
    /// it moved.
    async fn check(&self) -> RedisResult<()> {
        let mut asking = self.asking.lock().await;
        let named = tokio::time::timeout(self.connect_timeout, asking.master_addr(&self.name))
            .await
            .map_err(|_| timed_out())??;
        if named == self.current().addr {
            return Ok(());
        }
        self.follow(&mut asking).await
    }
}

/// Asks the sentinels every [`CHECK_EVERY`] while the master is followed.
async fn check(master: Weak<Master>) {
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        let Some(master) = master.upgrade() else {
            return;
        };
        if let Err(error) = master.check().await {
            tracing::debug!(%error, master = %master.name, "dlock redis: asking the sentinels failed");
        }
    }
}

/// Commands to the master now: a connection that follows the master.
#[derive(Clone)]
pub(crate) struct Following(pub(crate) Arc<Master>);

impl Following {
    fn conn(&self) -> ConnectionManager {
        self.0.current().conn.clone()
    }

    /// `answer`, after asking the sentinels again if its error may mean
    /// the master moved.
    fn seen<T>(&self, answer: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &answer {
            if not_served(e) || e.is_unrecoverable_error() {
                self.0.suspect();
            }
        }
        answer
    }
}

impl ConnectionLike for Following {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let mut conn = self.conn();
        Box::pin(async move {
            let answer = conn.req_packed_command(cmd).await;
            self.seen(answer)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let mut conn = self.conn();
        Box::pin(async move {
            let answer = conn.req_packed_commands(pipeline, offset, count).await;
            self.seen(answer)
        })
    }

    fn get_db(&self) -> i64 {
        self.conn().get_db()
    }
}
