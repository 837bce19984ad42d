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
/// another owner holds now. A token is 128 bits from the operating system's
/// random numbers (`getrandom`), so two tokens collide, within a process or
/// across processes and machines, with probability 2⁻¹²⁸ per pair. Should
/// the operating system not answer, the token is a per-process random
/// prefix and a counter instead (unique within the process, colliding
/// across processes with probability 2⁻⁶⁴ per pair).
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
    /// A new token: 128 random bits.
    pub fn generate() -> Token {
        let mut bytes = [0u8; 16];
        if getrandom::fill(&mut bytes).is_ok() {
            return Token(bytes);
        }
        Token::counted()
    }

    /// A per-process random prefix and a counter: the fallback when the
    /// operating system's random numbers are out of reach.
    fn counted() -> Token {
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

impl Token {
    /// The token as 32 lowercase hex digits, without allocating: the form
    /// backends send (the `Display` form too).
    ///
    /// # Examples
    ///
    /// ```
    /// let token = dlock_core::Token::generate();
    /// assert_eq!(token.to_hex().as_str(), token.to_string());
    /// ```
    pub fn to_hex(&self) -> TokenHex {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 32];
        for (i, b) in self.0.iter().enumerate() {
            hex[2 * i] = DIGITS[usize::from(b >> 4)];
            hex[2 * i + 1] = DIGITS[usize::from(b & 0x0f)];
        }
        TokenHex(hex)
    }
}

/// A [`Token`]'s 32 hex digits, on the stack (see [`Token::to_hex`]).
///
/// # Examples
///
/// ```
/// let token = dlock_core::Token::from_bytes([0xab; 16]);
/// let hex = token.to_hex();
/// assert_eq!(hex.as_str(), "ab".repeat(16));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenHex([u8; 32]);

impl TokenHex {
    /// The digits.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl fmt::Debug for TokenHex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Token {
    /// 32 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.to_hex().as_str())
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

    /// Every bit is random: no part is shared by the tokens of a process
    /// (a per-process prefix and a counter would be), so guessing another
    /// owner's token is as hard as guessing 128 random bits.
    #[test]
    fn tokens_share_no_prefix_and_no_counter() {
        let tokens: Vec<Token> = (0..64).map(|_| Token::generate()).collect();
        let halves = |range: std::ops::Range<usize>| {
            tokens
                .iter()
                .map(|t| t.as_bytes()[range.clone()].to_vec())
                .collect::<HashSet<_>>()
                .len()
        };
        assert_eq!(halves(0..8), 64, "tokens share their first half");
        // A counter's high bytes stay zero.
        assert!(
            tokens.iter().any(|t| t.as_bytes()[8..12] != [0; 4]),
            "the second half counts"
        );
    }

    #[test]
    fn counted_tokens_are_unique_too() {
        let tokens: HashSet<Token> = (0..1000).map(|_| Token::counted()).collect();
        assert_eq!(tokens.len(), 1000);
    }

    #[test]
    fn display_round_trips_through_bytes() {
        let t = Token::generate();
        assert_eq!(Token::from_bytes(*t.as_bytes()), t);
        assert!(t.to_string().chars().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn hex_is_the_bytes_in_order_lowercase() {
        let mut bytes = [0u8; 16];
        bytes[0] = 0x0a;
        bytes[1] = 0xf0;
        bytes[15] = 0xff;
        let t = Token::from_bytes(bytes);
        assert_eq!(t.to_string(), "0af000000000000000000000000000ff");
        assert_eq!(t.to_hex().as_str(), t.to_string());
        assert_eq!(format!("{t:>34}"), format!("  {t}"), "padding is honoured");
    }
}
