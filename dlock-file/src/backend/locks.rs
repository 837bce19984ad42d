//! The blocking file operations under every grant: `flock(2)` on the
//! files of a key's object, one attempt or a wait, and the fencing
//! counter. Run on blocking threads only.
//!
//! `flock` locks belong to an open file description: every acquisition
//! opens its own, so two acquisitions in one process exclude each other as
//! two processes do, and the kernel drops them when the last descriptor
//! closes (a release, or the process's death).

use std::{
    fs::{File, OpenOptions},
    io::{self, Read},
    os::unix::fs::FileExt,
    path::Path,
    time::{Duration, Instant},
};

use dlock_core::{backend::Backoff, LockError, LockKey};
use rustix::{fs::FlockOperation as Op, io::Errno};

use crate::config::{io_error, Names};

/// The longest a wait sleeps between two polls of a lock it cannot block
/// on (a writer waiting for readers, permits): what a cancelled wait may
/// keep its hold on a gate or a semaphore's limit for.
pub(crate) const POLL_CAP: Duration = Duration::from_millis(20);

/// What a grant holds: its open files, locked, and its fence. Dropping it
/// unlocks them (explicitly, so that a descriptor a `fork`ed child
/// inherited cannot keep the lock), and closes them.
#[derive(Debug)]
pub(crate) struct Held {
    files: Vec<File>,
    /// The file whose lock decides (a plain lock's, a read-write lock's),
    /// by path: the lock holds only while that path still names a file it
    /// locked (see [`Held::still_named`]).
    main: Option<std::path::PathBuf>,
    pub(crate) fence: u64,
    /// When the last lock was obtained: the lease counts from here.
    pub(crate) granted: Instant,
}

impl Drop for Held {
    fn drop(&mut self) {
        for file in self.files.iter().rev() {
            let _ = rustix::fs::flock(file, Op::Unlock);
        }
    }
}

/// What to take of a key, and where.
#[derive(Debug, Clone)]
pub(crate) enum Plan {
    /// `{stem}.lock`, exclusive.
    Exclusive(Names),
    /// `{stem}.rw` shared, passing the writer gate `{stem}.rw-gate`
    /// (shared, for a moment) so that a waiting writer keeps new readers out.
    Read(Names),
    /// `{stem}.rw` exclusive, holding the gate exclusive while it waits.
    Write(Names),
    /// `count` of the slot files `{stem}.sem-{i}`, `i < limit`, with the
    /// limit file `{stem}.sem` shared (it records the limit).
    Permits {
        names: Names,
        count: u32,
        limit: u32,
    },
}

impl Plan {
    pub(crate) fn names(&self) -> &Names {
        match self {
            Plan::Exclusive(n) | Plan::Read(n) | Plan::Write(n) => n,
            Plan::Permits { names, .. } => names,
        }
    }
}

/// `path` opened for reading and writing, created if it is missing.
///
/// Made without `O_CREAT` on a file that exists: in a sticky directory
/// that every user may write to (`/run/lock`), Linux's
/// `fs.protected_regular` refuses an `O_CREAT` open of another user's
/// file, even one that exists. A file this call creates there is made
/// readable and writable by every user (whatever the umask), so that
/// every user can lock it and move its fence; the sticky bit keeps any
/// of them from deleting or replacing it.
pub(crate) fn open(path: &Path) -> Result<File, LockError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    // A symlink planted in a shared directory must not make dlock write
    // (or truncate) the file it points to, nor a FIFO planted there hang
    // it (a non-blocking open; `flock` waits by its own flag).
    let nofollow = (rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32;
    // Bounded: a file deleted between the two opens is made again.
    for _ in 0..100 {
        match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(nofollow)
            .open(path)
        {
            Ok(file) => return regular(file, path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error("cannot open", path, e)),
        }
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(nofollow)
            .open(path)
        {
            Ok(file) => {
                if in_shared_dir(path) {
                    rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(0o666))
                        .map_err(|e| io_error("cannot share", path, e.into()))?;
                }
                return Ok(file);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_error("cannot create", path, e)),
        }
    }
    Err(io_error(
        "cannot open",
        path,
        io::Error::other("it was deleted each time it was made, 100 times"),
    ))
}

