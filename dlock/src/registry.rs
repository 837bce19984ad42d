//! Every backend [`connect`](crate::connect) reaches by URL, in one list:
//! a backend is its entry in [`BACKENDS`] (plus its crate's feature and
//! re-export).

use std::{future::Future, sync::Arc};

use dlock_core::{
    backend::{BoxFuture, DynBackend},
    MemoryBackend, Result,
};

/// A backend [`connect`](crate::connect) can reach by URL.
///
/// # Examples
///
/// ```
/// let redis = dlock::registry::for_url("redis+sentinel://s1:26379/main").unwrap();
/// assert_eq!((redis.name, redis.feature), ("redis", "redis"));
/// assert!(dlock::registry::for_url("ftp://example").is_none());
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct Registered {
    /// The backend's name, as in errors and traces.
    pub name: &'static str,
    /// The URL schemes (before `://`) that name it.
    pub schemes: &'static [&'static str],
    /// The cargo feature of `dlock` that brings it (`""`: always there).
    pub feature: &'static str,
    /// Its URL forms, for usage messages.
    pub urls: &'static str,
    /// Whether this build has it (its feature is on).
    pub built: bool,
    connect: Connect,
}

/// A backend's connect: a new client of the backend a URL names.
type Connect = for<'a> fn(&'a str) -> BoxFuture<'a, Result<Arc<dyn DynBackend>>>;

impl Registered {
    /// A new client of the backend `url` names.
    ///
    /// # Errors
    ///
    /// [`InvalidReason::FeatureOff`](dlock_core::InvalidReason::FeatureOff) where this build leaves the backend
    /// out; the backend's error if the URL is malformed or it cannot
    /// connect.
    pub fn connect<'a>(
        &self,
        url: &'a str,
    ) -> impl Future<Output = Result<Arc<dyn DynBackend>>> + 'a {
        (self.connect)(url)
    }
}

/// One entry: the backend's connect where its feature is on, and the
/// feature's name in an error where it is off.
macro_rules! entry {
    ($name:literal, $feature:literal, [$($scheme:literal),+], $urls:literal, $connect:path) => {
        Registered {
            name: $name,
            schemes: &[$($scheme),+],
            feature: $feature,
            urls: $urls,
            built: cfg!(feature = $feature),
            connect: {
                #[cfg(feature = $feature)]
                fn connect(url: &str) -> BoxFuture<'_, Result<Arc<dyn DynBackend>>> {
                    Box::pin(async move { Ok(Arc::new($connect(url).await?) as Arc<dyn DynBackend>) })
                }
                #[cfg(not(feature = $feature))]
                fn connect(_url: &str) -> BoxFuture<'_, Result<Arc<dyn DynBackend>>> {
                    Box::pin(std::future::ready(Err(
                        dlock_core::InvalidReason::FeatureOff { feature: $feature }.into(),
                    )))
                }
                connect
            },
        }
    };
}

/// Every backend dlock has, whether or not this build has its feature.
pub static BACKENDS: &[Registered] = &[
    Registered {
        name: "memory",
        schemes: &["memory"],
        feature: "",
        urls: "memory",
        built: true,
        connect: |_| Box::pin(std::future::ready(Ok(Arc::new(MemoryBackend::new()) as _))),
    },
    entry!(
        "redis",
        "redis",
        [
            "redis",
            "redis+redlock",
            "redis+cluster",
            "redis+sentinel",
            "rediss",
            "rediss+redlock",
            "rediss+cluster",
            "rediss+sentinel"
        ],
        "redis://HOST:PORT, redis+redlock://H1:P1,H2:P2,H3:P3, redis+cluster://H1:P1,H2:P2, \
         redis+sentinel://S1:P1,S2:P2/MASTER, rediss://… (TLS)",
        dlock_redis::RedisBackend::connect
    ),
    entry!(
        "etcd",
        "etcd",
        ["etcd", "etcds"],
        "etcd://HOST:PORT/PREFIX, etcds://… (TLS)",
        dlock_etcd::EtcdBackend::connect
    ),
    entry!(
        "zookeeper",
        "zk",
        ["zk", "zks"],
        "zk://HOST:PORT/PATH, zks://… (TLS)",
        dlock_zk::ZkBackend::connect
    ),
    entry!(
        "postgres",
        "postgres",
        ["postgres", "postgresql"],
        "postgres://USER:PASSWORD@HOST:PORT/DB",
        dlock_postgres::PgBackend::connect
    ),
    entry!(
        "mysql",
        "mysql",
        ["mysql", "mariadb"],
        "mysql://USER:PASSWORD@HOST:PORT/DB",
        dlock_mysql::MySqlBackend::connect
    ),
    entry!(
        "file",
        "file",
        ["file"],
        "file:///ABSOLUTE/DIR",
        dlock_file::FileBackend::connect
    ),
];

/// The backend `url` names, by its scheme (`memory` alone names the
/// in-process backend); `None` for a scheme dlock does not know.
pub fn for_url(url: &str) -> Option<&'static Registered> {
    let scheme = url.split_once("://").map_or(url, |(scheme, _)| scheme);
    BACKENDS.iter().find(|b| b.schemes.contains(&scheme))
}

/// Every backend's URL forms, for usage messages.
///
/// # Examples
///
/// ```
/// assert!(dlock::registry::urls().contains("etcd://HOST:PORT/PREFIX"));
/// ```
pub fn urls() -> &'static str {
    static URLS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URLS.get_or_init(|| {
        BACKENDS
            .iter()
            .map(|b| b.urls)
            .collect::<Vec<_>>()
            .join(", ")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_names_one_backend_and_every_feature_is_a_cargo_feature() {
        let manifest = include_str!("../Cargo.toml");
        for backend in BACKENDS {
            for scheme in backend.schemes {
                let url = format!("{scheme}://host/x");
                assert_eq!(for_url(&url).map(|b| b.name), Some(backend.name), "{url}");
            }
            assert!(
                backend.feature.is_empty()
                    || manifest.contains(&format!("\n{} = [", backend.feature)),
                "{} is not a feature of dlock",
                backend.feature
            );
            assert!(urls().contains(backend.urls));
        }
    }

    #[tokio::test]
    async fn a_backend_left_out_of_the_build_names_its_feature() {
        // The in-process backend is in every build, and connects.
        let memory = for_url("memory").expect("registered");
        assert!(memory.built);
        assert_eq!(
            memory.connect("memory").await.expect("memory").name(),
            "memory"
        );
        for backend in BACKENDS.iter().filter(|b| !b.built) {
            let url = format!("{}://127.0.0.1:1/x", backend.schemes[0]);
            let error = backend.connect(&url).await.unwrap_err();
            assert!(
                matches!(&error, dlock_core::LockError::InvalidOptions { .. })
                    && error
                        .to_string()
                        .contains(&format!("feature `{}`", backend.feature)),
                "{error}"
            );
        }
    }
}
