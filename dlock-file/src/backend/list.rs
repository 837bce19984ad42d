//! The file backend's listing: the plain locks held now under a key
//! prefix, found by the lock files' names (`{prefix}{stem}.lock`) and
//! `/proc/locks`, a page at a time in the order of the files' names.
//!
//! A page looks at `/proc/locks` once (the host's whole table: read once,
//! or, where it is longer than one read, again until a read adds no held
//! file, at most four times), then reads the directory through once,
//! keeping the `limit` first names after the cursor whose inode the table
//! lists: memory for one page, whatever the number of files. Waiters are
//! the `flock` requests the same look shows blocked on a lock's file. Read-write locks and
//! semaphores, whose holders one counter cannot name, are not listed.

use std::{
    collections::BinaryHeap,
    ffi::OsString,
    os::unix::fs::{DirEntryExt as _, MetadataExt as _},
    path::Path,
};

use dlock_core::{
    backend::{percent_decode, HeldLock, Holder, ListCursor, ListPage, ListRequest, ListedKey},
    LockKey, Result,
};

use super::{election, locks, proc_locks};
use crate::config::{self, io_error, Names};

const SUFFIX: &str = ".lock";

/// One page of the plain locks held in `dir` whose files' names start
/// with `prefix` (the backend's) and whose keys start with `req.prefix`.
pub(super) fn page(dir: &Path, prefix: &str, req: &ListRequest<'_>) -> Result<ListPage> {
    let start = match req.prefix {
        "" => prefix.to_owned(),
        keys => format!("{prefix}{}", config::escaped(&LockKey::new(keys)?)),
    };
    let after = req.after.map(ListCursor::as_str);
    // A table longer than one read is read again until a read finds no
    // held file the earlier ones missed.
    let mut known = None;
    let proc_locks::Look {
        held: locked,
        waiting,
    } = proc_locks::look(|held| Ok(known.replace(held.len()) == Some(held.len())))?;
    let inodes: std::collections::HashSet<u64> = locked.iter().map(|&(_, _, ino)| ino).collect();
    // The `limit + 1` first names: a max-heap, its greatest popped.
    let mut first = BinaryHeap::new();
    let entries = std::fs::read_dir(dir).map_err(|e| io_error("cannot list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_error("cannot list", dir, e))?;
        if !inodes.contains(&entry.ino()) {
            continue;
        }
        let name = entry.file_name();
        let Some(text) = name.to_str() else { continue };
        if !text.starts_with(&start)
            || !text.ends_with(SUFFIX)
            || after.is_some_and(|after| text <= after)
        {
            continue;
        }
        first.push(name);
        if first.len() > req.limit + 1 {
            first.pop();
        }
    }
    let mut names: Vec<OsString> = first.into_sorted_vec();
    let more = names.len() > req.limit;
    names.truncate(req.limit);
    let next = more
        .then(|| names.last().and_then(|n| n.to_str()))
        .flatten()
        .map(ListCursor::new);
    let mut held = Vec::with_capacity(names.len());
    for name in &names {
        let path = dir.join(name);
        if !proc_locks::is_among(&path, &locked)? {
            continue;
        }
        let text = name.to_str().unwrap_or_default();
        let stem = &text[prefix.len()..text.len() - SUFFIX.len()];
        let names = Names {
            main: path,
            note: "".into(),
        };
        let inode = std::fs::symlink_metadata(&names.main).map(|m| m.ino()).ok();
        let waiters = inode.and_then(|i| waiting.get(&i)).copied().unwrap_or(0);
        let grant = locks::last_grant(&names.fence())?;
        let fence = grant.as_ref().map(|g| g.fence);
        let holder = election::shown(Holder::new(fence, None), grant);
        held.push(HeldLock::new(key_of(stem), vec![holder]).with_waiters(waiters));
    }
    Ok(ListPage::new(held, next))
}

/// The key a stem names: unescaped, unless it was cut and hashed.
fn key_of(stem: &str) -> ListedKey {
    match percent_decode(stem) {
        Ok(key) if !stem.contains('#') => ListedKey::Named(key),
        _ => ListedKey::Hashed(format!("lock file {stem}{SUFFIX}")),
    }
}

#[cfg(test)]
mod tests {
    use std::{cell::Cell, os::unix::fs::MetadataExt as _, path::Path};

    use dlock_core::backend::ListRequest;

    use super::super::proc_locks::tests::{OPENS, TABLE};

    /// A `/proc/locks` in which `others` files of another device are
    /// locked, then `held`, the first with `waiters` blocked requests.
    fn table(held: &[&Path], waiters: u32, others: u32) -> String {
        let mut lines: Vec<String> = (0..others)
            .map(|i| format!("{i}: FLOCK  ADVISORY  WRITE 7 ff:ff:{i} 0 EOF"))
            .collect();
        for (n, path) in held.iter().enumerate() {
            let meta = std::fs::metadata(path).unwrap();
            let (major, minor) = (rustix::fs::major(meta.dev()), rustix::fs::minor(meta.dev()));
            let id = format!("{major:02x}:{minor:02x}:{}", meta.ino());
            lines.push(format!("{n}: FLOCK  ADVISORY  WRITE 8 {id} 0 EOF"));
            if n == 0 {
                for _ in 0..waiters {
                    lines.push(format!("{n}: -> FLOCK  ADVISORY  WRITE 9 {id} 0 EOF"));
                }
            }
        }
        lines.join("\n") + "\n"
    }

    /// A page reads the table once (a long one twice: the second read
    /// adds nothing), and takes its held files and their waiters from
    /// that one look.
    #[test]
    fn a_page_looks_at_the_lock_table_once() {
        let dir = tempfile::tempdir().unwrap();
        let files = ["p-a.lock", "p-b.lock", "p-c.lock"].map(|f| dir.path().join(f));
        for file in &files {
            std::fs::File::create(file).unwrap();
        }
        let fake = tempfile::tempdir().unwrap();
        let fake = fake.path().join("locks");
        TABLE.with(|t| *t.borrow_mut() = Some(fake.clone()));
        // Short enough for one read; longer than one read.
        for (others, looks) in [(0, 1), (400, 2)] {
            std::fs::write(&fake, table(&[&files[0], &files[1]], 2, others)).unwrap();
            OPENS.with(|o| o.set(0));
            let page = super::page(dir.path(), "p-", &ListRequest::new("", 10)).unwrap();
            let opens = OPENS.with(Cell::get);
            assert_eq!(opens, looks, "reads of a table of {others} other locks");
            let listed: Vec<_> = page
                .locks
                .iter()
                .map(|l| (l.key().to_string(), l.waiters()))
                .collect();
            assert_eq!(
                listed,
                [("a".to_owned(), Some(2)), ("b".to_owned(), Some(0))]
            );
        }
        TABLE.with(|t| *t.borrow_mut() = None);
    }
}