/// `file`, if it is a regular file: a lock file replaced by a FIFO or a
/// device is refused.
fn regular(file: File, path: &Path) -> Result<File, LockError> {
    let meta = file
        .metadata()
        .map_err(|e| io_error("cannot stat", path, e))?;
    if meta.is_file() {
        Ok(file)
    } else {
        Err(io_error(
            "refusing",
            path,
            io::Error::other("it is not a regular file (planted?)"),
        ))
    }
}

/// `path` opened for reading as [`open`] opens it (no symlink followed,
/// no FIFO waited on, a regular file only), if it exists.
pub(crate) fn open_read(path: &Path) -> Result<Option<File>, LockError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let flags = (rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32;
    match OpenOptions::new().read(true).custom_flags(flags).open(path) {
        Ok(file) => regular(file, path).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error("cannot open", path, e)),
    }
}

/// Whether `path`'s directory is one every user may write to, with the
/// sticky bit (as `/run/lock` and `/tmp` are).
fn in_shared_dir(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    path.parent()
        .and_then(|dir| std::fs::metadata(dir).ok())
        .is_some_and(|meta| meta.permissions().mode() & 0o1002 == 0o1002)
}

/// `flock(op)`: `Ok(false)` if a non-blocking `op` finds the file locked.
/// A blocking `op` interrupted by a signal is sent again (a bounded number
/// of times).
pub(crate) fn flock(file: &File, op: Op, path: &Path) -> Result<bool, LockError> {
    for _ in 0..1_000 {
        match rustix::fs::flock(file, op) {
            Ok(()) => return Ok(true),
            Err(Errno::WOULDBLOCK) => return Ok(false),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(io_error("cannot flock", path, e.into())),
        }
    }
    Err(io_error(
        "cannot flock",
        path,
        io::Error::other("interrupted by signals 1000 times"),
    ))
}

/// A writer's gate, held exclusive: while it is held, new readers wait
/// behind the writer. Dropping it unlocks it.
#[derive(Debug)]
pub(crate) struct Gate(File);

impl Drop for Gate {
    fn drop(&mut self) {
        let _ = rustix::fs::flock(&self.0, Op::Unlock);
    }
}

/// One attempt, without waiting: the grant, or `None` if the object is
/// held against it. A writer keeps the gate it took in `queued` (or
/// passes the one already there), so that no reader slips in between its
/// attempt and its wait. Other plans leave `queued` alone.
pub(crate) fn attempt(
    plan: &Plan,
    key: &LockKey,
    queued: &mut Option<Gate>,
) -> Result<Option<Held>, LockError> {
    let taken = match plan {
        Plan::Exclusive(names) => one(&names.main, Op::NonBlockingLockExclusive)?.map(|f| vec![f]),
        Plan::Read(names) => {
            let Some(gate) = one(&names.gate(), Op::NonBlockingLockShared)? else {
                return Ok(None);
            };
            let rw = one(&names.main, Op::NonBlockingLockShared)?;
            drop(unlocked(gate));
            rw.map(|f| vec![f])
        }
        Plan::Write(names) => {
            if queued.is_none() {
                match one(&names.gate(), Op::NonBlockingLockExclusive)? {
                    Some(gate) => *queued = Some(Gate(gate)),
                    None => return Ok(None),
                }
            }
            let rw = one(&names.main, Op::NonBlockingLockExclusive)?;
            if rw.is_some() {
                // Through the gate: the writer holds the lock itself now.
                *queued = None;
            }
            rw.map(|f| vec![f])
        }
        Plan::Permits {
            names,
            count,
            limit,
        } => {
            let limit_file = named_limit(names, key, *limit, false)?;
            slots(names, *count, *limit)?.map(|mut files| {
                files.insert(0, limit_file);
                files
            })
        }
    };
    grant(plan, taken)
}

