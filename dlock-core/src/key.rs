//! Lock keys: validated once, then cheap to clone.

use std::{borrow::Borrow, fmt, sync::Arc};

use crate::error::{LockError, Result};

/// A validated lock key.
///
/// Any non-empty UTF-8 string of at most [`LockKey::MAX_LEN`] bytes is a
/// valid key. Characters a server cannot store as-is (`/` and `..` in
/// ZooKeeper paths, control characters) are escaped by the backend, so two
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
}
