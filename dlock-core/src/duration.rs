//! One grammar for durations written as text: a whole number and a unit,
//! `ms`, `s`, `m` or `h` ("500ms", "5s", "2m", "1h"). URL options parse
//! with it at run time; `#[distributed_lock(wait = "5s")]` keeps a
//! compile-time copy (dlock-macros cannot depend on dlock-core), pinned to
//! this one by a test that runs one table of inputs through both.

use std::time::Duration;

use crate::LockError;

/// The duration `text` says, or a message saying what to write instead.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
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
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration `{text}` is too long"))
}

fn malformed(text: &str) -> String {
    format!(
        "malformed duration `{text}`: write a whole number and a unit, such as \"500ms\", \"5s\", \"2m\" or \"1h\""
    )
}

/// Parses a duration written as a whole number and a unit: `ms`, `s`, `m`
/// or `h`, as the `#[distributed_lock]` attribute's `wait` and `lease` and
/// every backend URL's timeouts take them.
///
/// # Errors
///
/// [`LockError::InvalidOptions`] with a message saying what to write
/// instead.
///
/// # Examples
///
/// ```
/// use dlock_core::parse_duration;
/// use std::time::Duration;
///
/// assert_eq!(parse_duration("500ms")?, Duration::from_millis(500));
/// assert_eq!(parse_duration("2m")?, Duration::from_secs(120));
/// assert!(parse_duration("1.5s").is_err());
/// # Ok::<(), dlock_core::LockError>(())
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, LockError> {
    parse(text).map_err(LockError::invalid_options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_unit_and_rejects_the_rest() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        for bad in ["", "5", "s", "5 s", "1.5s", "-1s", "5sec", "ms5", "5S"] {
            assert!(
                parse(bad).unwrap_err().contains("malformed duration"),
                "{bad}"
            );
        }
        assert!(parse("99999999999999999999h").is_err());
    }
}
