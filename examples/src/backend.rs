//! `--backend URL`: every example runs on the embedded in-process backend by
//! default, and on any server backend given by URL.

use dlock_core::{BackendExt, LockError, Locker, MemoryBackend};

/// The URLs `--backend` accepts, for usage messages.
pub const URLS: &str =
    "memory (default), redis://HOST:PORT, redis+redlock://H1:P1,H2:P2,H3:P3, etcd://HOST:PORT/PREFIX, zk://HOST:PORT/PATH, postgres://USER:PASSWORD@HOST:PORT/DB, mysql://USER:PASSWORD@HOST:PORT/DB";

/// A [`Locker`] on the backend `url` names; `None` or `"memory"` is the
/// in-process backend (locks shared by this process only).
///
/// This is the one place the examples pick a backend: an application
/// depends on the backend crate it uses and calls its `connect`, as here.
/// Each backend is a cargo feature of the examples: `redis` and `zk` are on
/// by default, `etcd` (its client's build needs `protoc`), `postgres` and
/// `mysql` are not; a URL of a backend left out is an error that names the
/// feature.
///
/// # Errors
///
/// [`LockError::InvalidOptions`] for an unknown scheme or a malformed URL;
/// the backend's error if it cannot connect.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = dlock_examples::backend::locker(None).await?;
/// let guard = locker.lock("order:1").await?;
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
pub async fn locker(url: Option<&str>) -> Result<Locker, LockError> {
    let Some(url) = url.filter(|url| *url != "memory") else {
        return Ok(MemoryBackend::new().into_locker());
    };
    match url.split_once("://").map(|(scheme, _)| scheme) {
        Some("redis" | "redis+redlock") => redis(url).await,
        Some("etcd") => etcd(url).await,
        Some("zk") => zk(url).await,
        Some("postgres" | "postgresql") => postgres(url).await,
        Some("mysql" | "mariadb") => mysql(url).await,
        _ => Err(LockError::InvalidOptions {
            reason: format!("`{url}` names no backend; use one of: {URLS}"),
        }),
    }
}

/// The error for a backend whose cargo feature is off.
#[allow(dead_code)] // with every backend feature on
fn feature_off(feature: &str) -> LockError {
    LockError::InvalidOptions {
        reason: format!(
            "this build has no {feature} backend: build the examples with feature `{feature}` \
             (cargo run -p dlock-examples --features {feature} --bin ...)"
        ),
    }
}

#[cfg(feature = "redis")]
async fn redis(url: &str) -> Result<Locker, LockError> {
    Ok(dlock_redis::RedisBackend::connect(url).await?.into_locker())
}

#[cfg(not(feature = "redis"))]
async fn redis(_url: &str) -> Result<Locker, LockError> {
    Err(feature_off("redis"))
}

#[cfg(feature = "etcd")]
async fn etcd(url: &str) -> Result<Locker, LockError> {
    Ok(dlock_etcd::EtcdBackend::connect(url).await?.into_locker())
}

/// Without feature `etcd` (off by default: etcd-client's build needs
/// `protoc`).
#[cfg(not(feature = "etcd"))]
async fn etcd(_url: &str) -> Result<Locker, LockError> {
    Err(feature_off("etcd"))
}

#[cfg(feature = "zk")]
async fn zk(url: &str) -> Result<Locker, LockError> {
    Ok(dlock_zk::ZkBackend::connect(url).await?.into_locker())
}

#[cfg(not(feature = "zk"))]
async fn zk(_url: &str) -> Result<Locker, LockError> {
    Err(feature_off("zk"))
}

/// Whether `url` names the in-process backend, whose locks do not reach
/// other processes.
///
/// # Examples
///
/// ```
/// use dlock_examples::backend::is_in_process;
///
/// assert!(is_in_process(None) && is_in_process(Some("memory")));
/// assert!(!is_in_process(Some("redis://127.0.0.1:6379")));
/// ```
pub fn is_in_process(url: Option<&str>) -> bool {
    url.is_none_or(|url| url == "memory")
}

#[cfg(feature = "postgres")]
async fn postgres(url: &str) -> Result<Locker, LockError> {
    Ok(dlock_postgres::PgBackend::connect(url).await?.into_locker())
}

/// Without feature `postgres` (off by default).
#[cfg(not(feature = "postgres"))]
async fn postgres(_url: &str) -> Result<Locker, LockError> {
    Err(feature_off("postgres"))
}

#[cfg(feature = "mysql")]
async fn mysql(url: &str) -> Result<Locker, LockError> {
    Ok(dlock_mysql::MySqlBackend::connect(url).await?.into_locker())
}

/// Without feature `mysql` (off by default).
#[cfg(not(feature = "mysql"))]
async fn mysql(_url: &str) -> Result<Locker, LockError> {
    Err(feature_off("mysql"))
}
