//! Tests of the module above.
use super::*;

#[test]
fn redacts_only_the_password() {
    for (url, shown) in [
        ("redis://u:p@h:1/2?prefix=x", "redis://u:***@h:1/2?prefix=x"),
        (
            "redis+redlock://:p@a:1,b:2,c:3",
            "redis+redlock://:***@a:1,b:2,c:3",
        ),
        ("etcd://u:p%40q@h:1/x@y", "etcd://u:***@h:1/x@y"),
        ("etcd://u:a@b@h:1", "etcd://u:***@h:1"),
        ("redis://user@h:1", "redis://user@h:1"),
        ("redis://h:1/x:y@z", "redis://h:1/x:y@z"),
        ("not a url", "not a url"),
        // Unescaped `/`, `?`, `#` in a password.
        ("redis://u:pa/ss@h:1", "redis://u:***@h:1"),
        ("redis://:pa#ss@h", "redis://:***@h"),
        ("redis://u:p?w@h/0", "redis://u:***@h/0"),
        // Password parameters, however their names are escaped.
        (
            "redis+sentinel://s:1/m?sentinel_password=x&prefix=p",
            "redis+sentinel://s:1/m?sentinel_password=***&prefix=p",
        ),
        (
            "postgres://h/d?p%61ssword=x",
            "postgres://h/d?p%61ssword=***",
        ),
        (
            "postgres://h/d?sslPassword=x#f",
            "postgres://h/d?sslPassword=***#f",
        ),
        (
            "redis://u:p@h/?sentinel%5Fpassword=y",
            "redis://u:***@h/?sentinel%5Fpassword=***",
        ),
    ] {
        assert_eq!(redact_url(url), shown, "{url}");
    }
}

#[test]
fn splits_and_decodes_every_part() {
    let mut url = BackendUrl::parse(
        "Redis",
        "rediss+redlock://us%3Aer:p%40ss%2Fw%3Ad@a:1,[::1]:2,b.example/7?prefix=a%26b+c&tls_ca=%2Ftmp%2Fca.pem",
    )
    .unwrap();
    assert_eq!(url.scheme(), "rediss+redlock");
    assert_eq!(url.user(), Some("us:er"));
    assert_eq!(url.password(), Some("p@ss/w:d"));
    let hosts: Vec<String> = url.hosts().iter().map(ToString::to_string).collect();
    assert_eq!(hosts, ["a:1", "[::1]:2", "b.example"]);
    assert_eq!(url.path(), "7");
    assert_eq!(url.take("prefix").as_deref(), Some("a&b c"));
    let files = url.take_tls_files(true, "rediss").unwrap();
    assert_eq!(
        files.ca.as_deref(),
        Some(std::path::Path::new("/tmp/ca.pem"))
    );
    url.finish(&[]).unwrap();
    assert!(!format!("{url:?}").contains("p%40ss"));
    assert_eq!(
        url.base(),
        "rediss+redlock://us%3Aer:p%40ss%2Fw%3Ad@a:1,[::1]:2,b.example/7"
    );
}

#[test]
fn refuses_what_it_cannot_read() {
    for (url, why) in [
        ("no-scheme", "expected `scheme://"),
        ("redis://", "a host is missing"),
        ("redis://a:1,,b:2", "a host is missing"),
        ("redis://a:port", "not a host or host:port"),
        ("redis://a:70000", "not a host or host:port"),
        ("redis://a:", "not a host or host:port"),
        ("redis://[::1/x", "not a host or host:port"),
        ("redis://u:p%4@a", "the password has"),
        ("redis://a/x?p=1&p=2", "`p` is given twice"),
        ("redis://u:p@a/#frag", "a fragment"),
        ("zk://a:1/x/../y", "`.` or `..`"),
        ("zk://a:1/x/%2E%2e", "`.` or `..`"),
        ("redis://u:sec/ret@h", "holds a `/`, `?` or `#`"),
        ("redis://u:sec?ret@h", "holds a `/`, `?` or `#`"),
    ] {
        let err = BackendUrl::parse("test", url).unwrap_err().to_string();
        assert!(err.contains(why), "{url}: {err}");
        assert!(!err.contains("p@"), "{url}: {err}");
        assert!(!err.contains("sec") && !err.contains("ret"), "{url}: {err}");
    }
    let mut plain = BackendUrl::parse("test", "etcd://a:1?tls_ca=x").unwrap();
    let err = plain
        .take_tls_files(false, "etcds")
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs `etcds://`"), "{err}");
    let mut half = BackendUrl::parse("test", "etcds://a:1?tls_cert=x").unwrap();
    assert!(half.take_tls_files(true, "etcds").is_err());
    let mut late = BackendUrl::parse("test", "etcd://a:1?b=1&a=2").unwrap();
    assert_eq!(late.take("a").as_deref(), Some("2"));
    let err = late.finish(&["a", "c"]).unwrap_err().to_string();
    assert!(
        err.contains("unknown parameter `b`; the valid ones are `a`, `c`"),
        "{err}"
    );
}

#[test]
fn decodes_escapes_and_refuses_broken_ones() {
    assert_eq!(percent_decode("plain").unwrap(), "plain");
    assert_eq!(percent_decode("%E2%9C%93").unwrap(), "✓");
    for bad in ["%", "%g0", "%0", "%FF"] {
        assert!(percent_decode(bad).is_err(), "{bad}");
    }
}
