//! What an acquisition takes of its key, and the one admission rule of
//! the backends that queue shared modes themselves.

use crate::error::Result;

/// What an acquisition takes of its key.
///
/// A key names three objects, one per kind, that never meet: the plain
/// lock ([`Mode::Exclusive`]), the read-write lock ([`Mode::Read`] and
/// [`Mode::Write`]) and the semaphore ([`Mode::Permits`]). A backend keeps
/// them apart on its server.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Mode;
///
/// let permits = Mode::permits(2, 5)?;
/// assert_eq!(permits, Mode::Permits { count: 2, limit: 5 });
/// assert!(Mode::permits(6, 5).is_err());
/// assert!(Mode::Read.is_shared() && !Mode::Write.is_shared());
/// # Ok::<(), dlock_core::LockError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mode {
    /// The whole key, alone: a plain lock.
    Exclusive,
    /// A reader of the key's read-write lock: with other readers, never
    /// with a writer, and never ahead of a writer that waits.
    Read,
    /// The writer of the key's read-write lock: alone.
    Write,
    /// `count` of the `limit` permits of the key's semaphore. Every holder
    /// and waiter of one semaphore names the same `limit`.
    Permits {
        /// How many permits this acquisition takes (1 to `limit`).
        count: u32,
        /// How many permits the semaphore has.
        limit: u32,
    },
}

impl Mode {
    /// `count` of `limit` permits.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`](crate::LockError::InvalidOptions)
    /// unless `1 <= count <= limit`.
    pub fn permits(count: u32, limit: u32) -> Result<Mode> {
        if limit == 0 || count == 0 || count > limit {
            return Err(crate::InvalidReason::Permits { count, limit }.into());
        }
        Ok(Mode::Permits { count, limit })
    }

    /// How a server's queue entry says what it takes: `r`, `w`,
    /// `p{count}/{limit}`, and empty for a plain lock. The inverse of
    /// [`Mode::from_tag`].
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::backend::Mode;
    ///
    /// let two_of_five = Mode::Permits { count: 2, limit: 5 };
    /// assert_eq!(two_of_five.tag(), "p2/5");
    /// assert_eq!(Mode::from_tag("p2/5"), Some(two_of_five));
    /// assert_eq!(Mode::from_tag(&Mode::Read.tag()), Some(Mode::Read));
    /// assert_eq!(Mode::from_tag("p2"), None);
    /// ```
    pub fn tag(&self) -> String {
        match self {
            Mode::Read => "r".to_owned(),
            Mode::Write => "w".to_owned(),
            Mode::Permits { count, limit } => format!("p{count}/{limit}"),
            Mode::Exclusive => String::new(),
        }
    }

    /// The mode a [`tag`](Mode::tag) names; `None` for one it does not
    /// write.
    pub fn from_tag(tag: &str) -> Option<Mode> {
        match tag {
            "r" => Some(Mode::Read),
            "w" => Some(Mode::Write),
            "" => Some(Mode::Exclusive),
            _ => {
                let (count, limit) = tag.strip_prefix('p')?.split_once('/')?;
                Some(Mode::Permits {
                    count: count.parse().ok()?,
                    limit: limit.parse().ok()?,
                })
            }
        }
    }

    /// Whether other holders may hold the key with this one (a reader, or
    /// a permit).
    pub const fn is_shared(&self) -> bool {
        matches!(self, Mode::Read | Mode::Permits { .. })
    }
}

/// Whether an acquisition of `mode` holds its key, given the modes of
/// everything ahead of it in the key's queue (holders, and waiters that
/// came first): first come, first served. A reader holds when no writer is
/// ahead (so a waiting writer keeps later readers out), permits when those
/// ahead and its own fit the limit, anything else when nothing is ahead.
/// The one admission rule of every backend that queues shared modes
/// itself; pass [`Mode::Exclusive`] for an entry it cannot read, which
/// then blocks everything behind it.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::{admitted, Mode};
///
/// let two_of_three = Mode::Permits { count: 2, limit: 3 };
/// assert!(admitted(Mode::Read, [Mode::Read, Mode::Read]));
/// assert!(!admitted(Mode::Read, [Mode::Read, Mode::Write]));
/// assert!(admitted(two_of_three, [Mode::Permits { count: 1, limit: 3 }]));
/// assert!(!admitted(two_of_three, [two_of_three]));
/// assert!(admitted(Mode::Write, []));
/// ```
pub fn admitted(mode: Mode, ahead: impl IntoIterator<Item = Mode>) -> bool {
    let mut ahead = ahead.into_iter();
    match mode {
        Mode::Read => ahead.all(|m| m == Mode::Read),
        Mode::Permits { count, limit } => {
            let limit = u64::from(limit);
            let mut taken = u64::from(count);
            ahead.all(|m| {
                taken += match m {
                    Mode::Permits { count, .. } => u64::from(count),
                    _ => limit + 1,
                };
                taken <= limit
            }) && taken <= limit
        }
        _ => ahead.next().is_none(),
    }
}

/// The permits held in a semaphore's queue of `entries`, oldest first,
/// holders and waiters alike, by [`admitted`]'s rule: the permits of the
/// longest prefix that fits its limit (an entry it cannot read, passed as
/// anything but [`Mode::Permits`], ends the prefix).
///
/// # Examples
///
/// ```
/// use dlock_core::backend::{permits_taken, Mode};
///
/// let p = |count| Mode::Permits { count, limit: 3 };
/// // Two held, and a waiter for two more that does not fit.
/// assert_eq!(permits_taken([p(1), p(1), p(2), p(1)]), 2);
/// assert_eq!(permits_taken([]), 0);
/// ```
pub fn permits_taken(entries: impl IntoIterator<Item = Mode>) -> u32 {
    let mut taken = 0u32;
    for entry in entries {
        match entry {
            Mode::Permits { count, limit } if taken.saturating_add(count) <= limit => {
                taken += count;
            }
            _ => break,
        }
    }
    taken
}
