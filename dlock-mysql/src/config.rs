//! `MySqlConfig`: the server, the session timeout, the lock prefix and the
//! fencing source, from one URL.

use std::{str::FromStr, time::Duration};

use dlock_core::{backend::redact_url, LockError, LockKey};
use dlock_sql::{key_hash, SqlSettings};
use sqlx::mysql::MySqlConnectOptions;

/// Whether grants carry fencing tokens, and from where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FenceSource {
    /// Counter rows, `{prefix}_fence`, one per shard of the lock names:
    /// the grant's request also runs `UPDATE … SET v = LAST_INSERT_ID(v +
    /// 1)` on its key's row, a committed write that survives a server
    /// crash (with InnoDB's default `innodb_flush_log_at_trx_commit = 1`).
    /// It costs one durable commit per grant.
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
/// - `session_timeout` (default `10s`): how long a holder that stopped
///   answering keeps its locks. The server ends a session idle for that
///   long (`wait_timeout`, in whole seconds: rounded up, so the server
///   keeps a paused holder's locks up to a second longer than its guard
///   believes it holds them, never shorter); dlock keeps its sessions busy
///   with one ping per third of it.
/// - `connect_timeout` (default `5s`), `max_waiters` (default `16`),
///   `holder_sessions` (default `4`): as for every database, see
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
#[derive(Clone)]
pub struct MySqlConfig {
    options: MySqlConnectOptions,
    settings: SqlSettings,
    fence: FenceSource,
}

/// Shows where it connects and as whom, never the password (the driver's
/// own options print it).
impl std::fmt::Debug for MySqlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = &self.options;
        f.debug_struct("MySqlConfig")
            .field("host", &o.get_host())
            .field("port", &o.get_port())
            .field("socket", &o.get_socket())
            .field("username", &o.get_username())
            .field("database", &o.get_database())
            .field("ssl_mode", &o.get_ssl_mode())
            .field("settings", &self.settings)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

fn invalid(url: &str, why: &str) -> LockError {
    LockError::InvalidOptions {
        reason: format!("bad MySQL URL `{}`: {why}", redact_url(url)),
    }
}

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
        let driver_url = if let Some(rest) = url.strip_prefix("mariadb://") {
            format!("mysql://{rest}")
        } else if url.starts_with("mysql://") {
            url.to_owned()
        } else {
            return Err(invalid(
                url,
                "expected `mysql://user:password@host:port/database`",
            ));
        };
        let mut fence = FenceSource::Row;
        let (base, query) = driver_url.split_once('?').unwrap_or((&driver_url, ""));
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("fence", value)) => {
                    fence = match value {
                        "row" => FenceSource::Row,
                        "off" => FenceSource::Off,
                        _ => {
                            return Err(invalid(url, &format!("`fence={value}` is not row or off")))
                        }
                    }
                }
                _ => rest.push(pair),
            }
        }
        let driver_url = if rest.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        let mut settings = SqlSettings::default();
        let driver_url = settings
            .take_params(&driver_url)
            .map_err(|why| invalid(url, &why))?;
        if settings.lock_prefix().len() > MAX_PREFIX {
            return Err(invalid(
                url,
                &format!("`lock_prefix` is longer than {MAX_PREFIX}"),
            ));
        }
        let options =
            MySqlConnectOptions::from_str(&driver_url).map_err(|e| invalid(url, &e.to_string()))?;
        Ok(MySqlConfig {
            options,
            settings,
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
            options,
            settings: SqlSettings::default(),
            fence: FenceSource::Row,
        }
    }

    /// Sets how long a holder that stopped answering keeps its locks (at
    /// least 100 ms; the server's own timeout is this rounded up to whole
    /// seconds).
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.settings.set_session_timeout(timeout);
        self
    }

    /// Sets whether grants carry fencing tokens.
    pub fn with_fence(mut self, fence: FenceSource) -> Self {
        self.fence = fence;
        self
    }

    /// The driver's connection options.
    pub fn connect_options(&self) -> &MySqlConnectOptions {
        &self.options
    }

    /// dlock's settings: the session timeout, the sessions, the prefix.
    pub fn settings(&self) -> &SqlSettings {
        &self.settings
    }

    /// How long a holder that stopped answering keeps its locks.
    pub fn session_timeout(&self) -> Duration {
        self.settings.session_timeout()
    }

    /// How many sessions may wait on the server at once.
    pub fn max_waiters(&self) -> usize {
        self.settings.max_waiters()
    }

    /// The namespace of this application's locks.
    pub fn lock_prefix(&self) -> &str {
        self.settings.lock_prefix()
    }

    /// Whether grants carry fencing tokens.
    pub fn fence(&self) -> FenceSource {
        self.fence
    }
}

