//! Humane durations in attribute arguments: "500ms", "5s", "2m", "1h".

/// Milliseconds in `text`, or a message saying what to write instead.
pub(crate) fn parse_millis(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits = text.chars().take_while(char::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(malformed(text)),
    };
    let number: u64 = number.parse().map_err(|_| malformed(text))?;
    number
        .checked_mul(per_unit)
        .ok_or_else(|| format!("duration `{text}` is too long"))
}

fn malformed(text: &str) -> String {
    format!(
        "malformed duration `{text}`: write a whole number and a unit, such as \"500ms\", \"5s\", \"2m\" or \"1h\""
    )
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
            "99999999999999999999h",
            "18446744073709551615h",
        ] {
            let ours = parse_millis(text);
            let core = dlock_core::parse_duration(text);
            match (&ours, &core) {
                (Ok(ms), Ok(d)) => assert_eq!(u128::from(*ms), d.as_millis(), "{text:?}"),
                (Err(why), Err(dlock_core::LockError::InvalidOptions { reason })) => {
                    assert_eq!(why, reason, "{text:?}")
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
    }

    #[test]
    fn rejects_what_is_not_a_duration() {
        for bad in ["", "5", "s", "5 s", "1.5s", "-1s", "5sec", "ms5", "5S"] {
            let err = parse_millis(bad).unwrap_err();
            assert!(err.contains("malformed duration"), "{bad}: {err}");
        }
        assert!(parse_millis("99999999999999999999h").is_err());
    }
}
