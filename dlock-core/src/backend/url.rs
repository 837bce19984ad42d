//! URL helpers every backend's `from_url` shares: one parser
//! ([`BackendUrl`]) with one rule for unknown parameters, passwords kept out
//! of what is printed, and percent-decoding wherever a URL may encode.

use std::{borrow::Cow, fmt, time::Duration};

use crate::LockError;

/// One host of a URL's host list: `host`, `host:port`, `[v6]` or
/// `[v6]:port`.
///
/// Its `Display` is the host as written, with the port if one was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// The host name or address (an IPv6 address in brackets).
    pub host: String,
    /// The port, if the URL names one.
    pub port: Option<u16>,
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(port) => write!(f, "{}:{port}", self.host),
            None => f.write_str(&self.host),
        }
    }
}

/// A backend URL, split once by the rules every backend shares:
/// `scheme://[user[:password]@]host[:port][,host[:port]…][/path][?name=value&…]`.
///
/// - The user name, the password, the path and the query's names and values
///   are percent-decoded (the query as a form: `+` is a space), by the
///   [`url`] crate.
/// - Each host is checked by the same crate (IPv6 in brackets included).
/// - A parameter named twice, or a fragment (`#…`), is an error.
/// - The backend [takes](BackendUrl::take) the parameters it knows, then
///   [`finish`](BackendUrl::finish) refuses any left over, listing the
///   valid ones: a misspelt option is never silently ignored.
/// - Every error shows the URL with its password replaced by `***`.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::BackendUrl;
/// use std::time::Duration;
///
/// let mut url = BackendUrl::parse("etcd", "etcd://app:p%40ss@h1:2379,[::1]:2379/locks?request_timeout=1m30s")?;
/// assert_eq!(url.scheme(), "etcd");
/// assert_eq!((url.user(), url.password()), (Some("app"), Some("p@ss")));
/// assert_eq!(url.hosts()[1].to_string(), "[::1]:2379");
/// assert_eq!(url.path(), "locks");
/// assert_eq!(url.take_duration("request_timeout")?, Some(Duration::from_secs(90)));
/// url.finish(&["request_timeout"])?;
///
/// let mut typo = BackendUrl::parse("etcd", "etcd://h:1?request_timout=2s")?;
/// let err = typo.finish(&["connect_timeout", "request_timeout"]).unwrap_err();
/// assert!(err.to_string().contains("unknown parameter `request_timout`"));
/// assert!(err.to_string().contains("`connect_timeout`, `request_timeout`"));
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Clone)]
pub struct BackendUrl {
    backend: &'static str,
    shown: String,
    scheme: String,
    base: String,
    userinfo: Option<String>,
    user: Option<String>,
    password: Option<String>,
    hosts: Vec<HostPort>,
    path: String,
    params: Vec<(String, String)>,
}

impl fmt::Debug for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendUrl")
            .field("url", &self.shown)
            .finish_non_exhaustive()
    }
}

