//! The file backend's listing: the plain locks held now under a key
//! prefix, found by the lock files' names (`{prefix}{stem}.lock`) and
//! `/proc/locks`, a page at a time in the order of the files' names.
//!
//! A page reads the directory through once, keeping the `limit` first
//! names after the cursor whose inode `/proc/locks` lists: memory for one
//! page, whatever the number of files. Waiters are the `flock` requests
//! `/proc/locks` shows blocked on a lock's file. Read-write locks and
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
    let locked = proc_locks::flocked(|_| Ok(false))?;
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
    let waiting = proc_locks::waiting()?;
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
