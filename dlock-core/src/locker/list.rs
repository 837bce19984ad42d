//! [`Locker::list`]: the held locks under a key prefix, a page at a time.

use super::{requests::REQUEST_PREFIX, Locker};
use crate::{
    backend::{HeldLock, ListCursor, ListRequest, DEFAULT_LIST_PAGE},
    error::Result,
};

impl Locker {
    /// The locks held now whose key starts with `prefix` (empty: every
    /// key this locker's backend can see), read a page at a time: call
    /// [`Listing::next_page`] until it answers `None`. Each lock comes with
    /// its key as the user wrote it (or, where the server stores only a
    /// hash, that hash: see [`ListedKey`](crate::backend::ListedKey)), its
    /// holders with their mode, fence, note, age and lease left where the
    /// server records them, and its waiters where the server counts them.
    ///
    /// A page is one read of at most [`Listing::page_size`] locks, so a
    /// listing of any number of locks holds one page in memory at a time.
    /// It takes no lock: a lock taken or released while the pages are read
    /// may or may not be on them, and none is on them twice (the listing
    /// remembers the keys it answered). The locks of
    /// [release requests](Locker::request_release) are dlock's own, and
    /// listed only under a prefix of theirs (`release-request:`).
    ///
    /// # Errors
    ///
    /// Each page may fail with
    /// [`LockError::Unsupported`](crate::LockError::Unsupported) where the
    /// backend cannot list (the README's backend table says which, and
    /// why), or [`LockError::Backend`](crate::LockError::Backend).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{BackendExt, LockOptions, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = MemoryBackend::new().into_locker();
    /// let _a = locker.lock_with("jobs/a", LockOptions::new().holder_note("importer")).await?;
    /// let _b = locker.lock("jobs/b").await?;
    /// let mut listing = locker.list("jobs/").page_size(1);
    /// let mut keys = Vec::new();
    /// while let Some(page) = listing.next_page().await? {
    ///     for lock in page {
    ///         keys.push(lock.key().to_string());
    ///     }
    /// }
    /// assert_eq!(keys, ["jobs/a", "jobs/b"]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn list(&self, prefix: impl Into<String>) -> Listing {
        Listing {
            locker: self.clone(),
            prefix: prefix.into(),
            page_size: DEFAULT_LIST_PAGE,
            next: Some(None),
            seen: std::collections::HashSet::new(),
        }
    }
}

/// The pages of a [`Locker::list`].
///
/// # Examples
///
/// ```
/// use dlock_core::{BackendExt, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// let locker = MemoryBackend::new().into_locker();
/// let mut listing = locker.list("");
/// assert!(listing.next_page().await?.is_none()); // nothing held
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Listing {
    locker: Locker,
    prefix: String,
    page_size: usize,
    /// Where the next page starts: `Some(None)` before the first, `None`
    /// after the last.
    next: Option<Option<ListCursor>>,
    /// The keys answered so far: a backend whose scan may answer a key
    /// twice while locks come and go (Redis's `SCAN`) has its repeats
    /// left out here.
    seen: std::collections::HashSet<String>,
}

impl Listing {
    /// At most `size` locks a page (1 to
    /// [`MAX_LIST_PAGE`](crate::backend::MAX_LIST_PAGE); default
    /// [`DEFAULT_LIST_PAGE`]).
    pub fn page_size(mut self, size: usize) -> Self {
        self.page_size = size;
        self
    }

    /// The next page, or `None` once every page was read. A page may be
    /// empty and still be followed by another.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a page dropped before its answer is read again by the
    /// next call.
    pub async fn next_page(&mut self) -> Result<Option<Vec<HeldLock>>> {
        let Some(after) = &self.next else {
            return Ok(None);
        };
        let mut request = ListRequest::new(&self.prefix, self.page_size);
        if let Some(after) = after {
            request = request.after(after);
        }
        let page = self.locker.shared.backend.list(request).await?;
        if page.locks.is_empty() && page.next.is_none() {
            self.next = None;
            return Ok(None);
        }
        self.next = page.next.map(Some);
        let mut locks = page.locks;
        // Release requests are dlock's own locks, listed only when asked
        // for by their prefix.
        locks.retain(|lock| self.seen.insert(lock.key().to_string()));
        if !self.prefix.starts_with(REQUEST_PREFIX) {
            locks.retain(|lock| {
                !lock
                    .key()
                    .name()
                    .is_some_and(|name| name.starts_with(REQUEST_PREFIX))
            });
        }
        Ok(Some(locks))
    }
}
