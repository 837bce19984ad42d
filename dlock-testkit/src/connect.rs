//! One URL per backend: a client for whichever backend a URL names, so
//! that tests and helper processes switch backend without code changes.

use std::sync::Arc;

use dlock_core::{backend::Backend, LockError};

/// A new client of the backend `url` names: `redis://`,
/// `redis+redlock://`, `etcd://`, `zk://`, `postgres://` or `mysql://`.
///
/// # Errors
///
/// [`LockError::InvalidOptions`] for another scheme or a malformed URL;
/// the backend's error if it cannot connect.
///
/// # Examples
///
/// ```no_run
/// # async fn f() -> Result<(), dlock_core::LockError> {
/// let client = dlock_testkit::connect("etcd://127.0.0.1:2379/locks").await?;
/// let locker = dlock_core::Locker::from_arc(client);
/// # Ok(())
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn Backend>, LockError> {
    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or_default();
    Ok(match scheme {
        "redis" | "redis+redlock" => Arc::new(dlock_redis::RedisBackend::connect(url).await?),
        "etcd" => Arc::new(dlock_etcd::EtcdBackend::connect(url).await?),
        "zk" => Arc::new(dlock_zk::ZkBackend::connect(url).await?),
        "postgres" | "postgresql" => Arc::new(dlock_postgres::PgBackend::connect(url).await?),
        "mysql" | "mariadb" => Arc::new(dlock_mysql::MySqlBackend::connect(url).await?),
        _ => {
            return Err(LockError::InvalidOptions {
                reason: format!(
                    "`{url}`: expected a redis://, redis+redlock://, etcd://, zk://, \
                     postgres:// or mysql:// URL"
                ),
            })
        }
    })
}