/// Waits for the grant on this (blocking) thread until its caller left
/// (`stop`): blocks in `flock` where one file decides (a plain lock, a
/// reader, a writer's gate), and polls with a backoff up to [`POLL_CAP`]
/// where several do (a writer waiting for readers to leave, permits).
/// `None` if the caller left first; a lock obtained after it left is
/// unlocked at once. A writer's gate its attempt kept comes in `queued`.
pub(crate) fn wait(
    plan: &Plan,
    key: &LockKey,
    stop: &dyn Fn() -> bool,
    queued: Option<Gate>,
) -> Result<Option<Held>, LockError> {
    let taken = match plan {
        Plan::Exclusive(names) => {
            let file = blocking(&names.main, Op::LockExclusive)?;
            (!stop()).then(|| vec![file])
        }
        Plan::Read(names) => {
            let gate = blocking(&names.gate(), Op::LockShared)?;
            if stop() {
                return Ok(None);
            }
            // Blocks only while a writer holds the lock; meanwhile this
            // reader keeps later writers at the gate, in turn.
            let rw = blocking(&names.main, Op::LockShared)?;
            drop(unlocked(gate));
            (!stop()).then(|| vec![rw])
        }
        Plan::Write(names) => {
            let gate = match queued {
                Some(gate) => gate,
                None => Gate(blocking(&names.gate(), Op::LockExclusive)?),
            };
            let rw = open(&names.main)?;
            let got = poll(stop, || {
                flock(&rw, Op::NonBlockingLockExclusive, &names.main)
            })?;
            drop(gate);
            got.then(|| vec![rw])
        }
        Plan::Permits {
            names,
            count,
            limit,
        } => {
            let limit_file = named_limit(names, key, *limit, true)?;
            let mut got = None;
            poll(stop, || {
                got = slots(names, *count, *limit)?;
                Ok(got.is_some())
            })?;
            got.map(|mut files| {
                files.insert(0, limit_file);
                files
            })
        }
    };
    if stop() {
        // Nobody takes this grant: no fence is spent on it.
        return Ok(None);
    }
    grant(plan, taken)
}

/// Tries `attempt` until it succeeds or the caller left (`stop`),
/// sleeping a backoff from 1 ms up to [`POLL_CAP`] between tries.
fn poll(
    stop: &dyn Fn() -> bool,
    mut attempt: impl FnMut() -> Result<bool, LockError>,
) -> Result<bool, LockError> {
    let mut backoff = Backoff::new(Duration::from_millis(1), POLL_CAP / 2);
    loop {
        if attempt()? {
            return Ok(true);
        }
        if stop() {
            return Ok(false);
        }
        std::thread::sleep(backoff.next_delay());
    }
}

impl Held {
    /// Whether the decisive file's path still names a file this hold
    /// locked. The user who made a lock file in a shared directory may
    /// delete or replace it (the sticky bit stops everyone else): the
    /// next client then locks a new file under that name, and this hold
    /// excludes nobody any more.
    pub(crate) fn still_named(&self) -> bool {
        use std::os::unix::fs::MetadataExt as _;
        let Some(main) = &self.main else {
            return true;
        };
        let Ok(named) = std::fs::symlink_metadata(main) else {
            return false;
        };
        self.files.iter().any(|file| {
            file.metadata()
                .is_ok_and(|ours| ours.dev() == named.dev() && ours.ino() == named.ino())
        })
    }
}

/// The files locked, with a fence from the object's counter; `None` if
/// what was locked is no longer the file its path names (deleted or
/// replaced between the open and the lock).
fn grant(plan: &Plan, taken: Option<Vec<File>>) -> Result<Option<Held>, LockError> {
    let Some(files) = taken else {
        return Ok(None);
    };
    let granted = Instant::now();
    let main = match plan {
        Plan::Exclusive(names) | Plan::Read(names) | Plan::Write(names) => Some(names.main.clone()),
        Plan::Permits { .. } => None,
    };
    // Unlocked by `Held`'s drop if the fence cannot be had.
    let mut held = Held {
        files,
        main,
        fence: 0,
        granted,
    };
    if !held.still_named() {
        return Ok(None);
    }
    held.fence = next_fence(&plan.names().fence(), &plan.names().note)?;
    Ok(Some(held))
}

/// `path` opened and locked with a non-blocking `op`, or `None`.
fn one(path: &Path, op: Op) -> Result<Option<File>, LockError> {
    let file = open(path)?;
    Ok(flock(&file, op, path)?.then_some(file))
}

/// `path` opened and locked with a blocking `op`.
fn blocking(path: &Path, op: Op) -> Result<File, LockError> {
    let file = open(path)?;
    flock(&file, op, path)?;
    Ok(file)
}

fn unlocked(file: File) -> File {
    let _ = rustix::fs::flock(&file, Op::Unlock);
    file
}

