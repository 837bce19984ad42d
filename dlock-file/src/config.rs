//! The URL (`file:///dir`), the directory's checks (a local filesystem
//! only), and the files a key names in it.

use std::{
    fs::{self, File},
    io,
    path::{Path, PathBuf},
};

use dlock_core::{backend::BackendUrl, LockError, LockKey};

use crate::NAME;

/// The directory a `file:///absolute/path` URL names, and its `prefix`
/// parameter (empty without one).
pub(crate) fn parse_url(url: &str) -> Result<(PathBuf, String), LockError> {
    let mut parts = BackendUrl::parse_host_optional(NAME, url)?;
    if parts.scheme() != "file" {
        return Err(parts.invalid("expected `file:///absolute/path`"));
    }
    if !parts.hosts().is_empty() || parts.user().is_some() {
        return Err(parts.invalid(
            "a file URL names a directory on this machine, with no host: \
             `file:///absolute/path` (three slashes)",
        ));
    }
    if parts.path().trim_matches('/').is_empty() {
        return Err(parts.invalid("the directory is missing: `file:///absolute/path`"));
    }
    let prefix = parts.take("prefix").unwrap_or_default();
    check_prefix(&prefix).map_err(|why| parts.invalid(&why))?;
    parts.finish(&["prefix"])?;
    Ok((Path::new("/").join(parts.path()), prefix))
}

/// The longest file name prefix.
pub(crate) const MAX_PREFIX: usize = 32;

/// Why `prefix` cannot begin the lock files' names, if it cannot: at most
/// [`MAX_PREFIX`] ASCII letters, digits, `-`, `_` and `.`, and not
/// starting with `.` (which would hide the files).
pub(crate) fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.len() > MAX_PREFIX
        || prefix.starts_with('.')
        || !prefix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(format!(
            "`prefix` is at most {MAX_PREFIX} ASCII letters, digits, `-`, `_` and `.`, \
             not starting with `.`"
        ));
    }
    Ok(())
}

/// An I/O error on `path`, as a typed backend error that names the path.
pub(crate) fn io_error(what: &str, path: &Path, e: io::Error) -> LockError {
    LockError::backend(
        NAME,
        io::Error::new(e.kind(), format!("{what} {}: {e}", path.display())),
    )
}

/// Creates `dir` if it is missing, and checks it is a directory on a
/// filesystem whose `flock` excludes across processes of this machine.
pub(crate) fn open_dir(dir: &Path) -> Result<(), LockError> {
    if !dir.is_absolute() {
        return Err(invalid(format!(
            "the lock directory `{}` is not an absolute path",
            dir.display()
        )));
    }
    let not_a_directory = || invalid(format!("`{}` is not a directory", dir.display()));
    if dir.exists() && !dir.is_dir() {
        return Err(not_a_directory());
    }
    fs::create_dir_all(dir).map_err(|e| io_error("cannot create the lock directory", dir, e))?;
    if !dir.is_dir() {
        return Err(not_a_directory());
    }
    let handle = File::open(dir).map_err(|e| io_error("cannot open", dir, e))?;
    check_filesystem(&handle, dir)
}

