//! The backend's side of its sessions (a session itself is
//! [`crate::session`]): connecting, and the live session for a TTL,
//! started anew once the last one ended.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{LockError, Result};
use etcd_client::{Client, ConnectOptions};

use super::{backend_error, EtcdBackend, Inner, NAME};
use crate::{config::EtcdConfig, session::Session};

/// The TLS settings of an `etcds://` URL's files, read now.
///
/// The crypto provider is the application's, if it installed one as the
/// process default; otherwise ring, given to this client only (the
/// transport picks it): dlock sets no process-wide default.
#[cfg(feature = "tls")]
fn tls_options(files: &dlock_core::backend::TlsFiles) -> Result<etcd_client::TlsOptions> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let read = |path: &std::path::PathBuf| dlock_core::backend::TlsFiles::read(path);
    let mut options = TlsOptions::new();
    if let Some(ca) = &files.ca {
        options = options.ca_certificate(Certificate::from_pem(read(ca)?));
    }
    if let (Some(cert), Some(key)) = (&files.cert, &files.key) {
        options = options.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    Ok(options)
}

fn timed_out(what: &str) -> LockError {
    LockError::backend(
        NAME,
        std::io::Error::new(std::io::ErrorKind::TimedOut, what),
    )
}

impl EtcdBackend {
    /// Connects to the endpoints of an `etcd://` URL (see [`EtcdConfig`]).
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a malformed URL;
    /// [`LockError::Backend`] if no endpoint answers within the connect
    /// timeout.
    pub async fn connect(url: &str) -> Result<EtcdBackend> {
        Self::connect_with(EtcdConfig::from_url(url)?).await
    }

    /// Connects with a prepared [`EtcdConfig`].
    ///
    /// # Errors
    ///
    /// As [`connect`](EtcdBackend::connect).
    pub async fn connect_with(config: EtcdConfig) -> Result<EtcdBackend> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout())
            .with_timeout(config.request_timeout())
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            // A member cut off from the leader refuses requests and ends
            // watches, instead of serving a stale view.
            .with_require_leader(true);
        if let Some((user, password)) = config.user() {
            options = options.with_user(user.clone(), password.clone());
        }
        #[cfg(feature = "tls")]
        if let Some(files) = config.tls() {
            options = options.with_tls(tls_options(files)?);
        }
        let connecting = Client::connect(config.endpoints(), Some(options));
        let client = tokio::time::timeout(config.connect_timeout(), connecting)
            .await
            .map_err(|_| timed_out("connect timed out"))?
            .map_err(backend_error)?;
        Self::from_client_with(client, &config).await
    }

    /// A backend on a client the application already has (with its own
    /// endpoints, credentials and TLS), under the key prefix `dlock` and
    /// the default timeouts.
    ///
    /// Every guarantee holds as with [`connect`](EtcdBackend::connect),
    /// which builds its client with `with_require_leader(true)`: a member
    /// cut off from the leader then refuses requests instead of serving a
    /// stale view. Build yours with it too.
    ///
    /// # Errors
    ///
    /// [`LockError::Backend`] if no endpoint answers within the connect
    /// timeout.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use dlock_core::BackendExt;
    /// use dlock_etcd::{etcd_client, EtcdBackend};
    ///
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// let options = etcd_client::ConnectOptions::new().with_require_leader(true);
    /// let client = etcd_client::Client::connect(["127.0.0.1:2379"], Some(options)).await?;
    /// let locker = EtcdBackend::from_client(client).await?.into_locker();
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_client(client: Client) -> Result<EtcdBackend> {
        let config = EtcdConfig::from_url("etcd://127.0.0.1:2379/dlock")?;
        Self::from_client_with(client, &config).await
    }

    /// [`from_client`](EtcdBackend::from_client) with the prefix and the
    /// timeouts of `config` (its endpoints and user are the client's
    /// business).
    ///
    /// # Errors
    ///
    /// As [`from_client`](EtcdBackend::from_client).
    pub async fn from_client_with(mut client: Client, config: &EtcdConfig) -> Result<EtcdBackend> {
        // The channel connects lazily; make sure a server answers now.
        tokio::time::timeout(config.connect_timeout(), client.status())
            .await
            .map_err(|_| timed_out("no endpoint answered"))?
            .map_err(backend_error)?;
        let backend = EtcdBackend {
            inner: Arc::new(Inner {
                client,
                prefix: config.prefix().to_owned(),
                sessions: tokio::sync::Mutex::default(),
                owned: Mutex::default(),
                etcdctl: config.etcdctl_layout(),
                turns: dlock_core::backend::LocalTurns::new(),
                naming: dlock_core::backend::LocalTurns::new(),
                states: dlock_core::backend::ConnectionStates::new(NAME),
                unreachable_after: config.connect_timeout() + config.request_timeout(),
            }),
        };
        let weak = Arc::downgrade(&backend.inner);
        backend.inner.states.probe_while_disconnected(move || {
            let backend = EtcdBackend {
                inner: weak.upgrade()?,
            };
            Some(async move {
                let _ = dlock_core::backend::Backend::check_servers(&backend).await;
            })
        });
        Ok(backend)
    }

    /// The live session for leases of `ttl`, started if needed.
    pub(super) async fn session(&self, ttl: Duration) -> Result<Arc<Session>> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as u64;
        let mut sessions = self.inner.sessions.lock().await;
        if let Some(session) = sessions.get(&secs).filter(|s| s.is_usable()) {
            return Ok(session.clone());
        }
        let session = Session::start(
            &self.inner.client,
            Duration::from_secs(secs),
            &self.inner.states,
        )
        .await
        .map_err(backend_error)?;
        sessions.insert(secs, session.clone());
        Ok(session)
    }
}
