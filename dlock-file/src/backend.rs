//! `FileBackend`: the `Backend` trait over `flock(2)` locks on the files
//! of one directory.

use std::{
    collections::HashMap,
    fmt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    thread::Thread,
};

use dlock_core::{
    backend::{
        wait, AcquireRequest, Acquired, Backend, Capabilities, Holder, ListPage, ListRequest,
        LossReporter, Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
    },
    LockError, LockKey, LostReason, Result, Token, MAX_LEASE,
};

use crate::{
    config::{self, Names},
    NAME,
};

mod election;
mod leases;
mod list;
mod locks;
mod proc_locks;
mod steps;

/// Locks on one machine, with no server: `flock(2)` on files in a
/// directory (`file:///var/lock/myapp`). The crate docs say what it
/// guarantees, and what it does not do.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_core::LockError> {
/// use dlock_core::BackendExt;
/// use dlock_file::FileBackend;
///
/// # let dir = tempfile::tempdir().unwrap();
/// let locker = FileBackend::open(dir.path())?.into_locker();
/// let other = FileBackend::open(dir.path())?.into_locker(); // or another process
/// let guard = locker.lock("report:daily").await?;
/// assert!(other.try_lock("report:daily").await?.is_none());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FileBackend {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    /// What every lock file's name starts with.
    prefix: String,
    /// Every lock this client holds, by token.
    owned: Mutex<HashMap<Token, Owned>>,
    /// The thread that ends leases (see [`leases`]).
    reaper: Thread,
}

/// A lock this client holds.
struct Owned {
    key: LockKey,
    mode: Mode,
    /// The locked files; dropping them unlocks.
    held: locks::Held,
    loss: LossReporter,
    /// When the backend ends the lease unless renewed first.
    ends: std::time::Instant,
    /// A fixed lease: never renewed.
    fixed: bool,
}

impl fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("FileBackend");
        d.field("dir", &self.inner.dir);
        d.field("prefix", &self.inner.prefix);
        match self.inner.owned.try_lock() {
            Ok(owned) => d.field("held", &owned.len()),
            Err(_) => d.field("held", &format_args!("<locked>")),
        };
        d.finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `work`'s answer, run on the blocking pool.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| LockError::backend(NAME, e))?
}

impl FileBackend {
    /// A client of the locks in `dir`, an absolute path, created if it is
    /// missing.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] if `dir` is relative or not a
    /// directory; [`LockError::UnsafeDeployment`] if it is on a network
    /// filesystem (NFS, SMB/CIFS, 9p, AFS), where `flock` does not exclude
    /// across machines; [`LockError::Backend`] if it cannot be created or
    /// read.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_file::FileBackend;
    ///
    /// # let dir = tempfile::tempdir().unwrap();
    /// let backend = FileBackend::open(dir.path().join("locks"))?;
    /// assert!(FileBackend::open("relative/locks").is_err());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn open(dir: impl AsRef<Path>) -> Result<FileBackend> {
        FileBackend::open_with_prefix(dir, "")
    }

    /// A client of the locks in `dir` whose files' names start with
    /// `prefix`: for a directory other programs use too, such as
    /// `/run/lock` (which `dlock run` uses, with the prefix `dlock.`).
    ///
    /// In a directory every user may write to, with the sticky bit (as
    /// `/run/lock` is), the files are made readable and writable by every
    /// user, so that every user's clients lock the same keys; the sticky
    /// bit keeps each from deleting or replacing another's files.
    ///
    /// # Errors
    ///
    /// As [`open`](FileBackend::open), and [`LockError::InvalidOptions`]
    /// for a prefix that is not at most 32 ASCII letters, digits, `-`,
    /// `_` and `.`, or starts with `.`.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_file::FileBackend;
    ///
    /// # let dir = tempfile::tempdir().unwrap();
    /// let backend = FileBackend::open_with_prefix(dir.path(), "myapp.")?;
    /// assert!(FileBackend::open_with_prefix(dir.path(), "../x").is_err());
    /// # Ok::<(), dlock_core::LockError>(())
    /// ```
    pub fn open_with_prefix(dir: impl AsRef<Path>, prefix: &str) -> Result<FileBackend> {
        let dir = dir.as_ref().to_path_buf();
        config::check_prefix(prefix)
            .map_err(|why| LockError::from(dlock_core::InvalidReason::Other(why)))?;
        config::open_dir(&dir)?;
        let (reaper, start) = leases::start_reaper()?;
        let inner = Arc::new(Inner {
            dir,
            prefix: prefix.to_owned(),
            owned: Mutex::new(HashMap::new()),
            reaper,
        });
        // Its thread holds it weakly: the backend's locks go with its last
        // clone.
        let _ = start.send(Arc::downgrade(&inner));
        Ok(FileBackend { inner })
    }

    /// A client of the locks in the directory `url` names:
    /// `file:///absolute/path`, with no host; its one parameter, `prefix`,
    /// starts every lock file's name (see
    /// [`open_with_prefix`](FileBackend::open_with_prefix)).
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a malformed URL (a host, a
    /// relative or empty path, a parameter); otherwise as
    /// [`open`](FileBackend::open).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_file::FileBackend;
    ///
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("file://{}", dir.path().display());
    /// let backend = FileBackend::connect(&url).await?; // "file:///var/lock/myapp"
    /// assert!(FileBackend::connect("file://host/var/lock").await.is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<FileBackend> {
        let (dir, prefix) = config::parse_url(url)?;
        blocking(move || FileBackend::open_with_prefix(dir, &prefix)).await
    }

    /// The lock directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// How many locks this client holds now.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// use dlock_core::BackendExt;
    /// use dlock_file::FileBackend;
    ///
    /// # let dir = tempfile::tempdir().unwrap();
    /// let backend = FileBackend::open(dir.path())?;
    /// let guard = backend.clone().into_locker().lock("k").await?;
    /// assert_eq!(backend.held(), 1);
    /// guard.release().await?;
    /// assert_eq!(backend.held(), 0);
    /// # Ok(())
    /// # }
    /// ```
    pub fn held(&self) -> usize {
        lock(&self.inner.owned).len()
    }

    fn names(&self, key: &LockKey, mode: Mode) -> Names {
        let object = match mode {
            Mode::Read | Mode::Write => "rw",
            Mode::Permits { .. } => "sem",
            _ => "lock",
        };
        Names::new(&self.inner.dir, &self.inner.prefix, key, object)
    }
}