/// A key's `GET_LOCK` name: `{prefix}:` and the key, with every character
/// but lowercase ASCII letters, digits and `-_.:/` escaped (so that names,
/// which the server compares without case, keep keys apart that differ
/// only in case). A name longer than MySQL's 64 characters keeps its first
/// part and ends in `#` and 16 hex digits of truncated SHA-256 over the prefix and
/// the key: such keys share a lock only if their hashes collide, which
/// costs a wait, never exclusion (`#` is always escaped in whole names, so
/// the two forms never meet).
pub(crate) fn lock_name(prefix: &str, key: &LockKey) -> String {
    object_name(prefix, "", key)
}

/// The name of `key`'s read-write lock (`object` `%rw:`) or semaphore
/// (`%sem:`) in the queue table: as [`lock_name`], with the object after
/// the prefix (a `%` an escaped key never has before two hex digits), and
/// a hashed tail over the object and the key, so the three objects of one
/// key never share a name.
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
        let hash = if object.is_empty() {
            key_hash(prefix, key.as_str())
        } else {
            key_hash(prefix, &format!("{object}{}", key.as_str()))
        };
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
        for url in [
            "postgres://h:1/d",
            "mysql://h:1/d?session_timeout=10",
            "mysql://h:1/d?fence=sequence",
            "mysql://h:1/d?max_waiters=0",
            "mysql://h:1/d?lock_prefix=Bad-Name",
            "mysql://h:1/d?lock_prefix=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "mysql://h:notaport/d",
            "mysql://h:1/d?ssl-mode=sometimes",
        ] {
            assert!(
                matches!(
                    MySqlConfig::from_url(url),
                    Err(LockError::InvalidOptions { .. })
                ),
                "{url}"
            );
        }
    }

    fn name(key: &str) -> String {
        lock_name("dlock", &LockKey::new(key).unwrap())
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
        let widest = lock_name(&"p".repeat(MAX_PREFIX), &LockKey::new(&long).unwrap());
        let prefix = "p".repeat(MAX_PREFIX);
        let key = LockKey::new(&long).unwrap();
        let (rw, sem) = (
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
        let config =
            MySqlConfig::from_url("mysql://app:s3cr%40t@db:1/orders?session_timeout=4s&fence=off")
                .unwrap();
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cr"), "{shown}");
        assert!(
            shown.contains("\"app\"") && shown.contains("\"db\""),
            "{shown}"
        );
        for bad in [
            "mysql://app:s3cret@h:port/d",
            "mysql://app:s3cret@h:1/d?session_timeout=10",
            "mysql://app:s3cret@h:1/d?lock_prefix=Bad",
            "mysql://app:s3cret@h:1/d?unknown_driver_option=1",
            "mysql://app:s3cr%4@h:1/d",
        ] {
            match MySqlConfig::from_url(bad) {
                Ok(config) => {
                    let shown = format!("{config:?}");
                    assert!(!shown.contains("s3cr"), "{bad}: {shown}");
                }
                Err(e) => {
                    for shown in [e.to_string(), format!("{e:?}")] {
                        assert!(!shown.contains("s3cr"), "{bad}: {shown}");
                    }
                }
            }
        }
    }
}
