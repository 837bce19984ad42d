//! A key's holder, as [`Backend::holder`] and [`Backend::list`] read it,
//! the note every lock carries, and the defaults of the holder methods.

use std::{fmt, sync::OnceLock, time::Duration};

#[cfg(doc)]
use super::Backend;
use super::Mode;

/// How often [`Backend::holder_changed`]'s default reads the holder again.
pub const HOLDER_POLL: Duration = Duration::from_millis(500);

/// The longest [`HolderNote`], in bytes.
pub const MAX_HOLDER_NOTE: usize = 128;

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

/// A short text stored with every grant, so that an operator who reads a
/// key's [`Holder`] or [lists](crate::Locker::list) the held locks sees
/// who took it: by default `HOSTNAME:PID` ([`HolderNote::process`]), or
/// what [`LockOptions::holder_note`](crate::LockOptions::holder_note)
/// says. At most [`MAX_HOLDER_NOTE`] bytes.
///
/// It is kept inline (no allocation) so that
/// [`LockOptions`](crate::LockOptions) stays `Copy`.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::{HolderNote, MAX_HOLDER_NOTE};
///
/// let note = HolderNote::new("deploy #42")?;
/// assert_eq!(note.as_str(), "deploy #42");
/// assert!(HolderNote::new("x".repeat(MAX_HOLDER_NOTE + 1)).is_err());
/// assert!(HolderNote::process().as_str().contains(':'));
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct HolderNote {
    len: u8,
    bytes: [u8; MAX_HOLDER_NOTE],
}

impl HolderNote {
    /// `note`, if it is at most [`MAX_HOLDER_NOTE`] bytes.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](crate::LockError::InvalidOptions)
    /// ([`InvalidReason::HolderNote`](crate::InvalidReason::HolderNote))
    /// for a longer one.
    pub fn new(note: impl AsRef<str>) -> crate::Result<HolderNote> {
        let note = note.as_ref();
        if note.len() > MAX_HOLDER_NOTE {
            return Err(crate::InvalidReason::HolderNote {
                len: note.len(),
                max: MAX_HOLDER_NOTE,
            }
            .into());
        }
        let mut bytes = [0; MAX_HOLDER_NOTE];
        bytes[..note.len()].copy_from_slice(note.as_bytes());
        Ok(HolderNote {
            len: note.len() as u8,
            bytes,
        })
    }

    /// This process's note, `HOSTNAME:PID` (the host name from
    /// `/proc/sys/kernel/hostname`, else `$HOSTNAME`, else `unknown`),
    /// worked out once per process.
    pub fn process() -> HolderNote {
        static NOTE: OnceLock<HolderNote> = OnceLock::new();
        *NOTE.get_or_init(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "unknown".to_owned());
            let pid = format!(":{}", std::process::id());
            let mut cut = host.len().min(MAX_HOLDER_NOTE - pid.len());
            while !host.is_char_boundary(cut) {
                cut -= 1;
            }
            HolderNote::new(format!("{}{pid}", &host[..cut])).unwrap_or(HolderNote {
                len: 0,
                bytes: [0; MAX_HOLDER_NOTE],
            })
        })
    }

    /// The note.
    pub fn as_str(&self) -> &str {
        // Built from a `&str` only, and never cut.
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl fmt::Debug for HolderNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for HolderNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One holder of a key, as [`Backend::holder`] and [`Backend::list`] read
/// it: what the backend knows of the grant, each part `None` where it does
/// not.
///
/// Two holders are equal when they are the same grant saying the same
/// things (fence, mode, note, proclaimed value): the age and the lease
/// left are when it was read, and do not count.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use dlock_core::backend::{Holder, Mode};
///
/// let holder = Holder::new(Some(7), Some(b"node-a".to_vec()))
///     .with_note("web-3:4242")
///     .with_mode(Mode::Exclusive)
///     .with_age(Duration::from_secs(3));
/// assert_eq!(holder.fence(), Some(7));
/// assert_eq!(holder.value(), Some(&b"node-a"[..]));
/// assert_eq!(holder.note(), Some("web-3:4242"));
/// assert_eq!(holder, Holder::new(Some(7), Some(b"node-a".to_vec()))
///     .with_note("web-3:4242")
///     .with_mode(Mode::Exclusive));
/// ```
#[derive(Debug, Clone, Eq)]
pub struct Holder {
    fence: Option<u64>,
    value: Option<Vec<u8>>,
    note: Option<String>,
    mode: Option<Mode>,
    age: Option<Duration>,
    lease_left: Option<Duration>,
}

impl PartialEq for Holder {
    fn eq(&self, other: &Holder) -> bool {
        (self.fence, &self.value, &self.note, self.mode)
            == (other.fence, &other.value, &other.note, other.mode)
    }
}

impl Holder {
    /// A holder with fencing token `fence`, that proclaimed `value`.
    pub fn new(fence: Option<u64>, value: Option<Vec<u8>>) -> Self {
        Holder {
            fence,
            value,
            note: None,
            mode: None,
            age: None,
            lease_left: None,
        }
    }

    /// With the note stored with its grant.
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }

    /// With what it holds of the key.
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = Some(mode);
        self
    }

    /// With how long ago it was granted.
    pub fn with_age(mut self, age: Duration) -> Self {
        self.age = Some(age);
        self
    }

    /// With how long the server keeps it without a renewal.
    pub fn with_lease_left(mut self, left: Duration) -> Self {
        self.lease_left = Some(left);
        self
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

    /// The note stored with the grant (see [`HolderNote`]), where the
    /// backend stores one.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// What it holds: the plain lock, a read or write share, or permits.
    pub fn mode(&self) -> Option<Mode> {
        self.mode
    }

    /// How long ago it was granted, where the backend records when.
    pub fn age(&self) -> Option<Duration> {
        self.age
    }

    /// How long the server keeps it without a renewal, where the server
    /// counts a lease (not where the lock lives as long as a session or a
    /// process).
    pub fn lease_left(&self) -> Option<Duration> {
        self.lease_left
    }
}