/// `count` free slots of `limit`, locked; `None` (and none kept) if fewer
/// are free.
fn slots(names: &Names, count: u32, limit: u32) -> Result<Option<Vec<File>>, LockError> {
    let mut taken = Vec::new();
    for i in 0..limit {
        let path = names.slot(i);
        if let Some(file) = one(&path, Op::NonBlockingLockExclusive)? {
            taken.push(file);
            if taken.len() == count as usize {
                return Ok(Some(taken));
            }
        }
    }
    for file in taken {
        drop(unlocked(file));
    }
    Ok(None)
}

/// The semaphore's limit file, held shared, once it records `limit`: the
/// first holder (nobody holds it shared) writes its limit; later ones
/// check theirs against it. A limit can only change when the semaphore is
/// idle, so every holder and waiter names the same one. A wait (`waits`)
/// blocks for the shared lock.
fn named_limit(names: &Names, key: &LockKey, limit: u32, waits: bool) -> Result<File, LockError> {
    let path = &names.main;
    let file = open(path)?;
    // The exclusive lock is held for a write of a few bytes only: a few
    // tries, or blocking when this is a wait.
    for _ in 0..200 {
        if flock(&file, Op::NonBlockingLockExclusive, path)? {
            file.set_len(0)
                .and_then(|()| file.write_all_at(format!("{limit}\n").as_bytes(), 0))
                .map_err(|e| io_error("cannot write the permit limit to", path, e))?;
            // Not atomic: another client may write its own limit in
            // between, and then the limit read below is its.
            flock(&file, Op::LockShared, path)?;
        } else if waits {
            flock(&file, Op::LockShared, path)?;
        } else if !flock(&file, Op::NonBlockingLockShared, path)? {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let recorded = read_number(&file, path)?;
        return match u32::try_from(recorded) {
            Ok(theirs) if theirs == limit => Ok(file),
            Ok(theirs) => Err(LockError::permit_limit_mismatch(key, theirs, limit)),
            Err(_) => Err(corrupt(path)),
        };
    }
    Err(io_error(
        "cannot lock",
        path,
        io::Error::other("its permit limit stayed locked for writing"),
    ))
}

fn corrupt(path: &Path) -> LockError {
    io_error(
        "refusing",
        path,
        io::Error::new(
            io::ErrorKind::InvalidData,
            "its content is not a number written by dlock-file; was it edited?",
        ),
    )
}

/// The number a file holds; 0 if it is empty (new).
fn read_number(file: &File, path: &Path) -> Result<u64, LockError> {
    read_number_or_garbage(file, path)?.ok_or_else(|| corrupt(path))
}

/// The number a file holds (0 if it is empty), or `None` if what it holds
/// is not one.
fn read_number_or_garbage(mut file: &File, path: &Path) -> Result<Option<u64>, LockError> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| io_error("cannot read", path, e))?;
    if bytes.is_empty() {
        return Ok(Some(0));
    }
    Ok(record(&bytes).map(|(number, _)| number))
}

/// A counter's record: its number, and the note after it (empty if none).
///
/// The number is read from the bytes before the first `\n` alone, and the
/// note with any broken character replaced: a crash between a grant's
/// write and its truncation can leave the tail of a longer note after a
/// shorter one, cut mid-character, and that must not cost the fence.
fn record(bytes: &[u8]) -> Option<(u64, std::borrow::Cow<'_, str>)> {
    let (number, note) = match bytes.iter().position(|&b| b == b'\n') {
        Some(end) => (&bytes[..end], &bytes[end + 1..]),
        None => (bytes, &[][..]),
    };
    let number = std::str::from_utf8(number).ok()?.trim_end().parse().ok()?;
    Some((number, String::from_utf8_lossy(note)))
}

/// Width of a fencing counter's number: every write replaces the same 21
/// bytes first (one sector), so a crash mid-write cannot leave a shorter
/// number; the grant's note follows them.
const FENCE_WIDTH: usize = 20;

