//! Latency samples and their percentiles.

use std::time::Duration;

/// Sorted latency samples.
pub(crate) struct Samples(Vec<Duration>);

impl Samples {
    pub(crate) fn new(mut samples: Vec<Duration>) -> Samples {
        samples.sort();
        Samples(samples)
    }

    /// The `q` quantile (0.0..=1.0); zero with no samples.
    pub(crate) fn quantile(&self, q: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i.min(self.0.len() - 1)]
    }

    pub(crate) fn max(&self) -> Duration {
        self.0.last().copied().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_pick_the_nearest_rank() {
        let s = Samples::new((1..=100).rev().map(Duration::from_micros).collect());
        assert_eq!(s.quantile(0.5), Duration::from_micros(51));
        assert_eq!(s.quantile(0.99), Duration::from_micros(99));
        assert_eq!(s.max(), Duration::from_micros(100));
        assert_eq!(Samples::new(Vec::new()).quantile(0.5), Duration::ZERO);
    }
}
