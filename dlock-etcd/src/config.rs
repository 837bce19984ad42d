//! `EtcdConfig`: endpoints, key prefix and credentials, from one URL.

use std::time::Duration;

use dlock_core::{backend::TlsFiles, LockError};

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
}

impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

fn invalid(url: &str, why: &str) -> LockError {
    LockError::InvalidOptions {
        reason: format!(
            "bad etcd URL `{}`: {why}",
            dlock_core::backend::redact_url(url)
        ),
    }
}

impl EtcdConfig {
    /// Parses an `etcd://` URL.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong: another scheme, no
    /// endpoint, an endpoint without a valid port, an empty user name, an
    /// unknown query parameter or a malformed duration.
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
        let (tls, rest) = match (url.strip_prefix("etcd://"), url.strip_prefix("etcds://")) {
            (Some(rest), _) => (false, rest),
            (_, Some(rest)) if cfg!(feature = "tls") => (true, rest),
            (_, Some(_)) => {
                return Err(invalid(
                    url,
                    "TLS (`etcds://`) needs dlock-etcd's `tls` feature (dlock's `tls`)",
                ))
            }
            _ => {
                return Err(invalid(
                    url,
                    "expected `etcd://host:port[,host:port]/prefix` (or `etcds://` for TLS)",
                ))
            }
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut connect_timeout = Duration::from_secs(3);
        let mut request_timeout = Duration::from_secs(5);
        let mut files = TlsFiles::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let setting = match pair.split_once('=') {
                Some(("connect_timeout", value)) => (&mut connect_timeout, value),
                Some(("request_timeout", value)) => (&mut request_timeout, value),
                Some((name, value)) if files.take(name, value) => {
                    if !tls {
                        return Err(invalid(
                            url,
                            &format!("`{name}` is for TLS, which needs `etcds://`"),
                        ));
                    }
                    continue;
                }
                _ => {
                    return Err(invalid(
                        url,
                        &format!(
                            "unknown parameter `{pair}`; expected `connect_timeout=3s`, \
                             `request_timeout=5s`, or (TLS) `tls_ca=path`, `tls_cert=path` \
                             and `tls_key=path`"
                        ),
                    ))
                }
            };
            *setting.0 = dlock_core::backend::parse_url_duration(setting.1)
                .map_err(|why| invalid(url, &format!("`{pair}`: {why}")))?;
        }
        let (authority, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i + 1..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (user, hosts) = match authority.rfind('@') {
            Some(i) => {
                let (name, password) = authority[..i]
                    .split_once(':')
                    .unwrap_or((&authority[..i], ""));
                if name.is_empty() {
                    return Err(invalid(url, "the user name is empty"));
                }
                let decode = |part: &str, what: &str| {
                    dlock_core::backend::percent_decode(part)
                        .map_err(|why| invalid(url, &format!("the {what} has {why}")))
                };
                (
                    Some((decode(name, "user name")?, decode(password, "password")?)),
                    &authority[i + 1..],
                )
            }
            None => (None, authority),
        };
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let port = host.rsplit_once(':').map(|(_, p)| p);
            if host.is_empty() || port.is_none_or(|p| p.parse::<u16>().is_err()) {
                return Err(invalid(url, &format!("`{host}` is not host:port")));
            }
            endpoints.push(if tls {
                format!("https://{host}")
            } else {
                host.to_owned()
            });
        }
        files.check().map_err(|why| invalid(url, &why))?;
        Ok(EtcdConfig {
            endpoints,
            prefix: if prefix.is_empty() {
                "dlock".to_owned()
            } else {
                prefix.to_owned()
            },
            user,
            connect_timeout,
            request_timeout,
            tls: tls.then_some(files),
        })
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
            ("etcd://", "is not host:port"),
            ("etcd://a", "is not host:port"),
            ("etcd://a:x", "is not host:port"),
            ("etcd://a:1,,b:2", "is not host:port"),
            ("etcd://:pw@a:1", "user name is empty"),
        ] {
            match EtcdConfig::from_url(url) {
                Err(LockError::InvalidOptions { reason }) => {
                    assert!(reason.contains(says), "{url}: {reason}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }
}
