//! What `/proc/locks` says is locked: a look that takes no lock, so that
//! it can never make a client that tries a file at the same moment find it
//! held.

use std::{
    fs::File,
    io::{self, Read},
    path::Path,
};

use dlock_core::LockError;

use crate::config::{io_error, Names};

/// How many of a semaphore's `limit` slot files some process holds an
/// `flock` on now, read from Linux's `/proc/locks` (every lock, with its
/// file's device and inode), not by trying them: a try would make an
/// acquirer that meets it find a free slot taken.
///
/// Matched as [`is_among`] matches. The count errs high: a slot released
/// while the table is read again still counts; a held one is missed only
/// if every read skips it (see [`READS`]).
/// Locks held from another PID namespace are not listed there, so not
/// counted; nor are the slots an acquirer holds for a moment while it
/// finds too few free.
pub(crate) fn slots_taken(names: &Names, limit: u32) -> Result<u32, LockError> {
    let count = |locked: &Flocked| {
        (0..limit).try_fold(0, |taken, i| {
            Ok::<_, LockError>(taken + u32::from(is_among(&names.slot(i), locked)?))
        })
    };
    count(&flocked(|locked| Ok(count(locked)? == limit))?)
}

/// The files some process holds an `flock` on now, from Linux's
/// `/proc/locks` (blocked requests left out): device (major, minor) and
/// inode.
pub(crate) type Flocked = std::collections::HashSet<(u32, u32, u64)>;

/// How many times a look reads `/proc/locks` at most. The kernel hands the
/// table out a page per read and resumes each read by position, so a lock
/// released between two reads shifts the rest and one entry is skipped:
/// a table longer than one read is read again, and the reads' union taken,
/// until `enough` says the answer is in (or this many reads).
const READS: usize = 4;

pub(crate) fn flocked(
    enough: impl FnMut(&Flocked) -> Result<bool, LockError>,
) -> Result<Flocked, LockError> {
    Ok(look(enough)?.held)
}

/// One look at `/proc/locks`: the files held (the union of its reads, as
/// [`flocked`] reads them), and how many `flock` requests wait on each
/// inode (the `->` lines; the most any one read showed).
#[derive(Debug, Default)]
pub(crate) struct Look {
    pub(crate) held: Flocked,
    pub(crate) waiting: std::collections::HashMap<u64, u32>,
}

/// Reads the table as [`flocked`] says, keeping its waiters too.
pub(crate) fn look(
    mut enough: impl FnMut(&Flocked) -> Result<bool, LockError>,
) -> Result<Look, LockError> {
    let path = table();
    let path = path.as_path();
    let mut seen = Look::default();
    let mut table = Vec::new();
    for _ in 0..READS {
        #[cfg(test)]
        tests::OPENS.with(|opens| opens.set(opens.get() + 1));
        let mut file = File::open(path).map_err(|e| io_error("reading", path, e))?;
        let mut reads = 0;
        table.clear();
        let mut chunk = [0; 8192];
        loop {
            let n = file
                .read(&mut chunk)
                .map_err(|e| io_error("reading", path, e))?;
            if n == 0 {
                break;
            }
            reads += 1;
            table.extend_from_slice(&chunk[..n]);
        }
        let mut waiting = std::collections::HashMap::new();
        for line in String::from_utf8_lossy(&table).lines() {
            // `N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END` (the
            // device in hex); a blocked request has `->` before `FLOCK`.
            let mut fields = line.split_whitespace().skip(1);
            let blocked = match fields.next() {
                Some("FLOCK") => false,
                Some("->") if fields.next() == Some("FLOCK") => true,
                _ => continue,
            };
            let Some(file) = fields.nth(3).and_then(file_id) else {
                continue;
            };
            if blocked {
                *waiting.entry(file.2).or_insert(0) += 1;
            } else {
                seen.held.insert(file);
            }
        }
        for (inode, n) in waiting {
            let most = seen.waiting.entry(inode).or_insert(0);
            *most = (*most).max(n);
        }
        // One read is one snapshot, taken under the kernel's lock.
        if reads <= 1 || enough(&seen.held)? {
            break;
        }
    }
    Ok(seen)
}

/// `MAJ:MIN:INODE`, the device in hex.
fn file_id(id: &str) -> Option<(u32, u32, u64)> {
    let mut id = id.split(':');
    let major = u32::from_str_radix(id.next()?, 16).ok()?;
    let minor = u32::from_str_radix(id.next()?, 16).ok()?;
    Some((major, minor, id.next()?.parse().ok()?))
}

