//! Owner tokens: the unique identity of one acquisition.

use std::{
    collections::hash_map::RandomState,
    fmt,
    hash::{BuildHasher, Hasher},
    sync::{
        atomic::{AtomicU64, Ordering},
        OnceLock,
    },
    time::{SystemTime, UNIX_EPOCH},
};

/// The unique identity of one acquisition.
///
/// The server stores it with the lock, and release and renewal compare it
/// atomically there, so a stale guard can never release or extend a lock that
/// another owner holds now. A token is 128 bits: 64 bits chosen at random once
/// per process (from the operating system's randomness, through
/// [`RandomState`]) and a 64-bit counter, so tokens never repeat within a
/// process and collide across processes with probability 2⁻⁶⁴ per pair.
///
/// # Examples
///
/// ```
/// use dlock_core::Token;
///
/// let a = Token::generate();
/// let b = Token::generate();
/// assert_ne!(a, b);
/// assert_eq!(a.to_string().len(), 32);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token([u8; 16]);

impl Token {
    /// A new token, different from every other token of this process.
    pub fn generate() -> Token {
        static PROCESS: OnceLock<u64> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let process = *PROCESS.get_or_init(|| {
            let mut h = RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            h.write_u128(now.as_nanos());
            h.finish()
        });
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&process.to_be_bytes());
        bytes[8..].copy_from_slice(&count.to_be_bytes());
        Token(bytes)
    }

    /// The token's 16 bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Rebuilds a token from its bytes, as a backend reads it back.
    pub fn from_bytes(bytes: [u8; 16]) -> Token {
        Token(bytes)
    }
}

impl fmt::Display for Token {
    /// 32 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn tokens_are_unique_across_threads() {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| (0..1000).map(|_| Token::generate()).collect::<Vec<_>>())
            })
            .collect();
        let mut seen = HashSet::new();
        for h in handles {
            for t in h.join().unwrap() {
                assert!(seen.insert(t), "token {t} generated twice");
            }
        }
        assert_eq!(seen.len(), 4000);
    }

    #[test]
    fn display_round_trips_through_bytes() {
        let t = Token::generate();
        assert_eq!(Token::from_bytes(*t.as_bytes()), t);
        assert!(t.to_string().chars().all(|c| c.is_ascii_hexdigit()));
    }
}
