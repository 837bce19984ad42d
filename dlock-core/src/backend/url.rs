//! URL helpers every backend's `from_url` shares: keeping passwords out of
//! what is printed, and reading percent-encoded user names and passwords.

use std::{borrow::Cow, time::Duration};

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

/// `url` with the password of its user info replaced by `***`, for
/// errors, `Debug` output and traces. A URL without a password is returned
/// as it is.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::redact_url;
///
/// assert_eq!(redact_url("redis://app:s3cr%40t@db:6379/0"), "redis://app:***@db:6379/0");
/// assert_eq!(redact_url("redis://:pw@a:1,b:2,c:3"), "redis://:***@a:1,b:2,c:3");
/// assert_eq!(redact_url("etcd://10.0.0.1:2379/locks"), "etcd://10.0.0.1:2379/locks");
/// ```
pub fn redact_url(url: &str) -> Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Cow::Borrowed(url);
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return Cow::Borrowed(url);
    };
    let Some(colon) = authority[..at].find(':') else {
        return Cow::Borrowed(url);
    };
    Cow::Owned(format!(
        "{scheme}://{}:***{}",
        &authority[..colon],
        &rest[at..]
    ))
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
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        if byte == b'%' {
            let hex = tail
                .get(..2)
                .and_then(|hex| std::str::from_utf8(hex).ok())
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| "a `%` not followed by two hex digits".to_owned())?;
            bytes.push(hex);
            rest = &tail[2..];
        } else {
            bytes.push(byte);
            rest = tail;
        }
    }
    String::from_utf8(bytes).map_err(|_| "percent escapes that are not UTF-8".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_only_the_password() {
        for (url, shown) in [
            ("redis://u:p@h:1/2?prefix=x", "redis://u:***@h:1/2?prefix=x"),
            (
                "redis+redlock://:p@a:1,b:2,c:3",
                "redis+redlock://:***@a:1,b:2,c:3",
            ),
            ("etcd://u:p%40q@h:1/x@y", "etcd://u:***@h:1/x@y"),
            ("etcd://u:a@b@h:1", "etcd://u:***@h:1"),
            ("redis://user@h:1", "redis://user@h:1"),
            ("redis://h:1/x:y@z", "redis://h:1/x:y@z"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn decodes_escapes_and_refuses_broken_ones() {
        assert_eq!(percent_decode("plain").unwrap(), "plain");
        assert_eq!(percent_decode("%E2%9C%93").unwrap(), "✓");
        for bad in ["%", "%g0", "%0", "%FF"] {
            assert!(percent_decode(bad).is_err(), "{bad}");
        }
    }
}

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
        std::fs::read(path).map_err(|e| crate::LockError::InvalidOptions {
            reason: format!("cannot read the TLS file `{}`: {e}", path.display()),
        })
    }
}
