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