impl BackendUrl {
    /// Splits `url`, for the backend named `backend` (which errors name).
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] when there is no `scheme://`, no host,
    /// a malformed host, port or percent escape, a parameter named twice,
    /// or a fragment.
    pub fn parse(backend: &'static str, url: &str) -> Result<BackendUrl, LockError> {
        Self::parse_inner(backend, url, true)
    }

    /// As [`parse`](BackendUrl::parse), but a URL without a host
    /// (`postgres:///db?host=/run/postgresql`) is accepted, with no
    /// [`hosts`](BackendUrl::hosts): for drivers with a default host or a
    /// socket parameter.
    ///
    /// # Errors
    ///
    /// As [`parse`](BackendUrl::parse)'s, but for the missing host.
    pub fn parse_host_optional(backend: &'static str, url: &str) -> Result<BackendUrl, LockError> {
        Self::parse_inner(backend, url, false)
    }

    fn parse_inner(
        backend: &'static str,
        url: &str,
        host_needed: bool,
    ) -> Result<BackendUrl, LockError> {
        let shown = redact_url(url).into_owned();
        let bad = |why: String| invalid_url(backend, &shown, &why);
        let (scheme, rest) = url
            .split_once("://")
            .filter(|(scheme, _)| !scheme.is_empty())
            .ok_or_else(|| bad("expected `scheme://host…`".to_owned()))?;
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, host_list) = match authority.rfind('@') {
            Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
            None => (None, authority),
        };
        let decode = |part: &str, what: &str| {
            percent_decode(part).map_err(|why| bad(format!("the {what} has {why}")))
        };
        let (user, password) = match userinfo.map(|u| u.split_once(':').unwrap_or((u, ""))) {
            Some((user, password)) => (
                Some(decode(user, "user name")?).filter(|u| !u.is_empty()),
                Some(decode(password, "password")?).filter(|p| !p.is_empty()),
            ),
            None => (None, None),
        };
        let mut hosts = Vec::new();
        for host in host_list
            .split(',')
            .filter(|h| host_needed || !host_list.is_empty() || !h.is_empty())
        {
            match parse_host(host) {
                Ok(host) => hosts.push(host),
                // `redis://u:pa/ss@h`: the host list is the user info cut
                // short; naming it would show part of the password.
                Err(_) if userinfo.is_none() && tail.contains('@') => {
                    return Err(bad("the user info holds a `/`, `?` or `#`: write them \
                                    `%2F`, `%3F` and `%23`"
                        .to_owned()))
                }
                Err(why) => return Err(bad(why)),
            }
        }
        // The URL crate would resolve `.` and `..` in the path silently.
        let raw_path = &tail[..tail.find(['?', '#']).unwrap_or(tail.len())];
        let dots = |segment: &str| {
            let segment = segment.to_ascii_lowercase().replace("%2e", ".");
            segment == "." || segment == ".."
        };
        if raw_path.split('/').any(dots) {
            return Err(bad("the path has a `.` or `..` component".to_owned()));
        }
        // The path and the query, decoded by the URL crate on a stand-in
        // host (the host list, which it cannot read, is checked above).
        let tail_url = url::Url::parse(&format!("dlock://host{tail}"))
            .map_err(|e| bad(format!("the path or query is malformed: {e}")))?;
        if tail_url.fragment().is_some() {
            return Err(bad(
                "a fragment (`#…`) means nothing here; a `#` in a password is written `%23`"
                    .to_owned(),
            ));
        }
        let path = percent_decode(tail_url.path().trim_start_matches('/'))
            .map_err(|why| bad(format!("the path has {why}")))?;
        let mut params: Vec<(String, String)> = Vec::new();
        for (name, value) in tail_url.query_pairs() {
            if params.iter().any(|(seen, _)| *seen == name) {
                return Err(bad(format!("the parameter `{name}` is given twice")));
            }
            params.push((name.into_owned(), value.into_owned()));
        }
        let base_end = url.len() - tail.len() + tail.find(['?', '#']).unwrap_or(tail.len());
        Ok(BackendUrl {
            backend,
            shown,
            scheme: scheme.to_owned(),
            base: url[..base_end].to_owned(),
            userinfo: userinfo.map(str::to_owned),
            user,
            password,
            hosts,
            path,
            params,
        })
    }

    /// The scheme, as written: `redis`, `etcds`, `redis+cluster`…
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The decoded user name, if the URL has one.
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The decoded password, if the URL has one.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The hosts, in the URL's order.
    pub fn hosts(&self) -> &[HostPort] {
        &self.hosts
    }

    /// The decoded path, without its leading `/` (empty if none).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The URL up to its query, as written (password included): for a
    /// driver that reads the rest itself.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The user info as written, still percent-encoded (`user:pass`), for
    /// a driver URL built from the parts.
    pub fn userinfo(&self) -> Option<&str> {
        self.userinfo.as_deref()
    }

    /// Takes the parameter `name`'s decoded value, if the URL has it.
    pub fn take(&mut self, name: &str) -> Option<String> {
        let at = self.params.iter().position(|(n, _)| n == name)?;
        Some(self.params.remove(at).1)
    }

    /// Takes the parameter `name` as a duration, in the grammar of
    /// [`parse_url_duration`].
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] if the value is not one.
    pub fn take_duration(&mut self, name: &str) -> Result<Option<Duration>, LockError> {
        self.take(name)
            .map(|value| {
                parse_url_duration(&value).map_err(|why| self.invalid(&format!("`{name}`: {why}")))
            })
            .transpose()
    }

    /// Takes `tls_ca`, `tls_cert` and `tls_key` ([`TlsFiles`]). Given a
    /// URL whose scheme is not a TLS one (`tls` false), any of them is an
    /// error that names `tls_scheme`, the scheme to use instead.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a TLS file on a plain URL, or a
    /// client certificate without its key (or the other way round).
    pub fn take_tls_files(&mut self, tls: bool, tls_scheme: &str) -> Result<TlsFiles, LockError> {
        let mut files = TlsFiles::default();
        for name in TlsFiles::PARAMS {
            if let Some(value) = self.take(name) {
                if !tls {
                    return Err(self.invalid(&format!(
                        "`{name}` is for TLS, which needs `{tls_scheme}://`"
                    )));
                }
                if !files.take(name, &value) {
                    return Err(self.invalid(&format!("`{name}` needs a path")));
                }
            }
        }
        files.check().map_err(|why| self.invalid(&why))?;
        Ok(files)
    }

    /// The URL for a driver that reads the rest itself:
    /// [`base`](BackendUrl::base) and the parameters not taken, re-encoded.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a parameter neither taken nor one
    /// of `driver`'s, listing `ours` and `driver`: a misspelt driver
    /// option (`sslmod=require`) is refused, not passed on to be ignored.
    pub fn driver_url(&self, ours: &[&str], driver: &[&str]) -> Result<String, LockError> {
        if let Some((name, _)) = self
            .params
            .iter()
            .find(|(n, _)| !driver.contains(&n.as_str()))
        {
            let valid: Vec<&str> = ours.iter().chain(driver).copied().collect();
            return Err(self.unknown_parameter(name, &valid));
        }
        if self.params.is_empty() {
            return Ok(self.base.clone());
        }
        let query = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(&self.params)
            .finish();
        Ok(format!("{}?{query}", self.base))
    }

    /// The parameters not taken, decoded, in the URL's order.
    pub fn remaining(&self) -> impl Iterator<Item = (&str, &str)> {
        self.params.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// Checks that every parameter was taken.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming the first unknown parameter and
    /// listing `valid`, the parameters this backend reads.
    pub fn finish(&mut self, valid: &[&str]) -> Result<(), LockError> {
        match self.params.first() {
            None => Ok(()),
            Some((name, _)) => Err(self.unknown_parameter(name, valid)),
        }
    }

    fn unknown_parameter(&self, name: &str, valid: &[&str]) -> LockError {
        crate::InvalidReason::UnknownParameter {
            backend: self.backend,
            url: self.shown.clone(),
            name: name.to_owned(),
            valid: valid.iter().map(|v| (*v).to_owned()).collect(),
        }
        .into()
    }

    /// A [`LockError::InvalidOptions`] for this URL (password redacted):
    /// `bad {backend} URL `…`: {why}`.
    pub fn invalid(&self, why: &str) -> LockError {
        invalid_url(self.backend, &self.shown, why)
    }
}