fn invalid(why: String) -> LockError {
    dlock_core::InvalidReason::Other(why).into()
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn check_filesystem(dir_handle: &File, dir: &Path) -> Result<(), LockError> {
    let stat = rustix::fs::fstatfs(dir_handle)
        .map_err(|e| io_error("cannot stat the filesystem of", dir, e.into()))?;
    // `f_type`'s integer type differs by architecture; the magic numbers
    // are 32 bits.
    #[allow(clippy::unnecessary_cast)]
    let magic = stat.f_type as u32;
    match classify(magic) {
        Filesystem::Local => Ok(()),
        Filesystem::Fuse => {
            tracing::warn!(
                dir = %dir.display(),
                "dlock-file: the lock directory is on a FUSE filesystem; flock \
                 excludes across processes only if the filesystem implements it \
                 (a network FUSE mount such as sshfs does not)"
            );
            Ok(())
        }
        Filesystem::Network(name) => Err(LockError::UnsafeDeployment {
            backend: NAME,
            reason: format!(
                "the lock directory {} is on {name} (filesystem magic {magic:#x}): \
                 flock on a network filesystem does not exclude across machines, \
                 and is emulated with per-process locks or not at all; put the \
                 directory on a local filesystem (/run, /var/lock, /tmp), or use a \
                 lock server backend",
                dir.display()
            ),
        }),
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn check_filesystem(_dir_handle: &File, _dir: &Path) -> Result<(), LockError> {
    // No portable way to tell a network mount here: the docs say so.
    Ok(())
}

/// What a filesystem's `statfs` magic number says about its `flock`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Filesystem {
    /// A local filesystem: `flock` excludes across this machine's processes.
    Local,
    /// FUSE: depends on the filesystem behind it.
    Fuse,
    /// A network filesystem, by name: refused.
    Network(&'static str),
}

/// Classifies a `statfs` `f_type`.
pub(crate) fn classify(magic: u32) -> Filesystem {
    match magic {
        0x6969 => Filesystem::Network("NFS"),
        0xFF53_4D42 => Filesystem::Network("CIFS"),
        0xFE53_4D42 => Filesystem::Network("SMB2"),
        0x517B => Filesystem::Network("SMB"),
        0x0102_1997 => Filesystem::Network("9p"),
        0x5346_414F => Filesystem::Network("AFS"),
        0x6B41_4653 => Filesystem::Network("kAFS"),
        0x6573_5546 => Filesystem::Fuse,
        _ => Filesystem::Local,
    }
}

/// Escaped key names longer than this end in a hash instead, so that a
/// name with its longest suffix stays within 255 bytes.
const MAX_NAME: usize = 200;
/// How much of a long key's escaped name is kept before its hash.
const KEPT: usize = 180;

/// The file name stem of `key`: every character but ASCII letters, digits,
/// `-` and `_` percent-escaped (so `.` separates the suffix, and no name is
/// `.` or `..`), and a long one cut and ended with `#` and a 64-bit hash
/// of the whole key (`#` is escaped in every other name).
pub(crate) fn stem(key: &LockKey) -> String {
    let mut name = escaped(key);
    if name.len() > MAX_NAME {
        // Escaped names are ASCII: any byte index is a char boundary.
        name.truncate(KEPT);
        name.push_str(&format!(
            "#{:016x}",
            dlock_core::backend::key_hash("", key.as_str())
        ));
    }
    name
}

/// `key` escaped as a stem is, never cut: what the stems of the keys
/// that start with `key` start with (unless cut and hashed).
pub(crate) fn escaped(key: &LockKey) -> String {
    key.escaped(|c| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
}

/// The files of one of a key's three objects (see
/// [`Mode`](dlock_core::backend::Mode)): `{stem}.lock`, `{stem}.rw`, `{stem}.sem`
/// and the files beside each.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// The object's lock file (for a semaphore: its limit file).
    pub(crate) main: PathBuf,
    /// The note a grant of a plain lock writes after its fence (empty for
    /// the other objects, whose several holders one counter cannot name).
    pub(crate) note: std::sync::Arc<str>,
}

impl Names {
    /// The files of `key`'s `object` in `dir`, their names after `prefix`.
    pub(crate) fn new(dir: &Path, prefix: &str, key: &LockKey, object: &str) -> Names {
        Names {
            main: dir.join(format!("{prefix}{}.{object}", stem(key))),
            note: std::sync::Arc::from(""),
        }
    }

    fn beside(&self, suffix: &str) -> PathBuf {
        let mut name = self.main.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    }

    /// The fencing counter.
    pub(crate) fn fence(&self) -> PathBuf {
        self.beside("-fence")
    }

    /// A read-write lock's writer gate.
    pub(crate) fn gate(&self) -> PathBuf {
        self.beside("-gate")
    }

    /// A semaphore's slot `i`.
    pub(crate) fn slot(&self, i: u32) -> PathBuf {
        self.beside(&format!("-{i}"))
    }

    /// What the holder of a plain lock proclaimed.
    pub(crate) fn holder(&self) -> PathBuf {
        self.beside("-holder")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_an_absolute_directory_and_nothing_else() {
        let dir = |url| parse_url(url).unwrap().0;
        assert_eq!(
            dir("file:///var/lock/my%20app"),
            Path::new("/var/lock/my app")
        );
        assert_eq!(dir("file:///tmp/x/"), Path::new("/tmp/x/"));
        assert_eq!(
            parse_url("file:///run/lock?prefix=dlock.").unwrap(),
            (PathBuf::from("/run/lock"), "dlock.".to_owned())
        );
        assert_eq!(parse_url("file:///tmp/x").unwrap().1, "");
        for bad in [
            "file:///",
            "file://",
            "file://host/tmp/x",
            "file://relative/x",
            "file://u@/tmp/x",
            "file:///tmp/x?wait=1s",
            "file:///tmp/x?prefix=.hidden",
            "file:///tmp/x?prefix=a/b",
            "file:///tmp/x?prefix=%2E%2E%2Fetc",
            "file:///tmp/../etc",
            "file:tmp/x",
            "redis:///tmp/x",
        ] {
            assert!(
                matches!(parse_url(bad), Err(LockError::InvalidOptions { .. })),
                "{bad}: {:?}",
                parse_url(bad)
            );
        }
    }

    #[test]
    fn network_filesystems_are_refused_and_fuse_only_warned() {
        assert_eq!(classify(0x6969), Filesystem::Network("NFS"));
        assert_eq!(classify(0xFF53_4D42), Filesystem::Network("CIFS"));
        assert_eq!(classify(0xFE53_4D42), Filesystem::Network("SMB2"));
        assert_eq!(classify(0x0102_1997), Filesystem::Network("9p"));
        assert_eq!(classify(0x6573_5546), Filesystem::Fuse);
        // ext4, tmpfs, btrfs, xfs
        for local in [0xEF53, 0x0102_1994, 0x9123_683E, 0x5846_5342] {
            assert_eq!(classify(local), Filesystem::Local);
        }
    }

    #[test]
    fn names_are_distinct_safe_and_short() {
        let key = |k: &str| LockKey::new(k).unwrap();
        assert_eq!(stem(&key("order/42")), "order%2F42");
        assert_eq!(stem(&key(".")), "%2E");
        assert_ne!(stem(&key("a.b")), stem(&key("a%2Eb")));
        let long = "k".repeat(1000);
        let (a, b) = (stem(&key(&long)), stem(&key(&format!("{long}x"))));
        assert_ne!(a, b);
        let longest = Names::new(
            Path::new("/d"),
            &"p".repeat(MAX_PREFIX),
            &key(&"é".repeat(512)),
            "sem",
        );
        let name = longest.slot(u32::MAX);
        let name = name.file_name().unwrap().len();
        assert!(name <= 255, "{name} bytes");
        assert!(!stem(&key("a#b")).contains('#'));
    }
}