/// Where the table is read from: Linux's `/proc/locks` (in this crate's
/// unit tests, a file a test may put in its place).
fn table() -> std::path::PathBuf {
    #[cfg(test)]
    if let Some(path) = tests::TABLE.with(|t| t.borrow().clone()) {
        return path;
    }
    "/proc/locks".into()
}

/// Whether the file at `path` is among `locked`: by device and inode. On
/// btrfs and on overlayfs, whose `stat` reports another device than
/// `/proc/locks` does, by inode alone (another file of that inode number
/// on another device then counts too: the answer errs towards held).
pub(crate) fn is_among(path: &Path, locked: &Flocked) -> Result<bool, LockError> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        // Never taken yet.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_error("cannot stat", path, e)),
    };
    let (dev, ino) = (meta.dev(), meta.ino());
    if locked.contains(&(rustix::fs::major(dev), rustix::fs::minor(dev), ino)) {
        return Ok(true);
    }
    if !locked.iter().any(|&(_, _, locked)| locked == ino) {
        return Ok(false);
    }
    const BTRFS: u32 = 0x9123_683E;
    const OVERLAYFS: u32 = 0x794C_7630;
    // `f_type`'s integer type differs by architecture.
    #[allow(clippy::unnecessary_cast)]
    let magic = rustix::fs::statfs(path).map_or(0, |fs| fs.f_type as u32);
    Ok(matches!(magic, BTRFS | OVERLAYFS))
}

/// Whether some process holds an `flock` on `path` now (this process
/// included), read from Linux's `/proc/locks` as
/// [`slots_taken`] reads it: a look that takes no lock, so that it can
/// never make a client that tries the file at the same moment find it
/// held. Where `/proc/locks` cannot be read, an error.
///
/// Only a plain lock's file is asked about, which only exclusive locks
/// take.
pub(crate) fn is_locked(path: &Path) -> Result<bool, LockError> {
    is_among(path, &flocked(|locked| is_among(path, locked))?)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::{
        cell::{Cell, RefCell},
        path::PathBuf,
    };

    thread_local! {
        /// How many times this thread opened the table.
        pub(crate) static OPENS: Cell<usize> = const { Cell::new(0) };
        /// A file read in place of `/proc/locks` on this thread.
        pub(crate) static TABLE: RefCell<Option<PathBuf>> = const { RefCell::new(None) };
    }

    /// `/proc/locks` comes one page per read, and the kernel resumes each
    /// read by position: a lock released between two reads shifts the
    /// rest, and one entry would be skipped. A held file is never missed
    /// while other files lock and unlock around it.
    #[test]
    fn a_held_file_is_seen_while_others_lock_and_unlock() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let held_path = dir.path().join("held");
        let held = crate::backend::locks::open(&held_path).unwrap();
        rustix::fs::flock(&held, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
        // Newer locks are listed first: these put the held file pages deep.
        let fillers: Vec<_> = (0..400)
            .map(|i| {
                let file = crate::backend::locks::open(&dir.path().join(format!("f{i}"))).unwrap();
                rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
                    .unwrap();
                file
            })
            .collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for t in 0..2 {
                let (dir, stop) = (dir.path(), &stop);
                scope.spawn(move || {
                    let files: Vec<_> = (0..50)
                        .map(|i| {
                            crate::backend::locks::open(&dir.join(format!("c{t}-{i}"))).unwrap()
                        })
                        .collect();
                    while !stop.load(Ordering::Relaxed) {
                        for file in &files {
                            let _ = rustix::fs::flock(
                                file,
                                rustix::fs::FlockOperation::NonBlockingLockExclusive,
                            );
                        }
                        for file in &files {
                            let _ = rustix::fs::flock(file, rustix::fs::FlockOperation::Unlock);
                        }
                    }
                });
            }
            let started = std::time::Instant::now();
            let mut missed = 0;
            let mut looks = 0;
            while started.elapsed() < std::time::Duration::from_secs(3) {
                looks += 1;
                if !super::is_locked(&held_path).unwrap() {
                    missed += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
            assert_eq!(
                missed, 0,
                "the held file was missed in {missed} of {looks} looks"
            );
        });
        drop(fillers);
    }
}
