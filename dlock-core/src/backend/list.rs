//! What [`Backend::list`] is asked and answers: one page of the locks held
//! under a key prefix.

#[cfg(doc)]
use super::Backend;
use super::Holder;

/// The most locks one page of [`Backend::list`] holds.
pub const MAX_LIST_PAGE: usize = 1000;

/// How many locks a page holds unless the caller says otherwise.
pub const DEFAULT_LIST_PAGE: usize = 200;

/// One page of a listing: the held locks whose key starts with `prefix`
/// and comes after `after`, at most `limit` of them.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ListRequest<'a> {
    /// What the keys start with, as the user wrote them; empty for all.
    pub prefix: &'a str,
    /// Where the last page ended; `None` for the first.
    pub after: Option<&'a ListCursor>,
    /// The most locks to answer with, 1 to [`MAX_LIST_PAGE`].
    pub limit: usize,
}

impl<'a> ListRequest<'a> {
    /// The first page of at most `limit` locks under `prefix`.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::backend::ListRequest;
    ///
    /// let first = ListRequest::new("jobs/", 100);
    /// assert!(first.after.is_none());
    /// ```
    pub fn new(prefix: &'a str, limit: usize) -> Self {
        ListRequest {
            prefix,
            after: None,
            limit: limit.clamp(1, MAX_LIST_PAGE),
        }
    }

    /// The page after the one that ended at `cursor`.
    pub fn after(mut self, cursor: &'a ListCursor) -> Self {
        self.after = Some(cursor);
        self
    }
}

/// Where a page of a listing ended, for the next one to start after: what
/// it holds is the backend's own (a key, a path), opaque to callers.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::ListCursor;
///
/// let cursor = ListCursor::new("jobs/7");
/// assert_eq!(cursor.as_str(), "jobs/7");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ListCursor(String);

impl ListCursor {
    /// A cursor holding `position`, as the backend writes it.
    pub fn new(position: impl Into<String>) -> Self {
        ListCursor(position.into())
    }

    /// What the backend wrote in it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One page of held locks, in the backend's order, and where the next
/// starts (`None` when this was the last).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ListPage {
    /// The locks on this page.
    pub locks: Vec<HeldLock>,
    /// Where the next page starts, if there is one.
    pub next: Option<ListCursor>,
}

impl ListPage {
    /// A page of `locks`, followed by the page after `next`.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::backend::ListPage;
    ///
    /// let last = ListPage::new(Vec::new(), None);
    /// assert!(last.locks.is_empty() && last.next.is_none());
    /// ```
    pub fn new(locks: Vec<HeldLock>, next: Option<ListCursor>) -> Self {
        ListPage { locks, next }
    }
}

/// A key as a listing knows it: as the user wrote it, or only as the id
/// the server stores (a hash of it).
///
/// # Examples
///
/// ```
/// use dlock_core::backend::ListedKey;
///
/// let named = ListedKey::Named("jobs/7".into());
/// assert_eq!(named.to_string(), "jobs/7");
/// let hashed = ListedKey::Hashed("advisory 42".into());
/// assert_eq!(hashed.to_string(), "(key unknown: advisory 42)");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ListedKey {
    /// The key, as the user wrote it.
    Named(String),
    /// The server stores only this id of the key (a hash): which key it
    /// was cannot be told.
    Hashed(String),
}

impl ListedKey {
    /// The key, if the server stores it.
    pub fn name(&self) -> Option<&str> {
        match self {
            ListedKey::Named(key) => Some(key),
            ListedKey::Hashed(_) => None,
        }
    }
}

impl std::fmt::Display for ListedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListedKey::Named(key) => f.write_str(key),
            ListedKey::Hashed(id) => write!(f, "(key unknown: {id})"),
        }
    }
}

/// One held lock of a listing: a key's plain lock, read-write lock or
/// semaphore (each holder says its [`mode`](Holder::mode)), its holders,
/// and how many wait where the server can count them.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::{HeldLock, Holder, ListedKey};
///
/// let lock = HeldLock::new(ListedKey::Named("jobs/7".into()), vec![Holder::new(Some(3), None)])
///     .with_waiters(2);
/// assert_eq!(lock.key().name(), Some("jobs/7"));
/// assert_eq!(lock.waiters(), Some(2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLock {
    key: ListedKey,
    holders: Vec<Holder>,
    waiters: Option<u32>,
}

impl HeldLock {
    /// `key`, held by `holders`.
    pub fn new(key: ListedKey, holders: Vec<Holder>) -> Self {
        HeldLock {
            key,
            holders,
            waiters: None,
        }
    }

    /// With how many wait for it.
    pub fn with_waiters(mut self, waiters: u32) -> Self {
        self.waiters = Some(waiters);
        self
    }

    /// The key.
    pub fn key(&self) -> &ListedKey {
        &self.key
    }

    /// Who holds it: one holder of a plain lock or a writer, every reader,
    /// every permit holder.
    pub fn holders(&self) -> &[Holder] {
        &self.holders
    }

    /// How many wait for it, where the server can count them.
    pub fn waiters(&self) -> Option<u32> {
        self.waiters
    }
}

/// [`Backend::list`]'s default answer, and a backend's that cannot list
/// in some setups: `why` says what stops it.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::unsupported_list, LockError};
///
/// let refused = unsupported_list("redis", "listing held locks (Redlock: ...)");
/// assert!(matches!(refused, LockError::Unsupported { .. }));
/// ```
pub fn unsupported_list(backend: &'static str, why: &'static str) -> crate::LockError {
    crate::LockError::Unsupported { backend, what: why }
}
