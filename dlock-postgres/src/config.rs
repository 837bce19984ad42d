//! `PgConfig`: the server, the session timeout and the lock prefix, from
//! one URL.

use std::{str::FromStr, time::Duration};

use dlock_core::{
    backend::{parse_url_duration, redact_url},
    LockError,
};
use sqlx::postgres::PgConnectOptions;

/// Where and how to connect.
///
/// Usually made by [`PgConfig::from_url`] from a libpq-style URL,
/// `postgres://user:password@host:port/database`, with these query
/// parameters of dlock's own (every other parameter, such as `sslmode`,
/// goes to the driver):
///
/// - `session_timeout` (default `10s`; `ms` or `s`): how long a holder
///   that stopped answering keeps its locks. The server ends a session idle
///   for that long (`idle_session_timeout`), and with it every lock it
///   holds; dlock keeps its sessions busy with one ping per third of it.
/// - `connect_timeout` (default `5s`): how long opening a session may take.
/// - `max_waiters` (default `16`): how many sessions may wait on the server
///   at once (one per key that tasks of this process wait for).
/// - `holder_sessions` (default `4`): how many sessions take uncontended
///   locks, each key always on the same one; more let more tasks on
///   different keys lock at once.
/// - `lock_prefix` (default `dlock`): the namespace of this application's
///   locks, hashed into every lock's 64-bit identifier, and the name of the
///   fencing sequence (`{prefix}_fence`). Letters, digits and `_`, starting
///   with a letter.
///
/// # Examples
///
/// ```
/// use dlock_postgres::PgConfig;
/// use std::time::Duration;
///
/// let config = PgConfig::from_url(
///     "postgres://app:secret@db:5432/orders?session_timeout=4s&sslmode=prefer",
/// )?;
/// assert_eq!(config.session_timeout(), Duration::from_secs(4));
/// assert_eq!(config.lock_prefix(), "dlock");
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Debug, Clone)]
pub struct PgConfig {
    options: PgConnectOptions,
    session_timeout: Duration,
    connect_timeout: Duration,
    max_waiters: usize,
    holder_sessions: usize,
    lock_prefix: String,
}

fn invalid(url: &str, why: &str) -> LockError {
    LockError::InvalidOptions {
        reason: format!("bad PostgreSQL URL `{}`: {why}", redact_url(url)),
    }
}

impl PgConfig {
    /// Parses a `postgres://` (or `postgresql://`) URL.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong.
    pub fn from_url(url: &str) -> Result<PgConfig, LockError> {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(invalid(
                url,
                "expected `postgres://user:password@host:port/database`",
            ));
        }
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut config = PgConfig {
            options: PgConnectOptions::new(),
            session_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            max_waiters: 16,
            holder_sessions: 4,
            lock_prefix: "dlock".to_owned(),
        };
        let mut driver = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let duration = || {
                parse_url_duration(value).ok_or_else(|| {
                    invalid(
                        url,
                        &format!("`{name}={value}` is not a duration like 500ms or 10s"),
                    )
                })
            };
            match name {
                "session_timeout" => config.session_timeout = duration()?,
                "connect_timeout" => config.connect_timeout = duration()?,
                "max_waiters" => {
                    config.max_waiters = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or_else(|| {
                            invalid(url, &format!("`max_waiters={value}` is not 1 to 1000"))
                        })?;
                }
                "holder_sessions" => {
                    config.holder_sessions = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| {
                            invalid(url, &format!("`holder_sessions={value}` is not 1 to 64"))
                        })?;
                }
                "lock_prefix" => {
                    let valid = value.len() <= 50
                        && value.starts_with(|c: char| c.is_ascii_lowercase())
                        && value
                            .chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
                    if !valid {
                        return Err(invalid(
                            url,
                            &format!(
                                "`lock_prefix={value}` must be lowercase letters, digits and `_`, \
                                 starting with a letter, at most 50 long"
                            ),
                        ));
                    }
                    config.lock_prefix = value.to_owned();
                }
                _ => driver.push(pair),
            }
        }
        let driver_url = if driver.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", driver.join("&"))
        };
        config.options = PgConnectOptions::from_str(&driver_url)
            .map_err(|e| invalid(url, &e.to_string()))?
            .application_name("dlock");
        Ok(config)
    }

    /// The driver's connection options.
    pub fn connect_options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// How long a holder that stopped answering keeps its locks.
    pub fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    /// How long opening a session may take.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How many sessions may wait on the server at once.
    pub fn max_waiters(&self) -> usize {
        self.max_waiters
    }

    /// How many sessions take uncontended locks.
    pub fn holder_sessions(&self) -> usize {
        self.holder_sessions
    }

    /// The namespace of this application's locks.
    pub fn lock_prefix(&self) -> &str {
        &self.lock_prefix
    }

    /// Builds a config from the driver's options, with the defaults for
    /// the rest.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_postgres::{sqlx::postgres::PgConnectOptions, PgConfig};
    ///
    /// let options = PgConnectOptions::new().host("127.0.0.1").username("app");
    /// let config = PgConfig::from_options(options);
    /// assert_eq!(config.max_waiters(), 16);
    /// ```
    pub fn from_options(options: PgConnectOptions) -> PgConfig {
        PgConfig {
            options,
            session_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            max_waiters: 16,
            holder_sessions: 4,
            lock_prefix: "dlock".to_owned(),
        }
    }

    /// Sets how long a holder that stopped answering keeps its locks.
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout.max(Duration::from_millis(100));
        self
    }
}

/// A lock's 64-bit advisory lock identifier: FNV-1a over the prefix, a 0
/// byte and the key. Stable across processes, versions and platforms.
///
/// Two keys that hash alike share one server lock: they contend as if they
/// were one key (a wait that was not needed), and are never both held, so a
/// collision costs throughput, never exclusion. With `n` keys in use at
/// once the chance of any collision is about `n² / 2⁶⁵`.
pub(crate) fn lock_id(prefix: &str, key: &str) -> i64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for &b in prefix.as_bytes().iter().chain(&[0]).chain(key.as_bytes()) {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(PRIME);
    }
    hash as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_ours_or_the_drivers() {
        let c = PgConfig::from_url(
            "postgres://u:p@h:5/d?max_waiters=3&sslmode=disable&lock_prefix=app_1",
        )
        .unwrap();
        assert_eq!((c.max_waiters(), c.lock_prefix()), (3, "app_1"));
        assert_eq!(c.holder_sessions(), 4);
        assert_eq!(c.session_timeout(), Duration::from_secs(10));
    }

    #[test]
    fn bad_urls_are_typed_errors() {
        for url in [
            "redis://h:1",
            "postgres://h:1/d?session_timeout=10",
            "postgres://h:1/d?max_waiters=0",
            "postgres://h:1/d?holder_sessions=0",
            "postgres://h:1/d?lock_prefix=Bad-Name",
            "postgres://h:notaport/d",
            "postgres://h:1/d?sslmode=sometimes",
        ] {
            assert!(
                matches!(
                    PgConfig::from_url(url),
                    Err(LockError::InvalidOptions { .. })
                ),
                "{url}"
            );
        }
    }

    #[test]
    fn lock_ids_are_stable_and_namespaced() {
        // FNV-1a: fixed values, the same on every platform and version.
        assert_eq!(lock_id("dlock", "order:42"), lock_id("dlock", "order:42"));
        assert_ne!(lock_id("dlock", "order:42"), lock_id("other", "order:42"));
        assert_ne!(lock_id("dlock", "a"), lock_id("dlocka", ""));
        assert_eq!(lock_id("", ""), 0xaf63_bd4c_8601_b7df_u64 as i64);
    }
}
