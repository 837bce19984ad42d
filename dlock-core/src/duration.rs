//! One grammar for durations written as text, humantime's: numbers with
//! units, written together or apart ("500ms", "5s", "1m30s", "2 minutes").
//! URL options parse with it at run time; `#[distributed_lock(wait = "5s")]`
//! checks with the same crate at compile time (dlock-macros cannot depend
//! on dlock-core), pinned to this wording by a test that runs one table of
//! inputs through both.

use std::time::Duration;

use crate::LockError;

/// The duration `text` says, or a message saying what to write instead.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    parse_typed(text).map_err(|reason| reason.to_string())
}

fn parse_typed(text: &str) -> Result<Duration, crate::InvalidReason> {
    humantime::parse_duration(text.trim()).map_err(|e| crate::InvalidReason::Duration {
        text: text.to_owned(),
        problem: e.to_string(),
    })
}

/// Parses a duration in humantime's grammar (numbers with units:
/// `500ms`, `5s`, `1m30s`, `2h`, `1 day`), as the `#[distributed_lock]`
/// attribute's `wait` and `lease` and every backend URL's timeouts take
/// them.
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
/// assert_eq!(parse_duration("1m30s")?, Duration::from_secs(90));
/// assert_eq!(parse_duration("1.5s")?, Duration::from_millis(1500));
/// assert!(parse_duration("5").is_err());
/// # Ok::<(), dlock_core::LockError>(())
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, LockError> {
    parse_typed(text).map_err(LockError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_unit_and_rejects_the_rest() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("1m 30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in ["", "5", "s", "-1s", "ms5", "5 parsecs"] {
            assert!(
                parse(bad).unwrap_err().contains("malformed duration"),
                "{bad}"
            );
        }
        assert!(parse("99999999999999999999h").is_err());
    }
}
