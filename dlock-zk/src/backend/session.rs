//! The backend's side of its session (the session itself is
//! [`crate::session`]): connecting, a new session once the last one
//! expired, and the watch that loses a guard whose node is deleted behind
//! its holder's back.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{
    backend::{Backoff, ConnectionStates, LeaseTimers},
    LockError, Result, Token,
};
use tokio::time::Instant;
#[cfg(feature = "tls")]
use zookeeper_client::Client;
use zookeeper_client::{Connector, CreateMode, Error as ZkError, EventType};

use super::{backend_error, Inner, ZkBackend, NAME};
use crate::{config::ZkConfig, session::Session};

/// Opens a session, trying again while the servers refuse one (down, or
/// electing a leader: the client gives up on an attempt after a session
/// timeout) until the connect timeout has passed.
async fn open_session(
    config: &ZkConfig,
    connector: Option<&Connector>,
    states: &ConnectionStates,
) -> Result<Arc<Session>> {
    let deadline = Instant::now() + config.connect_timeout();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    let servers = config.connect_string();
    loop {
        let attempt = Session::start(connector, &servers, config.session_timeout(), states);
        let error = match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(session)) => return Ok(session),
            Ok(Err(e @ (ZkError::Timeout | ZkError::ConnectionLoss | ZkError::NoHosts))) => e,
            Ok(Err(e)) => return Err(backend_error(e)),
            Err(_) => {
                return Err(LockError::backend(
                    NAME,
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no session established within the connect timeout ({:?})",
                            config.connect_timeout()
                        ),
                    ),
                ))
            }
        };
        let delay = backoff.next_delay();
        if Instant::now() + delay >= deadline {
            return Err(backend_error(error));
        }
        tracing::debug!(%error, ?delay, "no ZooKeeper session yet; trying again");
        tokio::time::sleep(delay).await;
    }
}

/// The TLS settings of a `zks://` URL's files, read now.
///
/// The crypto provider is the application's if it installed one as the
/// process default; otherwise ring, installed as the default, because
/// zookeeper-client builds its TLS configuration from the process default
/// only and cannot be handed a provider (rustls cannot pick one itself when
/// the build has more than one). An application that wants aws-lc-rs
/// installs it before connecting.
#[cfg(feature = "tls")]
fn tls_options(files: &dlock_core::backend::TlsFiles) -> Result<zookeeper_client::TlsOptions> {
    use dlock_core::backend::TlsFiles;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let read = |path: &std::path::PathBuf| {
        TlsFiles::read(path).map(|pem| String::from_utf8_lossy(&pem).into_owned())
    };
    let bad = |e: zookeeper_client::Error| -> LockError {
        dlock_core::InvalidReason::TlsFile {
            path: None,
            problem: e.to_string(),
        }
        .into()
    };
    let mut options = zookeeper_client::TlsOptions::new();
    if let Some(ca) = &files.ca {
        options = options.with_pem_ca(&read(ca)?).map_err(bad)?;
    }
    if let (Some(cert), Some(key)) = (&files.cert, &files.key) {
        options = options
            .with_pem_identity(&read(cert)?, &read(key)?)
            .map_err(bad)?;
    }
    Ok(options)
}

/// How long a lock is held before its node is watched: a lock released
/// sooner costs no watch (the common lock-and-release stays at three
/// packets), and a node deleted behind its holder's back meanwhile is
/// found gone when the watch is set.
pub(super) const WATCH_AFTER: Duration = Duration::from_millis(100);

/// Tells the guard of `token` its lock is lost once its node at `path` is
/// deleted by anyone but us (an operator's `delete`, a forced unlock):
/// another client may hold the key from then on. Within [`WATCH_AFTER`]
/// and a round trip of the delete. Our own deletes (release, a fixed
/// lease's end) stop tracking the lock first, which ends this. Ends with
/// the node, or with the session.
pub(super) fn watch_our_node(session: &Arc<Session>, token: Token, path: String) {
    let session = Arc::downgrade(session);
    tokio::spawn(async move {
        tokio::time::sleep(WATCH_AFTER).await;
        // Made at the first failure: most watches never need one, and the
        // task of every held lock would carry one.
        let mut backoff: Option<Box<Backoff>> = None;
        loop {
            let Some(client) = session
                .upgrade()
                .filter(|s| s.holders.holds(&token))
                .and_then(|s| s.client().ok())
            else {
                return;
            };
            let watched = client.check_and_watch_stat(&path).await;
            drop(client);
            let watcher = match watched {
                Ok((Some(_), watcher)) => watcher,
                Ok((None, _)) => break,
                // The session ended, and the lock with it: its guards
                // were told.
                Err(ZkError::SessionExpired | ZkError::SessionMoved | ZkError::ClientClosed) => {
                    return
                }
                // Cut off for now: the session's own clock loses the lock
                // if it stays so; look again.
                Err(_) => {
                    let delay = backoff
                        .get_or_insert_with(|| {
                            Box::new(Backoff::new(
                                Duration::from_millis(50),
                                Duration::from_secs(1),
                            ))
                        })
                        .next_delay();
                    tokio::time::sleep(delay).await;
                    continue;
                }
            };
            backoff = None;
            match watcher.changed().await.event_type {
                EventType::NodeDeleted => break,
                // A terminal session state: the session's monitor tells.
                EventType::Session => return,
                // A proclaim set the data: watch again.
                _ => {}
            }
        }
        if let Some(session) = session.upgrade() {
            session.forget(&token);
        }
    });
}

