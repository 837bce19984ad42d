//! Following the master of a Sentinel deployment: the sentinels name it,
//! and a failover names another. Commands go to the master named last; an
//! error that a failover explains (the connection refused or dropped, a
//! `READONLY` reply from a demoted master), and a check every second, ask
//! the sentinels again. A new master gets a new connection, and the
//! subscriber follows it (see [`Master::changes`]).

use std::{
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use redis::{
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
    sentinel::SentinelClient,
    Client, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};
use tokio::{sync::watch, time::Instant};

use crate::scripts::scripts;

/// How often the sentinels are asked, without an error to prompt it.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The least time between two refreshes prompted by errors.
const REFRESH_GAP: Duration = Duration::from_millis(100);

/// The master now: its address, and a connection to it.
struct Current {
    addr: String,
    client: Client,
    conn: ConnectionManager,
}

/// The master of one Sentinel deployment, as its sentinels name it.
pub(crate) struct Master {
    sentinel: tokio::sync::Mutex<SentinelClient>,
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

/// Whether `e` may mean the master moved: the connection failed, or a
/// demoted master refuses writes.
fn may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_unrecoverable_error()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
}

impl Master {
    /// Asks the sentinels for the master and connects to it (its scripts
    /// loaded), within `connect_timeout`; then checks every second.
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
        if let Err(error) = scripts(false).load(&mut conn).await {
            tracing::debug!(%error, "dlock redis could not preload its scripts");
        }
        crate::node::warn_if_evicting(&mut conn, &client).await;
        let master = Arc::new(Master {
            sentinel: tokio::sync::Mutex::new(sentinel),
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

    /// The master's address now.
    pub(crate) fn addr(&self) -> String {
        self.current().addr.clone()
    }

    /// Changes each time a new master is followed.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Asks the sentinels again, soon, unless a refresh started within
    /// [`REFRESH_GAP`].
    fn suspect(self: &Arc<Self>) {
        {
            let mut refreshed = self.refreshed.lock().unwrap_or_else(|e| e.into_inner());
            if refreshed.elapsed() < REFRESH_GAP {
                return;
            }
            *refreshed = Instant::now();
        }
        let master = self.clone();
        tokio::spawn(async move {
            if let Err(error) = master.refresh().await {
                tracing::debug!(%error, master = %master.name, "dlock redis: asking the sentinels failed");
            }
        });
    }

    /// Asks the sentinels which server is master (and that server whether
    /// it is); follows it if it is another one.
    async fn refresh(&self) -> RedisResult<()> {
        let client = {
            let mut sentinel = self.sentinel.lock().await;
            tokio::time::timeout(self.connect_timeout, sentinel.async_get_client())
                .await
                .map_err(|_| timed_out())??
        };
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
}

/// Asks the sentinels every [`CHECK_EVERY`] while the master is followed.
async fn check(master: Weak<Master>) {
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        let Some(master) = master.upgrade() else {
            return;
        };
        *master.refreshed.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        if let Err(error) = master.refresh().await {
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
            if may_have_moved(e) {
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
