//! A small seeded random generator, so a failing run can be replayed.

use std::time::{SystemTime, UNIX_EPOCH};

/// xorshift64*: not for cryptography, only for picking test timings.
///
/// # Examples
///
/// ```
/// use dlock_testkit::Rng;
///
/// let mut a = Rng::with_seed(7);
/// let mut b = Rng::with_seed(7);
/// assert_eq!(a.below(100), b.below(100));
/// ```
#[derive(Debug, Clone)]
pub struct Rng {
    seed: u64,
    state: u64,
}

impl Rng {
    /// Seeded from `DLOCK_TEST_SEED` if set, else from the clock.
    pub fn from_env() -> Rng {
        let seed = std::env::var("DLOCK_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        Rng::with_seed(seed)
    }

    /// A generator with this seed.
    pub fn with_seed(seed: u64) -> Rng {
        Rng {
            seed,
            state: seed.max(1),
        }
    }

    /// The seed, to print with a failure (`DLOCK_TEST_SEED=<seed>` replays it).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}
