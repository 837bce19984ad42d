//! Which servers hold several named locks per session.

/// Whether a server of `version` (as `VERSION()` answers) holds several
/// named locks per session: MySQL 5.7 and later, MariaDB 10.0.2 and later.
/// On older ones a second `GET_LOCK` silently releases the first, so two
/// owners could hold a lock. A version this cannot read passes (forks
/// that report their own numbers).
pub(super) fn holds_several_locks(version: &str) -> Result<(), String> {
    // MariaDB may report `5.5.5-10.x.y-MariaDB` for old replication.
    let version = version.strip_prefix("5.5.5-").unwrap_or(version);
    let numbers: Vec<u32> = version
        .split(|c: char| !c.is_ascii_digit())
        .take(3)
        .map_while(|n| n.parse().ok())
        .collect();
    let [major, minor, patch] = numbers[..] else {
        return Ok(());
    };
    let (least, server) = if version.contains("MariaDB") {
        ((10, 0, 2), "MariaDB")
    } else {
        ((5, 7, 0), "MySQL")
    };
    if (major, minor, patch) >= least {
        Ok(())
    } else {
        Err(format!(
            "{server} {major}.{minor}.{patch} holds one named lock per session (a second \
             GET_LOCK releases the first), so two owners could hold a lock: dlock needs \
             MySQL 5.7 or later, or MariaDB 10.0.2 or later"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_that_hold_one_lock_per_session_are_refused() {
        for ok in [
            "5.7.0",
            "8.0.36",
            "8.4.0-log",
            "10.0.2-MariaDB",
            "10.11.6-MariaDB-0+deb12u1",
            "5.5.5-10.6.16-MariaDB",
            "unknown",
        ] {
            assert_eq!(holds_several_locks(ok), Ok(()), "{ok}");
        }
        for refused in [
            "5.6.51",
            "5.5.62-log",
            "10.0.1-MariaDB",
            "5.5.5-10.0.1-MariaDB",
        ] {
            let why = holds_several_locks(refused).unwrap_err();
            assert!(
                why.contains("one named lock per session"),
                "{refused}: {why}"
            );
        }
    }
}
