//! Tests of the module above.
use super::*;

#[test]
fn parses_single_nodes_with_auth_and_db() {
    let c = RedisConfig::from_url("redis://user:pw@host:6380/3").unwrap();
    assert_eq!(c.nodes(), ["redis://user:pw@host:6380/3"]);
    assert!(!c.is_redlock());
    assert_eq!(c.prefix(), "dlock");
    let c = RedisConfig::from_url("redis://[::1]:6379").unwrap();
    assert_eq!(c.nodes(), ["redis://[::1]:6379"]);
}

#[test]
fn sentinel_urls_name_the_master_and_keep_every_password_out_of_sight() {
    let c = RedisConfig::from_url(
        "redis+sentinel://app:pw%40x@s1:26379,s2:26380/orders/2\
         ?sentinel_user=watch&sentinel_password=spw&prefix=p",
    )
    .unwrap();
    assert!(c.is_sentinel() && !c.is_redlock() && !c.is_cluster());
    assert_eq!(c.nodes(), ["redis://s1:26379", "redis://s2:26380"]);
    let target = c.sentinel().unwrap();
    assert_eq!((target.master.as_str(), target.db), ("orders", 2));
    assert_eq!(target.user.as_deref(), Some("app"));
    assert_eq!(target.password.as_deref(), Some("pw@x"));
    assert_eq!(target.sentinel_user.as_deref(), Some("watch"));
    assert_eq!(target.sentinel_password.as_deref(), Some("spw"));
    assert_eq!(c.prefix(), "p");
    let shown = format!("{c:?}");
    assert!(!shown.contains("pw@x") && !shown.contains("spw"), "{shown}");
    assert!(c.sentinel_client().unwrap().is_some());
    let one = RedisConfig::from_url("redis+sentinel://s1:26379/m").unwrap();
    assert_eq!(one.sentinel().unwrap().db, 0);
    for (url, says) in [
        ("redis+sentinel://s1:26379", "no master name"),
        ("redis+sentinel://s1:26379/", "no master name"),
        ("redis+sentinel://s1:26379/m/x", "is not a number"),
        ("redis://h:1?sentinel_password=x", "unknown parameter"),
    ] {
        let e = RedisConfig::from_url(url).unwrap_err().to_string();
        assert!(e.contains(says), "{url}: {e}");
    }
    // A bad URL's error shows neither password.
    let e = RedisConfig::from_url("redis+sentinel://u:upw@s:1/m?sentinel_password=spw&x=1")
        .unwrap_err()
        .to_string();
    assert!(!e.contains("upw") && !e.contains("spw"), "{e}");
}

#[test]
fn percent_encoded_parts_are_decoded() {
    // The node URL keeps the user info encoded: the Redis client
    // decodes it (and a decoded `@` or `:` would break the URL).
    let c = RedisConfig::from_url(
        "redis://us%40er:p%3Aw%2F@h:1/0?prefix=app%3Ablue&response_timeout=1m30s",
    )
    .unwrap();
    assert_eq!(c.nodes(), ["redis://us%40er:p%3Aw%2F@h:1/0"]);
    assert_eq!(c.prefix(), "app:blue");
    assert_eq!(c.response_timeout(), Duration::from_secs(90));
}

#[test]
fn parses_cluster_seed_lists() {
    let c = RedisConfig::from_url("redis+cluster://:pw@a:1,b:2?prefix=x").unwrap();
    assert_eq!(c.nodes(), ["redis://:pw@a:1", "redis://:pw@b:2"]);
    assert!(c.is_cluster() && !c.is_redlock());
    assert!(RedisConfig::from_url("redis+cluster://a:1")
        .unwrap()
        .is_cluster());
    for (url, why) in [
        ("redis+cluster://a:1,b:2/3", "only database 0"),
        ("redis://a:1,b:2", "redis+cluster://"),
    ] {
        let error = RedisConfig::from_url(url).unwrap_err().to_string();
        assert!(error.contains(why), "{url}: {error}");
    }
}

#[test]
fn parses_redlock_node_lists() {
    let c = RedisConfig::from_url("redis+redlock://:pw@a:1,b:2,c:3/1?prefix=x").unwrap();
    assert_eq!(
        c.nodes(),
        [
            "redis://:pw@a:1/1",
            "redis://:pw@b:2/1",
            "redis://:pw@c:3/1"
        ]
    );
    assert!(c.is_redlock());
    assert_eq!(c.prefix(), "x");
}

#[test]
fn fences_are_on_but_on_redlock_and_can_be_turned_off() {
    let on = RedisConfig::from_url("redis://h:1").unwrap();
    assert!(on.fences());
    assert!(RedisConfig::from_url("redis://h:1?fence=on")
        .unwrap()
        .fences());
    assert!(!RedisConfig::from_url("redis://h:1?fence=off")
        .unwrap()
        .fences());
    assert!(!RedisConfig::from_url("redis+cluster://h:1,i:2?fence=off")
        .unwrap()
        .fences());
    assert!(!on.with_fences(false).fences());
    let redlock = RedisConfig::from_url("redis+redlock://a:1,b:2,c:3").unwrap();
    assert!(!redlock.fences() && !redlock.with_fences(true).fences());
    for (bad, why) in [
        (
            "redis+redlock://a:1,b:2,c:3?fence=on",
            "Redlock gives no fencing tokens",
        ),
        ("redis://h:1?fence=yes", "`fence=yes` is not on or off"),
    ] {
        let e = RedisConfig::from_url(bad).unwrap_err().to_string();
        assert!(e.contains(why), "{bad}: {e}");
    }
}

