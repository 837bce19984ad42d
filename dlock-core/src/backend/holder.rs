//! A key's holder, as [`Backend::holder`] reads it, and the defaults of
//! the holder methods.

use std::time::Duration;

#[cfg(doc)]
use super::Backend;

/// How often [`Backend::holder_changed`]'s default reads the holder again.
pub const HOLDER_POLL: Duration = Duration::from_millis(500);

/// What [`Backend::proclaim`] and [`Backend::holder`] answer by default,
/// and a backend that can read holders in some setups only answers in the
/// others.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::unsupported_holder, LockError};
///
/// assert!(matches!(unsupported_holder("redis"), LockError::Unsupported { .. }));
/// ```
pub fn unsupported_holder(backend: &'static str) -> crate::LockError {
    crate::LockError::Unsupported {
        backend,
        what: "publishing and reading a lock's holder (proclaim, holder)",
    }
}

/// The holder of a key's exclusive lock, as [`Backend::holder`] reads it.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Holder;
///
/// let holder = Holder::new(Some(7), Some(b"node-a".to_vec()));
/// assert_eq!(holder.fence(), Some(7));
/// assert_eq!(holder.value(), Some(&b"node-a"[..]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    fence: Option<u64>,
    value: Option<Vec<u8>>,
}

impl Holder {
    /// A holder with fencing token `fence`, that proclaimed `value`.
    pub fn new(fence: Option<u64>, value: Option<Vec<u8>>) -> Self {
        Holder { fence, value }
    }

    /// The holder's fencing token; `None` on a backend that records a
    /// holder's token only when it proclaims (the SQL backends: writing it
    /// at every acquisition would cost every lock a write).
    pub fn fence(&self) -> Option<u64> {
        self.fence
    }

    /// What the holder proclaimed, if it has yet.
    pub fn value(&self) -> Option<&[u8]> {
        self.value.as_deref()
    }

    /// What the holder proclaimed, owned.
    pub fn into_value(self) -> Option<Vec<u8>> {
        self.value
    }
}
