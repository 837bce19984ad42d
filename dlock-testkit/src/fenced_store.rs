//! A fenced store shared by processes through a directory: it keeps the
//! highest fencing token it has seen and refuses any write with a lower
//! one, the way a database column compared in the `UPDATE` would.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

/// A store in a directory: `highest` holds the highest fence taken, and
/// `log` one line per write (`accepted|rejected <writer> <fence>`). Each
/// write holds an exclusive file lock while it compares and records, so
/// writers in separate processes see one order.
///
/// # Examples
///
/// ```
/// use dlock_testkit::FencedStore;
///
/// let dir = tempfile::tempdir().unwrap();
/// let store = FencedStore::new(dir.path());
/// assert!(store.write("a", 7).unwrap());
/// assert!(!store.write("b", 6).unwrap()); // stale: refused
/// assert_eq!(store.log().unwrap().len(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct FencedStore {
    dir: PathBuf,
}

/// One recorded write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreWrite {
    /// Whether the store took it.
    pub accepted: bool,
    /// Who wrote.
    pub writer: String,
    /// With which fence.
    pub fence: u64,
}

impl FencedStore {
    /// The store kept in `dir` (created empty on the first write).
    pub fn new(dir: &Path) -> FencedStore {
        FencedStore {
            dir: dir.to_owned(),
        }
    }

    /// Writes as `writer` with `fence`: `Ok(true)` if taken, `Ok(false)` if
    /// refused because a higher fence was seen.
    ///
    /// # Errors
    ///
    /// If the files cannot be read or written.
    pub fn write(&self, writer: &str, fence: u64) -> std::io::Result<bool> {
        let mut highest = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.dir.join("highest"))?;
        highest.lock()?;
        let mut text = String::new();
        highest.read_to_string(&mut text)?;
        let seen: u64 = text.trim().parse().unwrap_or(0);
        let accepted = fence >= seen;
        if accepted {
            highest.set_len(0)?;
            highest.seek(SeekFrom::Start(0))?;
            write!(highest, "{fence}")?;
        }
        let mut log = OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.dir.join("log"))?;
        let verdict = if accepted { "accepted" } else { "rejected" };
        writeln!(log, "{verdict} {writer} {fence}")?;
        highest.unlock()?;
        Ok(accepted)
    }

    /// Whether a writer holds the store's lock now (a process stopped in
    /// the middle of a write would keep it until resumed).
    ///
    /// # Errors
    ///
    /// If the lock file cannot be opened.
    pub fn is_busy(&self) -> std::io::Result<bool> {
        let highest = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.dir.join("highest"))?;
        match highest.try_lock() {
            Ok(()) => {
                highest.unlock()?;
                Ok(false)
            }
            Err(std::fs::TryLockError::WouldBlock) => Ok(true),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }

    /// Every write so far, in order.
    ///
    /// # Errors
    ///
    /// If the log cannot be read.
    pub fn log(&self) -> std::io::Result<Vec<StoreWrite>> {
        let mut text = String::new();
        match File::open(self.dir.join("log")) {
            Ok(mut file) => file.read_to_string(&mut text)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e),
        };
        Ok(text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split(' ');
                let accepted = parts.next()? == "accepted";
                let writer = parts.next()?.to_owned();
                let fence = parts.next()?.parse().ok()?;
                Some(StoreWrite {
                    accepted,
                    writer,
                    fence,
                })
            })
            .collect())
    }
}