fn invalid_url(backend: &'static str, shown: &str, why: &str) -> LockError {
    crate::InvalidReason::Url {
        backend,
        url: shown.to_owned(),
        problem: why.to_owned(),
    }
    .into()
}

/// One host of a host list, checked by the URL crate.
fn parse_host(host: &str) -> Result<HostPort, String> {
    if host.is_empty() {
        return Err("a host is missing".to_owned());
    }
    let bad = || format!("`{host}` is not a host or host:port");
    // A scheme the URL crate does not know keeps ports as written and
    // reads bracketed IPv6 addresses.
    let parsed = url::Url::parse(&format!("dlock://{host}")).map_err(|_| bad())?;
    let name = parsed
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(bad)?;
    if parsed.path() != "" || !parsed.username().is_empty() {
        return Err(bad());
    }
    if host.ends_with(':') {
        return Err(bad());
    }
    Ok(HostPort {
        host: name.to_owned(),
        port: parsed.port(),
    })
}

/// A duration in a URL's query (`session_timeout=10s`), in the grammar of
/// [`parse_duration`](crate::parse_duration), above zero and at most an
/// hour; otherwise a message saying what to write instead.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::parse_url_duration;
/// use std::time::Duration;
///
/// assert_eq!(parse_url_duration("750ms"), Ok(Duration::from_millis(750)));
/// assert_eq!(parse_url_duration("10s"), Ok(Duration::from_secs(10)));
/// assert_eq!(parse_url_duration("2m"), Ok(Duration::from_secs(120)));
/// assert!(parse_url_duration("0s").unwrap_err().contains("above zero"));
/// assert!(parse_url_duration("10").unwrap_err().contains("malformed duration"));
/// ```
pub fn parse_url_duration(text: &str) -> Result<Duration, String> {
    let duration = crate::duration::parse(text)?;
    // Timeouts beyond an hour are no sane setting.
    if duration.is_zero() || duration > Duration::from_secs(3600) {
        return Err(format!(
            "duration `{text}` is out of range: above zero and at most 1h"
        ));
    }
    Ok(duration)
}