#[test]
fn fair_is_the_default_and_a_bad_value_is_refused_typed() {
    assert!(RedisConfig::from_url("redis://h:1").unwrap().fair());
    assert!(RedisConfig::from_url("redis://h:1?fair=true")
        .unwrap()
        .fair());
    for url in [
        "redis://h:1?fair=false",
        "redis+redlock://a:1,b:2,c:3?fair=false",
        "redis+cluster://h:1,i:2?fair=false&fence=off",
    ] {
        assert!(!RedisConfig::from_url(url).unwrap().fair(), "{url}");
    }
    let e = RedisConfig::from_url("redis://h:1?fair=off").unwrap_err();
    assert!(
        matches!(e, dlock_core::LockError::InvalidOptions { .. })
            && e.to_string().contains("`fair=off` is not true or false"),
        "{e}"
    );
}

#[test]
fn never_prints_a_password() {
    let c = RedisConfig::from_url("redis+redlock://app:s3cr%40t@a:1,b:2,c:3/1").unwrap();
    let shown = format!("{c:?}");
    assert!(
        !shown.contains("s3cr") && shown.contains("app:***@a:1"),
        "{shown}"
    );
    for bad in [
        "redis://app:s3cret@h:port",
        "redis://:s3cret@a:1,b:2",
        "redis+redlock://:s3cret@a:1,a:1,b:2",
        "rediss+cluster://:s3cret@h:1/2",
        "redis://:s3cret@h:1?bad=1",
        "redis://:s3cret@h:1?fair=maybe",
        "redis://:s3cret@h:1/x",
    ] {
        let e = RedisConfig::from_url(bad).unwrap_err();
        for shown in [e.to_string(), format!("{e:?}")] {
            assert!(!shown.contains("s3cr"), "{bad}: {shown}");
        }
    }
}

#[test]
#[cfg(feature = "tls")]
fn tls_parameters_need_each_other() {
    let c = RedisConfig::from_url("rediss+redlock://a:1,b:1,c:1/?tls_ca=ca.pem").unwrap();
    assert!(c.is_tls() && c.nodes().iter().all(|n| n.starts_with("rediss://")));
    let c = RedisConfig::from_url("rediss+cluster://a:1,b:1/?tls_ca=ca.pem").unwrap();
    assert!(c.is_tls() && c.is_cluster());
    assert!(c.nodes().iter().all(|n| n.starts_with("rediss://")));
    let error = RedisConfig::from_url("rediss://h:1?tls_cert=c.pem").unwrap_err();
    assert!(error.to_string().contains("both `tls_cert` and `tls_key`"));
}

#[test]
#[cfg(not(feature = "tls"))]
fn tls_without_the_feature_names_it() {
    let error = RedisConfig::from_url("rediss://h:1")
        .unwrap_err()
        .to_string();
    assert!(error.contains("`tls` feature"), "{error}");
}

#[test]
fn rejects_malformed_urls_with_a_reason() {
    for (url, says) in [
        ("localhost:6379", "expected `scheme://"),
        ("http://h", "unknown scheme"),
        ("redis://h:1?tls_ca=ca.pem", "needs `rediss://`"),
        ("redis://", "host is missing"),
        ("redis://h:port", "not a host or host:port"),
        ("redis://h:99999", "not a host or host:port"),
        ("redis://h/db", "not a number"),
        (
            "redis://h?timeout=1",
            "unknown parameter `timeout`; the valid ones are `prefix`, `connect_timeout`",
        ),
        ("redis://h?prefix=", "the prefix is empty"),
        ("redis://:p%zz@h", "the password has"),
        ("redis://a,b", "redis+redlock"),
        ("redis+redlock://a,b", "three"),
        ("redis+redlock://a,,b,c", "host is missing"),
        ("redis+redlock://a:1,b:1,a:1", "listed twice"),
        ("redis://h?prefix=app{1}", "may not contain `{`"),
        ("redis+cluster://h?prefix=a}b", "may not contain `{`"),
    ] {
        match RedisConfig::from_url(url) {
            Err(LockError::InvalidOptions { reason }) => {
                assert!(reason.to_string().contains(says), "{url}: {reason}")
            }
            other => panic!("{url}: {other:?}"),
        }
    }
}

#[test]
fn wait_replicas_needs_a_count_a_short_timeout_and_one_master() {
    let c = RedisConfig::from_url("redis://h:1?wait_replicas=2").unwrap();
    assert_eq!(c.wait_replicas(), Some((2, Duration::from_millis(100))));
    for (url, says) in [
        ("redis://h:1?wait_replicas=0", "positive number"),
        ("redis://h:1?wait_replicas=x", "positive number"),
        ("redis://h:1?wait_timeout=1s", "needs `wait_replicas`"),
        ("redis://h:1?wait_replicas=1&wait_timeout=0s", "above zero"),
        (
            "redis://h:1?wait_replicas=1&wait_timeout=5s",
            "below `response_timeout`",
        ),
        (
            "redis+cluster://a:1,b:2?wait_replicas=1",
            "one node or Sentinel",
        ),
        (
            "redis+redlock://a:1,b:2,c:3?wait_replicas=1",
            "one node or Sentinel",
        ),
    ] {
        let error = RedisConfig::from_url(url).unwrap_err().to_string();
        assert!(error.contains(says), "{url}: {error}");
    }
}
