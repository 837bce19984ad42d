//! Fault checks shared by the backends whose locks live on a client
//! session (etcd, ZooKeeper): a release cut off by the network, and a token
//! given up with [`Backend::abandon`].

use std::time::Duration;

use dlock_core::{backend::Backend, LockKey, LockOptions, Locker};
use tokio::time::Instant;

use crate::fixture::TcpProxy;

/// Drops a guard of `cut_off` (whose connections go through `proxy`)
/// while `proxy` is blocked for `cut`, then checks that
/// [`wait_for_releases`](Locker::wait_for_releases) waited through the cut,
/// and that `other` gets the key soon after the network is back (the
/// session outlives the cut, so without a release sent again it would hold
/// the key for as long as it lives).
///
/// # Panics
///
/// When a check fails.
pub async fn check_release_cut_off_then_back(
    cut_off: &Locker,
    other: &Locker,
    proxy: &TcpProxy,
    cut: Duration,
) {
    let guard = cut_off.lock("cut-release").await.unwrap();
    proxy.block();
    drop(guard);
    tokio::time::sleep(cut).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(100), cut_off.wait_for_releases())
            .await
            .is_err(),
        "wait_for_releases returned while the release could not be sent"
    );
    assert!(other.try_lock("cut-release").await.unwrap().is_none());

    proxy.unblock();
    let back = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), cut_off.wait_for_releases())
        .await
        .expect("the release was not retried to the end");
    let acquired = other
        .lock_with(
            "cut-release",
            LockOptions::new().wait(Duration::from_secs(3)),
        )
        .await
        .expect("the key stayed held after the network came back");
    println!("released {:?} after the network came back", back.elapsed());
    acquired.release().await.unwrap();
}

/// Abandons the token of one of two guards `locker` holds on `backend`,
/// then checks that both guards report lost, that `other` gets the key
/// within `ttl` (the session's lease or timeout) though its guard lives,
/// and that a later lock through `locker` is kept alive past `ttl`.
///
/// # Panics
///
/// When a check fails.
pub async fn check_abandon_gives_up_the_session(
    backend: &dyn Backend,
    locker: &Locker,
    other: &Locker,
    ttl: Duration,
) {
    let stuck = locker.lock("stuck").await.unwrap();
    let neighbour = locker.lock("neighbour").await.unwrap();

    let abandoned = Instant::now();
    backend
        .abandon(&LockKey::new("stuck").unwrap(), stuck.token())
        .await;
    assert!(stuck.is_lost(), "the abandoned guard still says it holds");
    assert!(
        neighbour.is_lost(),
        "a guard on the abandoned session still says it holds"
    );
    let acquired = other
        .lock_with("stuck", LockOptions::new().wait(ttl * 2))
        .await
        .expect("the abandoned key did not go");
    let gone_after = abandoned.elapsed();
    assert!(
        gone_after <= ttl + Duration::from_millis(500),
        "the abandoned key went only {gone_after:?} later"
    );
    acquired.release().await.unwrap();

    let fresh = locker.lock("fresh").await.unwrap();
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    assert!(
        !fresh.is_lost(),
        "a lock after the abandon was not kept alive"
    );
    assert!(other.try_lock("fresh").await.unwrap().is_none());
    drop((stuck, neighbour));
    fresh.release().await.unwrap();
}