/// `url` with the password of its user info, and the value of every query
/// parameter whose name holds `password` (`sentinel_password=`,
/// `password=`, `sslpassword=`), replaced by `***`, for errors, `Debug`
/// output and traces. A URL without a password is returned as it is.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::redact_url;
///
/// assert_eq!(redact_url("redis://app:s3cr%40t@db:6379/0"), "redis://app:***@db:6379/0");
/// assert_eq!(redact_url("redis://:pw@a:1,b:2,c:3"), "redis://:***@a:1,b:2,c:3");
/// assert_eq!(redact_url("etcd://10.0.0.1:2379/locks"), "etcd://10.0.0.1:2379/locks");
/// assert_eq!(
///     redact_url("redis+sentinel://s:26379/m?sentinel_password=pw&prefix=app"),
///     "redis+sentinel://s:26379/m?sentinel_password=***&prefix=app"
/// );
/// ```
pub fn redact_url(url: &str) -> Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Cow::Borrowed(url);
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    // The user info ends at the authority's last `@`; without one there,
    // at the last `@` of all when the authority is no host list (`u:pa`
    // of `redis://u:pa/ss@h`: a password with a `/`, `?` or `#` its writer
    // did not escape). An `@` in the path or the query then hides more
    // than the password, never less.
    let user_end = rest[..authority_end].rfind('@').or_else(|| {
        let hosts = &rest[..authority_end];
        let host_list = hosts.split(',').all(|host| {
            let port = host.rsplit_once(']').map_or(host, |(_, after)| after);
            port.split_once(':')
                .is_none_or(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
        });
        rest.rfind('@').filter(|_| !host_list)
    });
    let rest = match user_end {
        Some(at) => match rest[..at].find(':') {
            Some(colon) => Cow::Owned(format!("{}:***{}", &rest[..colon], &rest[at..])),
            None => Cow::Borrowed(rest),
        },
        None => Cow::Borrowed(rest),
    };
    let after_user = match &rest {
        Cow::Owned(masked) => masked.find(":***@").map_or(0, |at| at + 5),
        Cow::Borrowed(_) => 0,
    };
    let query = match rest[after_user..].find('?') {
        Some(q) => after_user + q + 1,
        None if matches!(rest, Cow::Borrowed(_)) => return Cow::Borrowed(url),
        None => return Cow::Owned(format!("{scheme}://{rest}")),
    };
    let (head, tail) = rest.split_at(query);
    let (query, fragment) = tail.split_at(tail.find('#').unwrap_or(tail.len()));
    let secret = |name: &str| {
        // Names as the parser reads them: percent-decoded.
        percent_decode(name)
            .unwrap_or_else(|_| name.to_owned())
            .to_ascii_lowercase()
            .contains("password")
    };
    if !matches!(rest, Cow::Owned(_))
        && !query
            .split('&')
            .any(|p| secret(p.split('=').next().unwrap_or(p)))
    {
        return Cow::Borrowed(url);
    }
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if secret(name) => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    Cow::Owned(format!("{scheme}://{head}{}{fragment}", query.join("&")))
}

