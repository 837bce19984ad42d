//! `MySqlConfig`: the server, the session timeout, the lock prefix and the
//! fencing source, from one URL.

use std::{str::FromStr, time::Duration};

use dlock_core::{backend::BackendUrl, LockError, LockKey};
use dlock_sql::{key_hash, SqlConfig, SqlSettings};
use sqlx::mysql::MySqlConnectOptions;

/// Whether grants carry fencing tokens, and from where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FenceSource {
    /// Counter rows, `{prefix}_fence`, one per shard of the lock names:
    /// the grant's request also runs `UPDATE … SET v = LAST_INSERT_ID(v +
    /// 1)` on its key's row, a committed write that survives a server
    /// crash (with InnoDB's default `innodb_flush_log_at_trx_commit = 1`).
    /// It costs one durable commit per grant. An attempt that does not wait
    /// runs both in the stored function `{prefix}_take_v1`, where the login
    /// may (see the [crate docs](crate)).
    #[default]
    Row,
    /// No fencing tokens: grants write nothing, and guards carry no token
    /// ([`Capabilities::has_fencing`](dlock_core::backend::Capabilities::has_fencing)
    /// is false). For locks whose holders write nowhere a token could be
    /// checked.
    Off,
}

/// Where and how to connect.
///
/// Usually made by [`MySqlConfig::from_url`] from a URL,
/// `mysql://user:password@host:port/database` (MariaDB too), with these
/// query parameters of dlock's own (every other parameter, such as
/// `ssl-mode`, goes to the driver):
///
/// - `session_timeout` (default `10s`): the server's `wait_timeout`, in
///   whole seconds: rounded up, so the server may keep a paused holder's
///   locks up to a second longer than its guard believes, never shorter.
/// - `connect_timeout`, `max_waiters`, `holder_sessions`: see
///   [`SqlSettings`].
/// - `lock_prefix` (default `dlock`): the namespace of this application's
///   lock names, and the fencing object's name stem (`{prefix}_fence`), at
///   most 46 long. Lock names are server-wide, the tables per database:
///   applications on different databases of one server need different
///   prefixes.
/// - `fence` (default `row`): `row` or `off`, see [`FenceSource`].
///
/// # Examples
///
/// ```
/// use dlock_mysql::{FenceSource, MySqlConfig};
/// use std::time::Duration;
///
/// let config = MySqlConfig::from_url(
///     "mysql://app:secret@db:3306/orders?session_timeout=4s&fence=off",
/// )?;
/// assert_eq!(config.session_timeout(), Duration::from_secs(4));
/// assert_eq!(config.fence(), FenceSource::Off);
/// # Ok::<(), dlock_core::LockError>(())
/// ```
///
/// Its accessors but [`fence`](MySqlConfig::fence) are those of the
/// [`SqlConfig`] it derefs to, and of its [`SqlSettings`].
#[derive(Clone)]
pub struct MySqlConfig {
    sql: SqlConfig<MySqlConnectOptions>,
    fence: FenceSource,
}

impl std::ops::Deref for MySqlConfig {
    type Target = SqlConfig<MySqlConnectOptions>;

    fn deref(&self) -> &Self::Target {
        &self.sql
    }
}

/// Shows where it connects and as whom, never the password (the driver's
/// own options print it).
impl std::fmt::Debug for MySqlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = self.connect_options();
        f.debug_struct("MySqlConfig")
            .field("host", &o.get_host())
            .field("port", &o.get_port())
            .field("socket", &o.get_socket())
            .field("username", &o.get_username())
            .field("database", &o.get_database())
            .field("ssl_mode", &o.get_ssl_mode())
            .field("settings", self.settings())
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

/// The parameters sqlx's MySQL driver reads (sqlx 0.8); it ignores any
/// other, so dlock refuses them instead.
const DRIVER_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslca",
    "ssl-ca",
    "charset",
    "collation",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "socket",
    "timezone",
    "time-zone",
];

