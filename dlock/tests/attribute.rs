//! `#[distributed_lock]` through the `dlock` crate: the attribute finds its
//! runtime under `dlock` in a crate that depends on `dlock`, and
//! `connect(url)` reaches each backend or names the feature it needs.

use dlock::{distributed_lock, InvalidReason, LockError};

#[distributed_lock(key = "job:{id}", wait = "1s")]
async fn job(id: u32) -> Result<u32, LockError> {
    Ok(id * 2)
}

#[tokio::test]
async fn the_attribute_runs_the_body_under_the_lock_through_dlock() {
    dlock::set_default_locker(dlock::connect("memory").await.unwrap());
    assert_eq!(job(21).await.unwrap(), 42);
}

/// Each scheme goes to its backend when its feature is on (a malformed URL
/// is then the backend's own error, before any connection), and is an
/// error that names the feature when it is off. `.ci/test` runs this file
/// with no feature, and the workspace run with all.
#[tokio::test]
async fn each_scheme_reaches_its_backend_or_names_its_feature() {
    for (url, feature, enabled) in [
        ("redis://h:port", "redis", cfg!(feature = "redis")),
        ("etcd://h:x", "etcd", cfg!(feature = "etcd")),
        ("zk://h", "zk", cfg!(feature = "zk")),
        (
            "postgres://h:port/db",
            "postgres",
            cfg!(feature = "postgres"),
        ),
        ("mysql://h:port/db", "mysql", cfg!(feature = "mysql")),
    ] {
        let err = dlock::connect(url).await.unwrap_err();
        let LockError::InvalidOptions { reason } = &err else {
            panic!("{url}: expected a typed InvalidOptions, got {err}");
        };
        let feature_off =
            matches!(reason, InvalidReason::FeatureOff { feature: f } if f == &feature);
        assert_eq!(feature_off, !enabled, "{url}: {reason}");
        assert_eq!(
            reason.to_string().contains(&format!("feature `{feature}`")),
            !enabled,
            "{url}: {reason}"
        );
    }
    let unknown = dlock::connect("ftp://user:s3cret@h/x").await.unwrap_err();
    assert!(
        matches!(
            &unknown,
            LockError::InvalidOptions {
                reason: InvalidReason::UnknownScheme { .. }
            }
        ) && unknown.to_string().contains("names no backend"),
        "{unknown}"
    );
    assert!(!unknown.to_string().contains("s3cret"), "{unknown}");
}
