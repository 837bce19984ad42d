//! The one backoff every retry loop of dlock uses.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Exponential backoff with jitter, for the retry loops of dlock and its
/// backends: delays double from `first` up to `cap`, and each is drawn
/// from `[d, 2d)` around its step `d` (backon's jitter), so that clients
/// that failed together do not retry together. [`reset`](Backoff::reset)
/// after a success.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Backoff;
/// use std::time::Duration;
///
/// let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
/// let first = backoff.next_delay();
/// assert!(first >= Duration::from_millis(50) && first < Duration::from_millis(100));
/// for _ in 0..20 {
///     assert!(backoff.next_delay() < Duration::from_secs(4));
/// }
/// backoff.reset();
/// assert!(backoff.next_delay() < Duration::from_millis(100));
/// ```
#[derive(Debug)]
pub struct Backoff {
    builder: ExponentialBuilder,
    delays: ExponentialBackoff,
}

impl Backoff {
    /// Delays from `first`, doubling, up to `cap` (before jitter).
    pub fn new(first: Duration, cap: Duration) -> Backoff {
        let builder = ExponentialBuilder::new()
            .with_min_delay(first)
            .with_max_delay(cap.max(first))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times();
        Backoff {
            delays: builder.build(),
            builder,
        }
    }

    /// The next delay to wait before trying again.
    pub fn next_delay(&mut self) -> Duration {
        self.delays
            .next()
            .unwrap_or_else(|| self.builder.build().next().unwrap_or_default())
    }

    /// Starts again from the first delay, after a success.
    pub fn reset(&mut self) {
        self.delays = self.builder.build();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Clients that failed together do not retry together: their first
    /// delays differ, and every delay stays within its step's `[d, 2d)`.
    #[test]
    fn delays_are_jittered_within_their_step() {
        let (first, cap) = (Duration::from_millis(50), Duration::from_millis(400));
        let firsts: HashSet<Duration> = (0..32)
            .map(|_| Backoff::new(first, cap).next_delay())
            .collect();
        assert!(firsts.len() > 16, "32 clients' first delays: {firsts:?}");
        let mut backoff = Backoff::new(first, cap);
        let mut step = first;
        for _ in 0..8 {
            let delay = backoff.next_delay();
            assert!(
                step <= delay && delay < step * 2,
                "{delay:?} for step {step:?}"
            );
            step = (step * 2).min(cap);
        }
    }
}