/// The longest lock name MySQL takes.
const MAX_NAME: usize = 64;
/// `#` and 16 hex digits: the tail of a name too long to keep whole.
const HASH_TAIL: usize = 17;
/// The longest prefix that leaves room for `:` and the hash tail.
const MAX_PREFIX: usize = MAX_NAME - 1 - HASH_TAIL;

impl MySqlConfig {
    /// Parses a `mysql://` (or `mariadb://`) URL.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] naming what is wrong.
    pub fn from_url(url: &str) -> Result<MySqlConfig, LockError> {
        // The driver reads `mysql://` only; `mariadb://` is the same URL.
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => url.to_owned(),
        };
        let mut parts = BackendUrl::parse_host_optional("MySQL", &url)?;
        if parts.scheme() != "mysql" {
            return Err(parts.invalid("expected `mysql://user:password@host:port/database`"));
        }
        let fence = match parts.take("fence").as_deref() {
            None | Some("row") => FenceSource::Row,
            Some("off") => FenceSource::Off,
            Some(other) => return Err(parts.invalid(&format!("`fence={other}` is not row or off"))),
        };
        let mut settings = SqlSettings::default();
        settings.take_from(&mut parts)?;
        if settings.lock_prefix().len() > MAX_PREFIX {
            return Err(parts.invalid(&format!("`lock_prefix` is longer than {MAX_PREFIX}")));
        }
        let ours: Vec<&str> = SqlSettings::PARAMS.into_iter().chain(["fence"]).collect();
        let driver_url = parts.driver_url(&ours, DRIVER_PARAMS)?;
        let options = MySqlConnectOptions::from_str(&driver_url)
            .map_err(|e| parts.invalid(&e.to_string()))?;
        Ok(MySqlConfig {
            sql: SqlConfig::new(options, settings),
            fence,
        })
    }

    /// Builds a config from the driver's options, with the defaults for
    /// the rest.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_mysql::{sqlx::mysql::MySqlConnectOptions, MySqlConfig};
    ///
    /// let options = MySqlConnectOptions::new().host("127.0.0.1").username("app");
    /// let config = MySqlConfig::from_options(options);
    /// assert_eq!(config.max_waiters(), 16);
    /// ```
    pub fn from_options(options: MySqlConnectOptions) -> MySqlConfig {
        MySqlConfig {
            sql: SqlConfig::new(options, SqlSettings::default()),
            fence: FenceSource::Row,
        }
    }

    /// Sets how long a holder that stopped answering keeps its locks (at
    /// least 100 ms; the server's own timeout is this rounded up to whole
    /// seconds).
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.sql.set_session_timeout(timeout);
        self
    }

    /// Sets whether grants carry fencing tokens.
    pub fn with_fence(mut self, fence: FenceSource) -> Self {
        self.fence = fence;
        self
    }

    /// Whether grants carry fencing tokens.
    pub fn fence(&self) -> FenceSource {
        self.fence
    }
}