impl ZkBackend {
    /// Connects to the servers of a `zk://` URL (see [`ZkConfig`]).
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a malformed URL;
    /// [`LockError::Backend`] if no session can be established within the
    /// connect timeout (15 s unless the URL says otherwise).
    pub async fn connect(url: &str) -> Result<ZkBackend> {
        Self::connect_with(ZkConfig::from_url(url)?).await
    }

    /// Connects with a prepared [`ZkConfig`].
    ///
    /// # Errors
    ///
    /// As [`connect`](ZkBackend::connect).
    pub async fn connect_with(config: ZkConfig) -> Result<ZkBackend> {
        Self::open(config, None).await
    }

    /// Connects with the application's own [`Connector`]: every session
    /// dlock opens (the first, and a new one after a session expired)
    /// comes from a clone of it, with its TLS, authentication and other
    /// settings, and the servers and lock path of `config`; the same
    /// guarantees as [`ZkBackend::connect`].
    ///
    /// Not a `Client`: a lock lives exactly as long as the session that
    /// holds it, and after that session expires dlock must open a new
    /// one, which a client of an ended session cannot. dlock sets the
    /// connector's session and connection timeouts to `config`'s session
    /// timeout. Nodes are created open to anyone unless `config` says
    /// `acl=creator`: dlock cannot see whether the connector
    /// authenticates (see [`ZkConfig`]'s "Credentials and ACLs"). A connector that resumes a session (`with_session`) is not
    /// for dlock: two backends would share one session's locks.
    ///
    /// # Errors
    ///
    /// As [`ZkBackend::connect`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use dlock_core::BackendExt;
    /// use dlock_zk::{zookeeper_client::Client, ZkBackend, ZkConfig};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let connector = Client::connector().with_auth("digest", b"app:secret");
    /// // Nodes only sessions authenticated as `app` may touch.
    /// let config = ZkConfig::from_url("zk://127.0.0.1:2181/app/locks?acl=creator")?;
    /// let locker = ZkBackend::from_connector(connector, config)
    ///     .await?
    ///     .into_locker();
    /// drop(locker.lock("report:daily").await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_connector(connector: Connector, config: ZkConfig) -> Result<ZkBackend> {
        Self::open(config, Some(connector)).await
    }

    async fn open(config: ZkConfig, connector: Option<Connector>) -> Result<ZkBackend> {
        let connector = match config.digest() {
            Some(digest) => Some(
                connector
                    .unwrap_or_else(zookeeper_client::Client::connector)
                    .with_auth("digest", digest.as_bytes()),
            ),
            None if config.creator_acls() && connector.is_none() => {
                return Err(LockError::InvalidOptions {
                    reason: dlock_core::InvalidReason::Other(
                        "`acl=creator` needs credentials: `zk://user:password@…`, or a \
                         connector that authenticates (`ZkBackend::from_connector`)"
                            .to_owned(),
                    ),
                })
            }
            None => connector,
        };
        #[cfg(feature = "tls")]
        let connector = match config.tls() {
            Some(files) => Some(
                connector
                    .unwrap_or_else(Client::connector)
                    .with_tls(tls_options(files)?),
            ),
            None => connector,
        };
        let backend = ZkBackend {
            inner: Arc::new_cyclic(|inner: &std::sync::Weak<Inner>| {
                let inner = inner.clone();
                Inner {
                    config,
                    connector,
                    states: ConnectionStates::new(NAME),
                    session: tokio::sync::Mutex::default(),
                    owned: Mutex::default(),
                    lease_ends: LeaseTimers::new(move |token| {
                        // A lease ended: delete the node if it is still
                        // ours (a release may have raced the timer).
                        if let Some(inner) = inner.upgrade() {
                            let backend = ZkBackend { inner };
                            tokio::spawn(async move {
                                if backend.owned().contains_key(&token) {
                                    let _ = backend.delete_owned(&token, false).await;
                                }
                            });
                        }
                    }),
                }
            }),
        };
        let session = backend.session().await?;
        // The lock path's own components are ordinary nodes.
        let mut path = String::new();
        for component in backend.inner.config.path().split('/').skip(1) {
            path.push('/');
            path.push_str(component);
            let options = CreateMode::Persistent.with_acls(backend.acls());
            let client = session.client().map_err(backend_error)?;
            match client.create(&path, b"", &options).await {
                Ok(_) | Err(ZkError::NodeExists) => {}
                Err(e) => return Err(backend_error(e)),
            }
        }
        let weak = Arc::downgrade(&backend.inner);
        backend.inner.states.probe_while_disconnected(move || {
            let backend = ZkBackend {
                inner: weak.upgrade()?,
            };
            Some(async move {
                let _ = dlock_core::backend::Backend::check_servers(&backend).await;
            })
        });
        Ok(backend)
    }

    /// The live session, opened anew after the last one expired.
    pub(super) async fn session(&self) -> Result<Arc<Session>> {
        let mut current = self.inner.session.lock().await;
        if let Some(session) = current.as_ref().filter(|s| s.is_usable()) {
            return Ok(session.clone());
        }
        let session = open_session(
            &self.inner.config,
            self.inner.connector.as_ref(),
            &self.inner.states,
        )
        .await?;
        *current = Some(session.clone());
        Ok(session)
    }
}
