//! `EtcdConfig`: endpoints, key prefix and credentials, from one URL.

use std::time::Duration;

use dlock_core::{
    backend::{BackendUrl, TlsFiles},
    LockError,
};

/// Where and how to connect.
///
/// Usually made by [`EtcdConfig::from_url`] from
/// `etcd://[user:password@]host:port[,host:port...][/prefix]`. The prefix
/// (default `dlock`) starts every key dlock writes.
///
/// # Examples
///
/// ```
/// use dlock_etcd::EtcdConfig;
///
/// let config = EtcdConfig::from_url("etcd://10.0.0.1:2379,10.0.0.2:2379/app/locks")?;
/// assert_eq!(config.endpoints(), ["10.0.0.1:2379", "10.0.0.2:2379"]);
/// assert_eq!(config.prefix(), "app/locks");
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    endpoints: Vec<String>,
    prefix: String,
    user: Option<(String, String)>,
    connect_timeout: Duration,
    request_timeout: Duration,
    /// `Some` for `etcds://`: the PEM files its TLS parameters name.
    tls: Option<TlsFiles>,
    /// `layout=etcdctl`: plain locks where `etcdctl lock` puts its own.
    etcdctl_layout: bool,
}

impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("etcdctl_layout", &self.etcdctl_layout)
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl EtcdConfig {
    /// Parses an `etcd://` URL.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong: another scheme, no
    /// endpoint, an endpoint without a valid port, an empty user name, a
    /// bad percent escape, an unknown query parameter (the error lists the
    /// valid ones) or a malformed duration. Names and values are
    /// percent-decoded ([`BackendUrl`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_etcd::EtcdConfig;
    /// use std::time::Duration;
    ///
    /// let config = EtcdConfig::from_url("etcd://h1:2379,h2:2379/locks?request_timeout=2s")?;
    /// assert_eq!(config.prefix(), "locks");
    /// assert_eq!(config.request_timeout(), Duration::from_secs(2));
    /// assert!(EtcdConfig::from_url("etcd://h1:2379/locks?timeout=2s").is_err());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn from_url(url: &str) -> Result<EtcdConfig, LockError> {
        let mut parts = BackendUrl::parse("etcd", url)?;
        let tls = match parts.scheme() {
            "etcd" => false,
            "etcds" if cfg!(feature = "tls") => true,
            "etcds" => {
                return Err(parts
                    .invalid("TLS (`etcds://`) needs dlock-etcd's `tls` feature (dlock's `tls`)"))
            }
            _ => {
                return Err(parts.invalid(
                    "expected `etcd://host:port[,host:port]/prefix` (or `etcds://` for TLS)",
                ))
            }
        };
        let connect_timeout = parts
            .take_duration("connect_timeout")?
            .unwrap_or(Duration::from_secs(3));
        let request_timeout = parts
            .take_duration("request_timeout")?
            .unwrap_or(Duration::from_secs(5));
        let etcdctl_layout = match parts.take("layout").as_deref() {
            None | Some("dlock") => false,
            Some("etcdctl") => true,
            Some(other) => {
                return Err(
                    parts.invalid(&format!("`layout={other}`: expected `dlock` or `etcdctl`"))
                )
            }
        };
        let files = parts.take_tls_files(tls, "etcds")?;
        parts.finish(&[
            "connect_timeout",
            "request_timeout",
            "tls_ca",
            "tls_cert",
            "tls_key",
            "layout",
        ])?;
        let user = match (parts.user(), parts.password()) {
            (Some(name), password) => Some((name.to_owned(), password.unwrap_or("").to_owned())),
            (None, Some(_)) => return Err(parts.invalid("the user name is empty")),
            (None, None) => None,
        };
        if let Some(host) = parts.hosts().iter().find(|h| h.port.is_none()) {
            return Err(parts.invalid(&format!("`{host}` is not host:port")));
        }
        let scheme = if tls { "https://" } else { "" };
        let prefix = parts.path().trim_end_matches('/');
        Ok(EtcdConfig {
            endpoints: parts
                .hosts()
                .iter()
                .map(|h| format!("{scheme}{h}"))
                .collect(),
            prefix: match prefix {
                "" => "dlock".to_owned(),
                prefix => prefix.to_owned(),
            },
            user,
            connect_timeout,
            request_timeout,
            tls: tls.then_some(files),
            etcdctl_layout,
        })
    }

    /// Whether plain locks use the key layout of `etcdctl lock NAME` and
    /// Go's `concurrency.Mutex` (`layout=etcdctl`), so that dlock and
    /// `etcdctl lock` exclude each other: see the [crate docs](crate).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_etcd::EtcdConfig;
    ///
    /// assert!(EtcdConfig::from_url("etcd://h:2379?layout=etcdctl")?.etcdctl_layout());
    /// assert!(!EtcdConfig::from_url("etcd://h:2379/locks")?.etcdctl_layout());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn etcdctl_layout(&self) -> bool {
        self.etcdctl_layout
    }

    /// Whether the endpoints are reached over TLS (`etcds://`).
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    #[cfg(feature = "tls")]
    pub(crate) fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// The client endpoints, `host:port` each (`https://host:port` over
    /// TLS).
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn user(&self) -> Option<&(String, String)> {
        self.user.as_ref()
    }

    /// How long connecting may take (default 3 s).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How long one request may take (default 5 s).
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Sets how long connecting may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets how long one request may take.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_user_and_never_prints_the_password() {
        let url = "etcd://app%2Done:s3cr%40t%3Ax@a:1/x";
        let c = EtcdConfig::from_url(url).unwrap();
        assert_eq!(
            c.user(),
            Some(&("app-one".to_owned(), "s3cr@t:x".to_owned()))
        );
        assert!(!format!("{c:?}").contains("s3cr"));
        for bad in [
            "etcd://app:s3cr%4@a:1/x",
            "etcd://app:s3cret@a:port/x",
            "etcd://app:s3cret@/x",
        ] {
            let e = EtcdConfig::from_url(bad).unwrap_err();
            for shown in [e.to_string(), format!("{e:?}")] {
                assert!(!shown.contains("s3cr"), "{bad}: {shown}");
            }
        }
    }

    #[test]
    fn decodes_the_prefix_and_values() {
        let c = EtcdConfig::from_url("etcd://a:1/app%20one/locks?request_timeout=1m30s").unwrap();
        assert_eq!(c.prefix(), "app one/locks");
        assert_eq!(c.request_timeout(), Duration::from_secs(90));
        let c = EtcdConfig::from_url("etcd://[::1]:2379").unwrap();
        assert_eq!(c.endpoints(), ["[::1]:2379"]);
    }

    #[test]
    fn parses_endpoints_prefix_and_user() {
        let c = EtcdConfig::from_url("etcd://u:p@a:1,b:2/x/y/").unwrap();
        assert_eq!(c.endpoints(), ["a:1", "b:2"]);
        assert_eq!(c.prefix(), "x/y");
        assert_eq!(c.user(), Some(&("u".to_owned(), "p".to_owned())));
        assert!(
            !format!("{c:?}").contains("\"p\""),
            "the password is not printed"
        );
        assert_eq!(
            EtcdConfig::from_url("etcd://a:1").unwrap().prefix(),
            "dlock"
        );
    }

    #[test]
    fn rejects_malformed_urls() {
        for (url, says) in [
            ("http://a:1", "expected `etcd://"),
            ("etcd://", "a host is missing"),
            ("etcd://a", "is not host:port"),
            ("etcd://a:x", "not a host or host:port"),
            ("etcd://a:1,,b:2", "a host is missing"),
            ("etcd://:pw@a:1", "user name is empty"),
            (
                "etcd://a:1?timeout=2s",
                "unknown parameter `timeout`; the valid ones are `connect_timeout`",
            ),
        ] {
            match EtcdConfig::from_url(url) {
                Err(LockError::InvalidOptions { reason }) => {
                    assert!(reason.to_string().contains(says), "{url}: {reason}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }
}
