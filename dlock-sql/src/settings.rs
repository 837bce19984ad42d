//! `SqlSettings`: dlock's own URL parameters, the same on every database.

use std::{ops::RangeInclusive, time::Duration};

use dlock_core::{backend::BackendUrl, LockError};

/// The settings every database backend shares, read from its URL's query.
///
/// | parameter | default | meaning |
/// |---|---|---|
/// | `session_timeout` | `10s` | how long a holder that stopped answering keeps its locks: the server ends a session idle for that long, and with it every lock it holds |
/// | `connect_timeout` | `5s` | how long opening a session may take |
/// | `max_waiters` | `16` | how many sessions may wait on the server at once (1 to 1000) |
/// | `holder_sessions` | `4` | how many sessions take uncontended locks, each key always on the same one (1 to 64) |
/// | `lock_prefix` | `dlock` | the namespace of this application's locks, and the name stem of the fencing object: lowercase letters, digits and `_`, starting with a letter, at most 50 long |
///
/// # Examples
///
/// ```
/// use dlock_sql::SqlSettings;
/// use std::time::Duration;
///
/// use dlock_core::backend::BackendUrl;
///
/// let mut url = BackendUrl::parse("PostgreSQL", "postgres://h/db?session_timeout=4s&sslmode=prefer")?;
/// let mut settings = SqlSettings::default();
/// settings.take_from(&mut url)?;
/// assert_eq!(settings.session_timeout(), Duration::from_secs(4));
/// assert_eq!(url.driver_url(&SqlSettings::PARAMS, &["sslmode"])?, "postgres://h/db?sslmode=prefer");
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Debug, Clone)]
pub struct SqlSettings {
    session_timeout: Duration,
    connect_timeout: Duration,
    max_waiters: usize,
    holder_sessions: usize,
    lock_prefix: String,
}

impl Default for SqlSettings {
    fn default() -> Self {
        SqlSettings {
            session_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            max_waiters: 16,
            holder_sessions: 4,
            lock_prefix: "dlock".to_owned(),
        }
    }
}

impl SqlSettings {
    /// The URL parameters these settings read.
    pub const PARAMS: [&'static str; 5] = [
        "session_timeout",
        "connect_timeout",
        "max_waiters",
        "holder_sessions",
        "lock_prefix",
    ];

    /// Takes dlock's parameters ([`PARAMS`](SqlSettings::PARAMS)) from
    /// `url`'s query, leaving the driver's.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] saying why a parameter of dlock's is
    /// malformed.
    pub fn take_from(&mut self, url: &mut BackendUrl) -> Result<(), LockError> {
        if let Some(timeout) = url.take_duration("session_timeout")? {
            self.set_session_timeout(timeout);
        }
        if let Some(timeout) = url.take_duration("connect_timeout")? {
            self.connect_timeout = timeout;
        }
        if let Some(n) = take_count(url, "max_waiters", 1..=1000)? {
            self.max_waiters = n;
        }
        if let Some(n) = take_count(url, "holder_sessions", 1..=64)? {
            self.holder_sessions = n;
        }
        if let Some(prefix) = url.take("lock_prefix") {
            let valid = prefix.len() <= 50
                && prefix.starts_with(|c: char| c.is_ascii_lowercase())
                && prefix
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !valid {
                return Err(url.invalid(&format!(
                    "`lock_prefix={prefix}` must be lowercase letters, digits and `_`, \
                     starting with a letter, at most 50 long"
                )));
            }
            self.lock_prefix = prefix;
        }
        Ok(())
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

    /// Sets how long a holder that stopped answering keeps its locks (at
    /// least 100 ms).
    pub fn set_session_timeout(&mut self, timeout: Duration) {
        self.session_timeout = timeout.max(Duration::from_millis(100));
    }
}

/// Takes parameter `name`, a count within `range`.
fn take_count(
    url: &mut BackendUrl,
    name: &str,
    range: RangeInclusive<usize>,
) -> Result<Option<usize>, LockError> {
    let Some(value) = url.take(name) else {
        return Ok(None);
    };
    match value.parse() {
        Ok(n) if range.contains(&n) => Ok(Some(n)),
        _ => Err(url.invalid(&format!(
            "`{name}={value}` is not {} to {}",
            range.start(),
            range.end()
        ))),
    }
}

/// What every database backend's config holds: the driver's connect
/// options `O`, and dlock's [`SqlSettings`], whose accessors are its own
/// through `Deref`. `PgConfig` and `MySqlConfig` embed one and deref to it.
#[derive(Clone)]
pub struct SqlConfig<O> {
    options: O,
    settings: SqlSettings,
}

impl<O> SqlConfig<O> {
    /// The driver's `options`, with dlock's `settings`.
    pub fn new(options: O, settings: SqlSettings) -> Self {
        SqlConfig { options, settings }
    }

    /// The driver's connection options.
    pub fn connect_options(&self) -> &O {
        &self.options
    }

    /// dlock's settings: the session timeout, the sessions, the prefix.
    pub fn settings(&self) -> &SqlSettings {
        &self.settings
    }
}

/// Shows dlock's settings only: the driver's options print the password.
impl<O> std::fmt::Debug for SqlConfig<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlConfig")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<O> std::ops::Deref for SqlConfig<O> {
    type Target = SqlSettings;

    fn deref(&self) -> &SqlSettings {
        &self.settings
    }
}

impl<O> std::ops::DerefMut for SqlConfig<O> {
    fn deref_mut(&mut self) -> &mut SqlSettings {
        &mut self.settings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_ours_or_the_drivers() {
        let mut url = BackendUrl::parse(
            "test",
            "x://u:p%40@h:5/d?max_waiters=3&sslmode=disable&lock_prefix=app%5F1&options=-c%20a%3Db",
        )
        .unwrap();
        let mut s = SqlSettings::default();
        s.take_from(&mut url).unwrap();
        let driver = url
            .driver_url(&SqlSettings::PARAMS, &["sslmode", "options"])
            .unwrap();
        // Re-encoded as a form: the driver decodes it back.
        assert_eq!(driver, "x://u:p%40@h:5/d?sslmode=disable&options=-c+a%3Db");
        assert_eq!((s.max_waiters(), s.lock_prefix()), (3, "app_1"));
        assert_eq!(s.holder_sessions(), 4);
        assert_eq!(s.session_timeout(), Duration::from_secs(10));
        let err = url
            .driver_url(&SqlSettings::PARAMS, &["sslmode"])
            .unwrap_err();
        assert!(
            err.to_string().contains("unknown parameter `options`"),
            "{err}"
        );
    }

    #[test]
    fn bad_parameters_say_why() {
        for query in [
            "session_timeout=10",
            "max_waiters=0",
            "max_waiters=1001",
            "holder_sessions=0",
            "lock_prefix=Bad-Name",
            "lock_prefix=",
            "connect_timeout=soon",
        ] {
            let mut url = BackendUrl::parse("test", &format!("x://h/d?{query}")).unwrap();
            let err = SqlSettings::default()
                .take_from(&mut url)
                .unwrap_err()
                .to_string();
            let name = query.split('=').next().unwrap();
            assert!(err.contains(name), "{query}: {err}");
        }
    }
}