/// The next fence of the counter at `path`: `max(last + 1, the wall
/// clock in µs)`, read and written under the counter's own exclusive
/// lock, so that fences rise across processes and restarts.
///
/// Not `fsync`ed (a disk write per grant): a counter
/// that a power loss sets back (its last writes never reached the disk)
/// or loses is overtaken by the clock, as the Redis fence's counter is
/// after a failover. Every fence is at most the clock's reading when it
/// was given (a grant takes longer than a microsecond, and grants of one
/// key are one at a time under the counter's lock), so the next one after
/// the restart, at least the clock then, is above all of them, as long as
/// the clock did not go back across the restart. While the counter lives,
/// a clock that steps back is covered by `last + 1`.
///
/// A counter that holds no number (a power cut can leave a new file's
/// blocks unwritten: zeros, on some filesystems) counts as lost: the
/// clock gives the fence, and the counter is written again.
///
/// The grant's `note` is written after the number in the same write (see
/// [`last_grant`]).
fn next_fence(path: &Path, note: &str) -> Result<u64, LockError> {
    let file = open(path)?;
    flock(&file, Op::LockExclusive, path)?;
    let read = read_number_or_garbage(&file, path)?;
    if read.is_none() {
        tracing::warn!(
            path = %path.display(),
            "dlock-file: a fencing counter held no number (a power cut?); the clock gives the next fence"
        );
    }
    let next = read
        .unwrap_or(0)
        .checked_add(1)
        .ok_or_else(|| corrupt(path))?
        .max(unix_micros());
    let record = format!("{next:0FENCE_WIDTH$}\n{note}");
    file.write_all_at(record.as_bytes(), 0)
        // Whatever followed (garbage, a longer note) goes: the file is
        // the record.
        .and_then(|()| file.set_len(record.len() as u64))
        .map_err(|e| io_error("cannot write the fencing counter", path, e))?;
    drop(unlocked(file));
    Ok(next)
}

/// The wall clock in µs since the Unix epoch (0 before it).
fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The last grant a counter records: its fence, the note written with it
/// (a plain lock's), and when (the counter's modification time).
#[derive(Debug)]
pub(crate) struct LastGrant {
    pub(crate) fence: u64,
    pub(crate) note: Option<String>,
    pub(crate) at: Option<std::time::SystemTime>,
}

/// The counter at `path`'s last grant; `None` if it gave none.
pub(crate) fn last_grant(path: &Path) -> Result<Option<LastGrant>, LockError> {
    let Some(mut file) = open_read(path)? else {
        return Ok(None);
    };
    flock(&file, Op::LockShared, path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| io_error("cannot read", path, e))?;
    if bytes.is_empty() {
        return Ok(None);
    }
    let (fence, note) = record(&bytes).ok_or_else(|| corrupt(path))?;
    let at = file.metadata().and_then(|m| m.modified()).ok();
    Ok(Some(LastGrant {
        fence,
        note: (!note.is_empty()).then(|| note.into_owned()),
        at,
    }))
}

#[cfg(test)]
mod tests {
    /// A FIFO planted where a lock file or a fence counter goes is
    /// refused at once: opening it must not hang every acquisition.
    #[test]
    fn a_planted_fifo_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("k.lock-fence");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o666),
            0,
        )
        .unwrap();
        assert!(super::open(&fifo).is_err());
        assert!(super::open_read(&fifo).is_err());
        assert!(super::last_grant(&fifo).is_err());
    }

    /// A crash between a grant's write and its truncation leaves a
    /// shorter note over a longer one: here the tail of a multi-byte
    /// character. The fence before the note still counts (not the
    /// clock's, which a counter above it would repeat), and the note
    /// reads with the broken character replaced.
    #[test]
    fn a_torn_note_keeps_the_counters_fence() {
        use std::os::unix::fs::FileExt as _;
        let dir = tempfile::tempdir().unwrap();
        // Above any clock reading, so a fence from the clock would show.
        let last = 9_000_000_000_000_000_000_u64;
        let torn = |name: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("{last:020}\néééé")).unwrap();
            let file = super::open(&path).unwrap();
            file.write_all_at("xé".as_bytes(), 21).unwrap();
            path
        };
        assert_eq!(super::next_fence(&torn("a"), "n").unwrap(), last + 1);
        let grant = super::last_grant(&torn("b")).unwrap().unwrap();
        assert_eq!(grant.fence, last);
        assert_eq!(grant.note.as_deref(), Some("xé\u{fffd}éé"));
    }

    #[test]
    fn a_planted_symlink_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let planted = dir.path().join("k.lock-holder");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        assert!(super::open(&planted).is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }
}
