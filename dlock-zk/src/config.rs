//! `ZkConfig`: servers, lock path and session timeout, from one URL.

use std::time::Duration;

use dlock_core::{
    backend::{BackendUrl, TlsFiles},
    LockError,
};

/// Where and how to connect.
///
/// Usually made by [`ZkConfig::from_url`] from
/// `zk://[user:password@]host:port[,host:port...][/path][?session_timeout=10s&connect_timeout=15s&acl=creator&layout=curator]`.
/// The path (default `/dlock`) is where lock nodes live; the session
/// timeout (default 10 s) is how long a crashed holder keeps
/// its locks; the connect timeout (default 15 s) is how long opening a
/// session keeps trying (servers that are down, or an ensemble electing a
/// leader, refuse sessions for a while).
///
/// # Credentials and ACLs
///
/// With `user:password@`, sessions authenticate with the `digest` scheme
/// and every node dlock creates (the lock path's components, each key's
/// parent, each lock node) carries `creator_all` (see the [crate
/// docs](crate)). `acl=creator` asks for that with a
/// [connector](crate::ZkBackend::from_connector) that authenticates
/// itself, `acl=open` keeps nodes open. Nodes that exist already keep their
/// ACLs; the lock path's components that dlock creates are creator-only
/// too, the default `/dlock` included: on an ensemble that applications
/// share, give each its own path (`zk://app:pw@h:2181/app/locks`), or the
/// first one with credentials keeps the others out of it. The password is
/// never printed.
///
/// `layout=curator` names plain locks' nodes as Apache Curator does (see
/// [`ZkConfig::curator_layout`]).
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
#[derive(Clone, PartialEq, Eq)]
pub struct ZkConfig {
    servers: String,
    /// `user` and `password` for the `digest` scheme.
    digest: Option<(String, String)>,
    /// Whether nodes are created `creator_all` rather than open.
    creator_acls: bool,
    /// `layout=curator`: plain locks' nodes named as Curator names them.
    curator_layout: bool,
    /// `Some` for `zks://`: the PEM files its TLS parameters name.
    tls: Option<TlsFiles>,
    path: String,
    session_timeout: Duration,
    connect_timeout: Duration,
}

impl std::fmt::Debug for ZkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkConfig")
            .field("servers", &self.servers)
            .field("user", &self.digest.as_ref().map(|(user, _)| user))
            .field("creator_acls", &self.creator_acls)
            .field("curator_layout", &self.curator_layout)
            .field("tls", &self.tls)
            .field("path", &self.path)
            .field("session_timeout", &self.session_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl ZkConfig {
    /// Parses a `zk://` URL.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong: another scheme,
    /// a password without a user, a user name with `:`, an `acl` other
    /// than `creator` or `open`, a server without a port, a path with an empty, `.` or `..`
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
        let digest = match (parts.user(), parts.password()) {
            (Some(user), _) if user.contains(':') => {
                return Err(parts.invalid("the user name has a `:`, which digest names cannot"))
            }
            (Some(_), None) => {
                return Err(parts.invalid(
                    "a user without a password: digest credentials need both \
                     (`zk://user:password@…`)",
                ))
            }
            (Some(user), Some(password)) => Some((user.to_owned(), password.to_owned())),
            (None, Some(_)) => return Err(parts.invalid("the user name is empty")),
            (None, None) => None,
        };
        let creator_acls = match parts.take("acl").as_deref() {
            None => digest.is_some(),
            Some("creator") => true,
            Some("open") => false,
            Some(other) => {
                return Err(parts.invalid(&format!(
                    "`acl={other}`: expected `creator` (only the authenticated creator) or `open`"
                )))
            }
        };
        let curator_layout = match parts.take("layout").as_deref() {
            None | Some("dlock") => false,
            Some("curator") => true,
            Some(other) => {
                return Err(
                    parts.invalid(&format!("`layout={other}`: expected `dlock` or `curator`"))
                )
            }
        };
        if let Some(host) = parts.hosts().iter().find(|h| h.port.is_none()) {
            return Err(parts.invalid(&format!("`{host}` is not host:port")));
        }
        let servers: Vec<String> = parts.hosts().iter().map(ToString::to_string).collect();
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
            "acl",
            "session_timeout",
            "connect_timeout",
            "tls_ca",
            "tls_cert",
            "tls_key",
            "layout",
        ])?;
        Ok(ZkConfig {
            servers: servers.join(","),
            digest,
            creator_acls,
            curator_layout,
            tls: tls.then_some(files),
            path: format!("/{}", if path.is_empty() { "dlock" } else { &path }),
            session_timeout,
            connect_timeout,
        })
    }

    /// The servers, `host:port,host:port`.
    pub fn servers(&self) -> &str {
        &self.servers
    }

    /// The user sessions authenticate as (`digest` scheme), if the URL
    /// names one.
    pub fn user(&self) -> Option<&str> {
        self.digest.as_ref().map(|(user, _)| user.as_str())
    }

    /// The `digest` scheme's credentials, `user:password`.
    pub(crate) fn digest(&self) -> Option<String> {
        self.digest
            .as_ref()
            .map(|(user, password)| format!("{user}:{password}"))
    }

    /// Whether the nodes dlock creates admit only their authenticated
    /// creator (`creator_all`), rather than anyone.
    pub fn creator_acls(&self) -> bool {
        self.creator_acls
    }

    /// Whether plain locks name their nodes as Apache Curator's
    /// `InterProcessMutex` does (`layout=curator`), so that Curator and
    /// dlock exclude each other: see the [crate docs](crate).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_zk::ZkConfig;
    ///
    /// assert!(ZkConfig::from_url("zk://h:2181/locks?layout=curator")?.curator_layout());
    /// assert!(!ZkConfig::from_url("zk://h:2181/locks")?.curator_layout());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn curator_layout(&self) -> bool {
        self.curator_layout
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
    fn credentials_choose_creator_acls_and_are_never_printed() {
        let c = ZkConfig::from_url("zk://app:s%40cret@a:1/x").unwrap();
        assert_eq!(c.user(), Some("app"));
        assert_eq!(c.digest().as_deref(), Some("app:s@cret"));
        assert!(c.creator_acls());
        let shown = format!("{c:?}");
        assert!(shown.contains("app") && !shown.contains("cret"), "{shown}");
        let open = ZkConfig::from_url("zk://app:pw@a:1?acl=open").unwrap();
        assert!(!open.creator_acls());
        let anonymous = ZkConfig::from_url("zk://a:1").unwrap();
        assert!(!anonymous.creator_acls() && anonymous.user().is_none());
        let connector_auth = ZkConfig::from_url("zk://a:1?acl=creator").unwrap();
        assert!(connector_auth.creator_acls() && connector_auth.digest().is_none());
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
            ("zk://:p@a:1", "user name is empty"),
            ("zk://app@a:1", "without a password"),
            ("zk://u%3Ax:p@a:1", "has a `:`"),
            ("zk://a:1?acl=world", "expected `creator`"),
            ("zk://a:1?layout=go", "expected `dlock` or `curator`"),
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
                "unknown parameter `chroot`; the valid ones are `acl`",
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