/// The `GET_LOCK` name of `key`'s `object`: `{prefix}:`, the object (`""`
/// for a plain lock, `%rw:` a read-write lock's, `%sem:` a semaphore's: a
/// `%` an escaped key never has before two hex digits), and the key, with
/// every character but lowercase ASCII letters, digits and `-_.:/`
/// escaped (names are compared without case). A name longer than MySQL's
/// 64 characters keeps its first part and ends in `#` and 16 hex digits of
/// truncated SHA-256 over the prefix, the object and the key: such keys
/// share a lock only if their hashes collide, which costs a wait, never
/// exclusion (`#` is always escaped in whole names).
pub(crate) fn object_name(prefix: &str, object: &str, key: &LockKey) -> String {
    let mut name = String::with_capacity(MAX_NAME);
    name.push_str(prefix);
    name.push(':');
    name.push_str(object);
    key.escape_into(&mut name, |c| {
        !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.' | ':' | '/'))
    });
    if name.len() > MAX_NAME {
        // The escaped name is ASCII: every byte is a character boundary.
        name.truncate(MAX_NAME - HASH_TAIL);
        let hash = key_hash(prefix, &format!("{object}{}", key.as_str()));
        name.push_str(&format!("#{hash:016x}"));
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_ours_or_the_drivers() {
        let c = MySqlConfig::from_url(
            "mariadb://u:p@h:5/d?max_waiters=3&ssl-mode=disabled&fence=off&lock_prefix=app_1",
        )
        .unwrap();
        assert_eq!((c.max_waiters(), c.lock_prefix()), (3, "app_1"));
        assert_eq!(c.fence(), FenceSource::Off);
        assert_eq!(c.connect_options().get_database(), Some("d"));
    }

    #[test]
    fn bad_urls_are_typed_errors() {
        dlock_sql::testing::urls_are_refused::<crate::MySqlDialect>(&[
            "postgres://h:1/d",
            "mysql://h:1/d?session_timeout=10",
            "mysql://h:1/d?fence=sequence",
            "mysql://h:1/d?max_waiters=0",
            "mysql://h:1/d?lock_prefix=Bad-Name",
            "mysql://h:1/d?lock_prefix=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "mysql://h:notaport/d",
            "mysql://h:1/d?ssl-mode=sometimes",
            "mysql://h:1/d?ssl_mode=required",
        ]);
    }

    #[test]
    fn percent_encoded_parts_reach_the_driver_decoded() {
        let c = MySqlConfig::from_url(
            "mysql://app%40corp:p%40ss@h:5/my%2Ddb?lock_prefix=app%5F2&connect_timeout=1m30s",
        )
        .unwrap();
        assert_eq!(c.connect_options().get_username(), "app@corp");
        assert_eq!(c.connect_options().get_database(), Some("my-db"));
        assert_eq!(c.lock_prefix(), "app_2");
        assert_eq!(c.settings().connect_timeout(), Duration::from_secs(90));
        let typo = MySqlConfig::from_url("mysql://h/d?ssl_mode=required").unwrap_err();
        assert!(
            typo.to_string().contains("unknown parameter `ssl_mode`")
                && typo.to_string().contains("`fence`, `sslmode`, `ssl-mode`"),
            "{typo}"
        );
    }

    fn name(key: &str) -> String {
        object_name("dlock", "", &LockKey::new(key).unwrap())
    }

    #[test]
    fn names_keep_keys_apart_that_differ_in_case() {
        assert_eq!(name("order:42/a-b_c.d"), "dlock:order:42/a-b_c.d");
        assert_eq!(name("Order:42"), "dlock:%4Frder:42");
        assert_eq!(name("a#b %"), "dlock:a%23b%20%25");
        assert_ne!(name("A").to_lowercase(), name("a").to_lowercase());
    }

    #[test]
    fn long_keys_end_in_a_hash_within_64_characters() {
        let long = "k".repeat(200);
        let (a, b) = (name(&long), name(&format!("{long}x")));
        assert_eq!((a.len(), b.len()), (64, 64));
        assert_ne!(a, b);
        assert!(
            a.starts_with("dlock:kkkk") && a.as_bytes()[47] == b'#',
            "{a}"
        );
        let exact = name(&"k".repeat(58));
        assert_eq!((exact.len(), exact.contains('#')), (64, false));
        let (prefix, key) = ("p".repeat(MAX_PREFIX), LockKey::new(&long).unwrap());
        let (widest, rw, sem) = (
            object_name(&prefix, "", &key),
            object_name(&prefix, "%rw:", &key),
            object_name(&prefix, "%sem:", &key),
        );
        assert!(rw.len() <= MAX_NAME && sem.len() <= MAX_NAME);
        assert!(widest != rw && rw != sem && sem != widest, "{rw} {sem}");
        let short = LockKey::new("k").unwrap();
        assert_eq!(object_name("dlock", "%rw:", &short), "dlock:%rw:k");
        assert_eq!(widest.len(), 64);
    }

    #[test]
    fn never_prints_the_password() {
        dlock_sql::testing::configs_never_show_the_password::<crate::MySqlDialect>(
            "mysql://app:s3cr%40t@db:1/orders?session_timeout=4s&fence=off",
        );
    }
}
