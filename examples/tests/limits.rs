//! The worker pool never exceeds its permits and the config cache never
//! shows a refresh half-way, on the in-process backend and on real servers
//! (where the backend has the primitive; elsewhere a typed error).

use dlock::{BackendExt, LockError, Locker, MemoryBackend};
use dlock_examples::limits::{run_config, run_pool};

fn clients(server: &MemoryBackend, n: usize) -> Vec<Locker> {
    (0..n).map(|_| server.clone().into_locker()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_keeps_its_limit_and_the_cache_is_never_torn_in_process() {
    let server = MemoryBackend::new();
    let pool = run_pool(&clients(&server, 3), "pool", 3, 4, 10)
        .await
        .unwrap();
    assert_eq!(pool.calls, 120);
    assert!(pool.most_at_once <= 3, "{pool:?}");
    assert!(
        pool.most_at_once >= 2,
        "the permits never ran together: {pool:?}"
    );
    let lockers = clients(&server, 3);
    let config = run_config(&lockers, "config", 4, 20, 10).await.unwrap();
    assert_eq!((config.refreshes, config.torn), (10, 0), "{config:?}");
    // Guards dropped in the cache release in the background.
    for locker in &lockers {
        locker.wait_for_releases().await;
    }
    assert!(server.is_idle(), "something was left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "redis")]
async fn the_pool_and_the_cache_on_one_redis_node() {
    let server = dlock_testkit::fixture::RedisServer::start().expect("redis-server");
    pool_and_cache_on(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "redis")]
async fn a_backend_without_the_primitives_says_so() {
    let servers = dlock_testkit::fixture::RedisServer::start_many(3).expect("redis-server");
    let url = dlock_testkit::fixture::RedisServer::redlock_url(&servers);
    let locker = dlock::redis::RedisBackend::connect(&url)
        .await
        .unwrap()
        .into_locker();
    let lockers = vec![locker];
    assert!(matches!(
        run_pool(&lockers, "pool", 2, 1, 1).await,
        Err(LockError::Unsupported { .. })
    ));
    assert!(matches!(
        run_config(&lockers, "config", 1, 1, 1).await,
        Err(LockError::Unsupported { .. })
    ));
}

/// The pool and the cache through three clients of the server at `url`.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
async fn pool_and_cache_on(url: &str) {
    let mut lockers = Vec::new();
    for _ in 0..3 {
        let client = dlock_testkit::connect(url).await.unwrap();
        lockers.push(Locker::from_arc(client));
    }
    let pool = run_pool(&lockers, "pool", 3, 4, 10).await.unwrap();
    assert_eq!(pool.calls, 120);
    assert!(pool.most_at_once <= 3, "{pool:?}");
    let config = run_config(&lockers, "config", 4, 20, 10).await.unwrap();
    assert_eq!((config.refreshes, config.torn), (10, 0), "{config:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "postgres")]
async fn the_pool_and_the_cache_on_postgres() {
    let server = dlock_testkit::fixture::PostgresServer::start().expect("postgres");
    pool_and_cache_on(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "mysql")]
async fn the_pool_and_the_cache_on_mariadb() {
    let server = dlock_testkit::fixture::MariaDbServer::start().expect("MariaDB");
    pool_and_cache_on(&server.url()).await;
}
