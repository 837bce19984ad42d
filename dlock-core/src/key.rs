//! Lock keys: validated once, then cheap to clone.

use std::{borrow::Borrow, fmt, sync::Arc};

use crate::error::{LockError, Result};

/// A validated lock key.
///
/// Any non-empty UTF-8 string of at most [`LockKey::MAX_LEN`] bytes is a
/// valid key. Characters a server cannot store as-is (`/` and `..` in
/// ZooKeeper paths, control characters) are escaped by the backend, through
/// the one codec [`LockKey::escape_into`], so two
/// different keys never name the same lock.
///
/// # Examples
///
/// ```
/// use dlock_core::LockKey;
///
/// let key = LockKey::new("order:42").unwrap();
/// assert_eq!(key.as_str(), "order:42");
/// assert!(LockKey::new("").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(Arc<str>);

impl LockKey {
    /// The longest key accepted, in bytes.
    pub const MAX_LEN: usize = 1024;

    /// Validates `key`.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidKey`] if the key is empty or longer than
    /// [`LockKey::MAX_LEN`] bytes.
    pub fn new(key: impl AsRef<str>) -> Result<Self> {
        let key = key.as_ref();
        if key.is_empty() {
            return Err(LockError::invalid_key(key, "a lock key must not be empty"));
        }
        if key.len() > Self::MAX_LEN {
            return Err(LockError::invalid_key(
                key,
                "a lock key must be at most 1024 bytes long",
            ));
        }
        Ok(LockKey(Arc::from(key)))
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for LockKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl LockKey {
    /// Appends the key to `out` with every character for which `escape`
    /// is true, and every `%`, percent-encoded: each of the character's
    /// UTF-8 bytes as `%` and two uppercase hex digits.
    ///
    /// This is the one key codec every backend uses, each with the set of
    /// characters its server cannot take as they are. Because `%` is always
    /// escaped, the encoding is one-to-one whatever the set: two different
    /// keys never share a lock. A backend's set is part of its on-server
    /// format, and must never change: a key's name on the server would
    /// change with it.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::LockKey;
    ///
    /// let key = LockKey::new("order/{42}%").unwrap();
    /// let mut name = String::from("locks/");
    /// key.escape_into(&mut name, |c| c == '/');
    /// assert_eq!(name, "locks/order%2F{42}%25");
    ///
    /// // Everything but ASCII letters and digits, byte by byte:
    /// let mut strict = String::new();
    /// LockKey::new("é-1").unwrap().escape_into(&mut strict, |c| !c.is_ascii_alphanumeric());
    /// assert_eq!(strict, "%C3%A9%2D1");
    /// ```
    pub fn escape_into(&self, out: &mut String, escape: impl Fn(char) -> bool) {
        const HEX: &[u8; 16] = b"0123456789ABCDEF";
        let key = self.as_str();
        out.reserve(key.len());
        // Runs of characters kept as they are are copied whole.
        let mut kept = 0;
        for (at, c) in key.char_indices() {
            if c != '%' && !escape(c) {
                continue;
            }
            out.push_str(&key[kept..at]);
            let mut utf8 = [0u8; 4];
            for &b in c.encode_utf8(&mut utf8).as_bytes() {
                out.push('%');
                out.push(char::from(HEX[usize::from(b >> 4)]));
                out.push(char::from(HEX[usize::from(b & 0xF)]));
            }
            kept = at + c.len_utf8();
        }
        out.push_str(&key[kept..]);
    }

    /// The key escaped as [`escape_into`](LockKey::escape_into) does, as a
    /// new string.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::LockKey;
    ///
    /// let key = LockKey::new("a/b").unwrap();
    /// assert_eq!(key.escaped(|c| c == '/'), "a%2Fb");
    /// ```
    pub fn escaped(&self, escape: impl Fn(char) -> bool) -> String {
        let mut out = String::new();
        self.escape_into(&mut out, escape);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_empty_and_oversized_keys() {
        assert!(matches!(
            LockKey::new(""),
            Err(LockError::InvalidKey { .. })
        ));
        let long = "k".repeat(LockKey::MAX_LEN + 1);
        match LockKey::new(&long) {
            Err(LockError::InvalidKey { key, .. }) => assert!(key.chars().count() <= 65),
            other => panic!("expected InvalidKey, got {other:?}"),
        }
        assert!(LockKey::new("k".repeat(LockKey::MAX_LEN)).is_ok());
    }

    #[test]
    fn accepts_keys_backends_must_escape() {
        for key in ["a/b", "..", ".", "nul\0byte", "ключ", "🔒"] {
            assert_eq!(LockKey::new(key).unwrap().as_str(), key);
        }
    }

    /// Decodes what `escape_into` wrote: the test of one-to-one.
    fn unescape(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn escaping_round_trips_under_every_set() {
        let sets: [fn(char) -> bool; 4] = [
            |_| false,
            |c| c == '/',
            |c| !c.is_ascii_alphanumeric(),
            |_| true,
        ];
        for key in ["a", "%", "%25", "a/b", "ключ", "🔒/%", "nul\0byte", "{x}"] {
            for escape in sets {
                let escaped = LockKey::new(key).unwrap().escaped(escape);
                assert_eq!(unescape(&escaped), key, "{key} -> {escaped}");
                let left = |c: char| c != '%' && !c.is_ascii_hexdigit() && escape(c);
                assert!(!escaped.chars().any(left), "{key} -> {escaped}");
            }
        }
    }
}

/// A key as traces show it: itself, or `(hidden)` where the locker was
/// built with [`trace_keys(false)`](crate::LockerBuilder::trace_keys).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TracedKey<'a> {
    pub(crate) key: &'a LockKey,
    pub(crate) shown: bool,
}

impl std::fmt::Display for TracedKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.shown {
            std::fmt::Display::fmt(self.key, f)
        } else {
            f.write_str("(hidden)")
        }
    }
}
