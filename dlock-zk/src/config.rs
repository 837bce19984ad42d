//! `ZkConfig`: servers, lock path and session timeout, from one URL.

use std::time::Duration;

use dlock_core::{
    backend::{BackendUrl, TlsFiles},
    LockError,
};

/// Where and how to connect.
///
/// Usually made by [`ZkConfig::from_url`] from
/// `zk://host:port[,host:port...][/path][?session_timeout=10s&connect_timeout=15s]`.
/// The path (default `/dlock`) is where lock nodes live; the session
/// timeout (default 10 s) is how long a crashed holder keeps
/// its locks; the connect timeout (default 15 s) is how long opening a
/// session keeps trying (servers that are down, or an ensemble electing a
/// leader, refuse sessions for a while).
///
/// # Examples
///
/// ```
/// use dlock_zk::ZkConfig;
/// use std::time::Duration;
///
/// let config = ZkConfig::from_url("zk://a:2181,b:2181/app/locks?session_timeout=4s")?;
/// assert_eq!(config.servers(), "a:2181,b:2181");
/// assert_eq!(config.path(), "/app/locks");
/// assert_eq!(config.session_timeout(), Duration::from_secs(4));
/// assert_eq!(config.connect_timeout(), Duration::from_secs(15));
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZkConfig {
    servers: String,
    /// `Some` for `zks://`: the PEM files its TLS parameters name.
    tls: Option<TlsFiles>,
    path: String,
    session_timeout: Duration,
    connect_timeout: Duration,
}

impl ZkConfig {
    /// Parses a `zk://` URL.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong: another scheme,
    /// a server without a port, a path with an empty, `.` or `..`
    /// component, a bad percent escape, an unknown query parameter (the
    /// error lists the valid ones) or a malformed duration. Names and
    /// values are percent-decoded ([`BackendUrl`]).
    pub fn from_url(url: &str) -> Result<ZkConfig, LockError> {
        let mut parts = BackendUrl::parse("ZooKeeper", url)?;
        let tls = match parts.scheme() {
            "zk" => false,
            "zks" if cfg!(feature = "tls") => true,
            "zks" => {
                return Err(
                    parts.invalid("TLS (`zks://`) needs dlock-zk's `tls` feature (dlock's `tls`)")
                )
            }
            _ => {
                return Err(parts
                    .invalid("expected `zk://host:port[,host:port]/path` (or `zks://` for TLS)"))
            }
        };
        if parts.user().is_some() || parts.password().is_some() {
            return Err(
                parts.invalid("a user or password: ZooKeeper authentication is not offered yet")
            );
        }
        let mut servers = Vec::new();
        for host in parts.hosts() {
            if host.port.is_none() {
                return Err(parts.invalid(&format!("`{host}` is not host:port")));
            }
            servers.push(host.to_string());
        }
        let path = parts.path().trim_end_matches('/').to_owned();
        if path.split('/').any(str::is_empty) && !path.is_empty() {
            return Err(parts.invalid("the path has an empty component"));
        }
        let session_timeout = parts
            .take_duration("session_timeout")?
            .unwrap_or(Duration::from_secs(10));
        let connect_timeout = parts
            .take_duration("connect_timeout")?
            .unwrap_or(Duration::from_secs(15));
        let files = parts.take_tls_files(tls, "zks")?;
        parts.finish(&[
            "session_timeout",
            "connect_timeout",
            "tls_ca",
            "tls_cert",
            "tls_key",
        ])?;
        Ok(ZkConfig {
            servers: servers.join(","),
            tls: tls.then_some(files),
            path: if path.is_empty() {
                "/dlock".to_owned()
            } else {
                format!("/{path}")
            },
            session_timeout,
            connect_timeout,
        })
    }

    /// The servers, `host:port,host:port`.
    pub fn servers(&self) -> &str {
        &self.servers
    }

    /// Whether the servers are reached over TLS (`zks://`).
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The connect string: the servers, marked `tcp+tls://` over TLS.
    pub(crate) fn connect_string(&self) -> String {
        if self.is_tls() {
            format!("tcp+tls://{}", self.servers)
        } else {
            self.servers.clone()
        }
    }

    #[cfg(feature = "tls")]
    pub(crate) fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// The path lock nodes live under.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The session timeout asked of the servers.
    pub fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    /// How long opening a session keeps trying before it fails.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_urls() {
        let plain = ZkConfig::from_url("zk://a:1/x?tls_ca=ca.pem").unwrap_err();
        assert!(plain.to_string().contains("needs `zks://`"));
        let tls = ZkConfig::from_url("zks://a:1,b:2/x?tls_ca=ca.pem");
        if cfg!(feature = "tls") {
            let tls = tls.unwrap();
            assert!(tls.is_tls());
            assert_eq!(tls.connect_string(), "tcp+tls://a:1,b:2");
            let half = ZkConfig::from_url("zks://a:1/x?tls_key=k.pem").unwrap_err();
            assert!(half.to_string().contains("both `tls_cert` and `tls_key`"));
        } else {
            assert!(tls.unwrap_err().to_string().contains("`tls` feature"));
        }
    }

    #[test]
    fn defaults_and_parameters() {
        let c = ZkConfig::from_url("zk://a:1").unwrap();
        assert_eq!(
            (c.servers(), c.path(), c.session_timeout()),
            ("a:1", "/dlock", Duration::from_secs(10))
        );
        assert_eq!(c.connect_timeout(), Duration::from_secs(15));
        let c = ZkConfig::from_url("zk://a:1,b:2/x?session_timeout=750ms").unwrap();
        assert_eq!(
            (c.path(), c.session_timeout()),
            ("/x", Duration::from_millis(750))
        );
        let c = ZkConfig::from_url("zk://a:1/app%20one?session_timeout=1m30s").unwrap();
        assert_eq!(
            (c.path(), c.session_timeout()),
            ("/app one", Duration::from_secs(90))
        );
        let c = ZkConfig::from_url("zk://a:1?connect_timeout=2s&session_timeout=3s").unwrap();
        assert_eq!(
            (c.connect_timeout(), c.session_timeout()),
            (Duration::from_secs(2), Duration::from_secs(3))
        );
    }

    #[test]
    fn rejects_malformed_urls() {
        for (url, says) in [
            ("redis://a:1", "expected `zk://"),
            ("zk://a", "not host:port"),
            ("zk://a:1,", "a host is missing"),
            ("zk://a:1/x//y", "empty"),
            ("zk://a:1/x/..", "`..`"),
            ("zk://u:p@a:1", "authentication is not offered"),
            ("zk://a:1?session_timeout=soon", "malformed duration"),
            ("zk://a:1?session_timeout=0s", "out of range"),
            (
                "zk://a:1?session_timeout=18446744073709551615s",
                "out of range",
            ),
            (
                "zk://a:1?session_timeout=99999999999999999999s",
                "too large",
            ),
            ("zk://a:1?connect_timeout=2h", "out of range"),
            (
                "zk://a:1?chroot=x",
                "unknown parameter `chroot`; the valid ones are `session_timeout`",
            ),
        ] {
            match ZkConfig::from_url(url) {
                Err(LockError::InvalidOptions { reason }) => {
                    assert!(reason.to_string().contains(says), "{url}: {reason}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }
}