/// Decodes `%XX` escapes in a user name or password taken from a URL
/// (`p%40ss` is `p@ss`).
///
/// # Errors
///
/// A message when an escape is malformed or the result is not UTF-8.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::percent_decode;
///
/// assert_eq!(percent_decode("p%40ss%3Aword").unwrap(), "p@ss:word");
/// assert!(percent_decode("bad%4").is_err());
/// ```
pub fn percent_decode(text: &str) -> Result<String, String> {
    // percent-encoding passes a broken escape through as it is; a URL
    // with one is more likely a mistake than a password with a bare `%`.
    let bytes = text.as_bytes();
    for (i, _) in text.match_indices('%') {
        let hex = bytes.get(i + 1..i + 3);
        if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
            return Err("a `%` not followed by two hex digits".to_owned());
        }
    }
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .map(Cow::into_owned)
        .map_err(|_| "percent escapes that are not UTF-8".to_owned())
}

#[cfg(test)]
mod tests;

/// The PEM files a TLS URL names, in the query parameters every backend
/// spells alike: `tls_ca` (the CA to trust instead of the system's roots),
/// and `tls_cert` with `tls_key` (a client certificate).
///
/// # Examples
///
/// ```
/// use dlock_core::backend::TlsFiles;
///
/// let mut files = TlsFiles::default();
/// assert!(files.take("tls_ca", "/etc/app/ca.pem"));
/// assert!(!files.take("prefix", "app"));
/// assert!(files.take("tls_cert", "/etc/app/client.pem"));
/// assert!(files.check().unwrap_err().contains("tls_key"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// `tls_ca`: the CA certificates to trust.
    pub ca: Option<std::path::PathBuf>,
    /// `tls_cert`: the client certificate.
    pub cert: Option<std::path::PathBuf>,
    /// `tls_key`: the client certificate's key.
    pub key: Option<std::path::PathBuf>,
}

impl TlsFiles {
    /// The three parameters' names.
    pub const PARAMS: [&'static str; 3] = ["tls_ca", "tls_cert", "tls_key"];

    /// Takes the parameter `name=value` if it is one of the three (with a
    /// value): whether it was.
    pub fn take(&mut self, name: &str, value: &str) -> bool {
        let slot = match name {
            "tls_ca" => &mut self.ca,
            "tls_cert" => &mut self.cert,
            "tls_key" => &mut self.key,
            _ => return false,
        };
        if value.is_empty() {
            return false;
        }
        *slot = Some(std::path::PathBuf::from(value));
        true
    }

    /// Whether the parameters fit together: a client certificate needs
    /// both its files. The reason if not.
    ///
    /// # Errors
    ///
    /// The reason, for the URL's error.
    pub fn check(&self) -> Result<(), String> {
        if self.cert.is_some() != self.key.is_some() {
            return Err("a client certificate needs both `tls_cert` and `tls_key`".to_owned());
        }
        Ok(())
    }

    /// Reads one of the files.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](crate::LockError::InvalidOptions)
    /// naming the file, if it cannot be read.
    pub fn read(path: &std::path::Path) -> Result<Vec<u8>, crate::LockError> {
        std::fs::read(path).map_err(|e| {
            crate::InvalidReason::TlsFile {
                path: Some(path.to_owned()),
                problem: e.to_string(),
            }
            .into()
        })
    }
}
