//! Durations in attribute arguments, in the grammar of
//! `dlock_core::parse_duration` (humantime's: "500ms", "5s", "1m30s"),
//! checked at compile time.

/// Whole milliseconds in `text`, or a message saying what to write instead.
pub(crate) fn parse_millis(text: &str) -> Result<u64, String> {
    // The same wording as dlock-core's run-time parse (a test pins it).
    let duration = humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "malformed duration `{text}` ({e}): write numbers with units, such as \"500ms\", \"5s\" or \"1m30s\""
        )
    })?;
    if duration.subsec_nanos() % 1_000_000 != 0 {
        return Err(format!(
            "duration `{text}` is not a whole number of milliseconds"
        ));
    }
    u64::try_from(duration.as_millis()).map_err(|_| format!("duration `{text}` is too long"))
}

#[cfg(test)]
mod tests {
    use super::parse_millis;

    /// The one table both parsers run: the macro's compile-time copy must
    /// answer as `dlock_core::parse_duration` does, value and message.
    #[test]
    fn the_compile_time_copy_answers_as_dlock_core() {
        for text in [
            "0ms",
            "1ms",
            "250ms",
            "5s",
            "90s",
            "2m",
            "1h",
            "18446744073709551615ms",
            "",
            "5",
            "s",
            "5 s",
            " 5s ",
            "1.5s",
            "-1s",
            "5sec",
            "ms5",
            "5S",
            "1d",
            "1m30s",
            "1h 2m 3s",
            "2 minutes",
            "99999999999999999999h",
            "18446744073709551615h",
        ] {
            let ours = parse_millis(text);
            let core = dlock_core::parse_duration(text);
            match (&ours, &core) {
                (Ok(ms), Ok(d)) => assert_eq!(u128::from(*ms), d.as_millis(), "{text:?}"),
                (Err(why), Err(dlock_core::LockError::InvalidOptions { reason })) => {
                    assert_eq!(why, &reason.to_string(), "{text:?}")
                }
                _ => panic!("{text:?}: the macro says {ours:?}, dlock_core {core:?}"),
            }
        }
    }

    #[test]
    fn parses_each_unit() {
        assert_eq!(parse_millis("250ms"), Ok(250));
        assert_eq!(parse_millis("5s"), Ok(5_000));
        assert_eq!(parse_millis("2m"), Ok(120_000));
        assert_eq!(parse_millis("1h"), Ok(3_600_000));
        assert_eq!(parse_millis("0s"), Ok(0));
        assert_eq!(parse_millis("1m30s"), Ok(90_000));
        assert!(parse_millis("1500us")
            .unwrap_err()
            .contains("whole number of milliseconds"));
    }

    #[test]
    fn rejects_what_is_not_a_duration() {
        for bad in ["", "5", "s", "-1s", "ms5", "5 parsecs"] {
            let err = parse_millis(bad).unwrap_err();
            assert!(err.contains("malformed duration"), "{bad}: {err}");
        }
        assert!(parse_millis("99999999999999999999h").is_err());
    }
}