impl Backend for FileBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// Fencing, read-write locks (a waiting writer keeps new readers out)
    /// and semaphores; not first come, first served, and no session: a
    /// leaked guard's lock ends with its lease.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .fencing(true)
            .read_write(true)
            .semaphores(true)
            .fifo(false)
            .session_leases(false)
    }

    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        wait::drive(&steps::Steps(self), &req).await
    }

    /// Unlocks and closes the files before it answers.
    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        let released = {
            let mut owned = lock(&self.inner.owned);
            match owned.get(token) {
                Some(o) if o.key == *key && o.mode == mode => owned.remove(token),
                _ => None,
            }
        };
        let Some(released) = released else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        // A guard still listens only if the release came from elsewhere.
        released.loss.report(LostReason::NotHeld);
        Ok(ReleaseOutcome::Released)
    }

    /// Moves the end of every watchdog lease in `locks` that its token
    /// still holds: not one whose lock file was deleted or replaced (see
    /// `Held::still_named`), which is lost.
    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        let now = std::time::Instant::now();
        let mut owned = lock(&self.inner.owned);
        let renewed = |r: &RenewRequest| match owned.get_mut(&r.token) {
            Some(o)
                if o.key == r.key && o.mode == r.mode && now < o.ends && o.held.still_named() =>
            {
                if !o.fixed {
                    let lease = r.lease.min(MAX_LEASE);
                    o.ends = o.ends.max(now.checked_add(lease).unwrap_or(now));
                }
                RenewOutcome::Renewed
            }
            _ => RenewOutcome::NotHeld,
        };
        Ok(locks.iter().map(renewed).collect())
    }

    /// The semaphore's slot files some process holds an `flock` on, as
    /// Linux's `/proc/locks` lists them (elsewhere, an error), read on a
    /// blocking thread.
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        let names = self.names(key, Mode::Permits { count: 1, limit });
        blocking(move || proc_locks::slots_taken(&names, limit)).await
    }

    /// Moves the lease's end, which the lease thread keeps, for a lock
    /// this backend still holds.
    async fn extend(
        &self,
        _key: &LockKey,
        _mode: Mode,
        token: &Token,
        lease: std::time::Duration,
    ) -> Result<Option<(tokio::time::Instant, std::time::Duration)>> {
        let sent = tokio::time::Instant::now();
        let now = std::time::Instant::now();
        let lease = lease.min(MAX_LEASE);
        {
            let mut owned = lock(&self.inner.owned);
            let Some(held) = owned.get_mut(token).filter(|o| now < o.ends) else {
                return Ok(None);
            };
            held.ends = now.checked_add(lease).unwrap_or(now);
        }
        self.inner.reaper.unpark();
        Ok(Some((sent, lease)))
    }

    /// Writes `{fence}\n{value}` to the holder file, if `token` holds
    /// `key`'s plain lock here.
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        let fence = match lock(&self.inner.owned).get(token) {
            Some(o) if o.key == *key && o.mode == Mode::Exclusive => o.held.fence,
            _ => return Ok(false),
        };
        let path = self.names(key, Mode::Exclusive).holder();
        let value = value.to_vec();
        blocking(move || election::write_holder(&path, fence, &value)).await
    }

    /// The plain locks held now under the prefix, with the fence, note and
    /// age of each grant and the requests waiting, found by their files'
    /// names and `/proc/locks` (on a blocking thread). Read-write locks
    /// and semaphores are not listed.
    ///
    /// Each page reads the host's whole `/proc/locks` (once, or up to four
    /// times where it is longer than one read and changing) and the lock
    /// directory through once, whatever its size: many held locks are
    /// listed at least cost with the largest page.
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        let (dir, prefix) = (self.inner.dir.clone(), self.inner.prefix.clone());
        let (keys, after, limit) = (req.prefix.to_owned(), req.after.cloned(), req.limit);
        blocking(move || {
            let mut req = ListRequest::new(&keys, limit);
            if let Some(after) = &after {
                req = req.after(after);
            }
            list::page(&dir, &prefix, &req)
        })
        .await
    }

    /// Whether `key`'s plain lock is held (read from `/proc/locks`, which
    /// takes no lock), and if so its fence, and its value if the holder
    /// of that fence proclaimed one.
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        let names = self.names(key, Mode::Exclusive);
        blocking(move || election::holder(&names)).await
    }
}
