//! `PgConfig`: the server, the session timeout and the lock prefix, from
//! one URL.

use std::{str::FromStr, time::Duration};

use dlock_core::{backend::BackendUrl, LockError};
use dlock_sql::{key_hash, SqlConfig, SqlSettings};
use sqlx::postgres::PgConnectOptions;

/// Where and how to connect.
///
/// Usually made by [`PgConfig::from_url`] from a libpq-style URL,
/// `postgres://user:password@host:port/database`, with dlock's query
/// parameters ([`SqlSettings`]); every other parameter, such as
/// `sslmode`, goes to the driver. The server ends a session idle for the
/// `session_timeout` (`idle_session_timeout`). The `lock_prefix` is hashed
/// into every lock's 64-bit identifier (with the tables' schema,
/// `current_schema()`, unless it is `public`), and names the fencing
/// sequence (`{prefix}_fence`).
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
///
/// Its accessors are those of the [`SqlConfig`] it derefs to, and of its
/// [`SqlSettings`].
#[derive(Clone)]
pub struct PgConfig(SqlConfig<PgConnectOptions>);

impl std::ops::Deref for PgConfig {
    type Target = SqlConfig<PgConnectOptions>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// Shows where it connects and as whom, never the password (the driver's
/// own options print it).
impl std::fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = self.connect_options();
        f.debug_struct("PgConfig")
            .field("host", &o.get_host())
            .field("port", &o.get_port())
            .field("socket", &o.get_socket())
            .field("username", &o.get_username())
            .field("database", &o.get_database())
            .field("ssl_mode", &o.get_ssl_mode())
            .field("settings", self.settings())
            .finish_non_exhaustive()
    }
}

/// The parameters sqlx's PostgreSQL driver reads (sqlx 0.8); it ignores
/// any other, so dlock refuses them instead.
const DRIVER_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

impl PgConfig {
    /// Parses a `postgres://` (or `postgresql://`) URL.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong.
    pub fn from_url(url: &str) -> Result<PgConfig, LockError> {
        let mut parts = BackendUrl::parse_host_optional("PostgreSQL", url)?;
        if !matches!(parts.scheme(), "postgres" | "postgresql") {
            return Err(parts.invalid("expected `postgres://user:password@host:port/database`"));
        }
        let mut settings = SqlSettings::default();
        settings.take_from(&mut parts)?;
        let driver_url = parts.driver_url(&SqlSettings::PARAMS, DRIVER_PARAMS)?;
        let options = PgConnectOptions::from_str(&driver_url)
            .map_err(|e| parts.invalid(&e.to_string()))?
            .application_name("dlock");
        Ok(PgConfig(SqlConfig::new(options, settings)))
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
        PgConfig(SqlConfig::new(options, SqlSettings::default()))
    }

    /// Sets how long a holder that stopped answering keeps its locks (at
    /// least 100 ms).
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.0.set_session_timeout(timeout);
        self
    }
}

/// A lock's 64-bit advisory lock identifier: truncated SHA-256 of the prefix and the
/// key (see [`dlock_sql::key_hash`] for what a collision costs).
pub(crate) fn lock_id(prefix: &str, key: &str) -> i64 {
    key_hash(prefix, key) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_urls_are_typed_errors() {
        dlock_sql::testing::urls_are_refused::<crate::PgDialect>(&[
            "redis://h:1",
            "postgres://h:1/d?session_timeout=10",
            "postgres://h:1/d?max_waiters=0",
            "postgres://h:1/d?holder_sessions=0",
            "postgres://h:1/d?lock_prefix=Bad-Name",
            "postgres://h:notaport/d",
            "postgres://h:1/d?sslmode=sometimes",
            "postgres://h:1/d?sslmod=require",
            "postgres://h:1/d?session_timeout=1s&session_timeout=2s",
        ]);
    }

    #[test]
    fn percent_encoded_parts_reach_the_driver_decoded() {
        let c = PgConfig::from_url(
            "postgres://app%40corp:p%40ss%2Fw%3Ad@h:5/my%20db?options=-c%20lock_timeout%3D5s&session_timeout=1m30s",
        )
        .unwrap();
        assert_eq!(c.connect_options().get_username(), "app@corp");
        assert_eq!(c.connect_options().get_database(), Some("my db"));
        assert_eq!(
            c.connect_options().get_options(),
            Some("-c lock_timeout=5s")
        );
        assert_eq!(c.session_timeout(), Duration::from_secs(90));
        let typo = PgConfig::from_url("postgres://h/d?sslmod=require").unwrap_err();
        assert!(
            typo.to_string()
                .contains("unknown parameter `sslmod`; the valid ones are `session_timeout`"),
            "{typo}"
        );
        let host_from_a_parameter = PgConfig::from_url("postgres:///d?host=/run/postgresql");
        assert!(host_from_a_parameter.is_ok(), "{host_from_a_parameter:?}");
    }

    #[test]
    fn lock_ids_are_stable_and_namespaced() {
        // truncated SHA-256: fixed values, the same on every platform and version.
        assert_eq!(lock_id("dlock", "order:42"), lock_id("dlock", "order:42"));
        assert_ne!(lock_id("dlock", "order:42"), lock_id("other", "order:42"));
        assert_ne!(lock_id("dlock", "a"), lock_id("dlocka", ""));
        assert_eq!(lock_id("", ""), 0x6e34_0b9c_ffb3_7a98_u64 as i64);
        assert_eq!(
            lock_id("dlock", "order:42"),
            0xbd68_c79f_891c_043b_u64 as i64
        );
    }

    #[test]
    fn never_prints_the_password() {
        dlock_sql::testing::configs_never_show_the_password::<crate::PgDialect>(
            "postgres://app:s3cr%40t@db:1/orders?session_timeout=4s&sslmode=prefer",
        );
    }
}
