//! The holder of a key's plain lock, for elections: its fence is the
//! counter's last, and what it proclaimed is in `{stem}.lock-holder`,
//! shown only while the lock is held by the fence that wrote it.

use std::{io::Read, os::unix::fs::FileExt, path::Path};

use dlock_core::{backend::Holder, Result};
use rustix::fs::FlockOperation as Op;

use super::{
    locks::{self, flock},
    proc_locks,
};
use crate::config::{io_error, Names};

/// Who holds the plain lock of `names`: `None` if its file is not
/// locked (read from `/proc/locks`), else its fence, and its value if
/// the holder of that fence proclaimed one.
pub(super) fn holder(names: &Names) -> Result<Option<Holder>> {
    if !proc_locks::is_locked(&names.main)? {
        return Ok(None);
    }
    let grant = locks::last_grant(&names.fence())?;
    let fence = grant.as_ref().map_or(0, |g| g.fence);
    let value = read_holder(&names.holder())?
        .filter(|(by, _)| *by == fence)
        .map(|(_, value)| value);
    Ok(Some(shown(Holder::new(Some(fence), value), grant)))
}

/// `holder` with what the counter's last grant says: its note, and its
/// age (from the counter's modification time).
pub(super) fn shown(holder: Holder, grant: Option<locks::LastGrant>) -> Holder {
    let mut holder = holder.with_mode(dlock_core::backend::Mode::Exclusive);
    if let Some(grant) = grant {
        if let Some(note) = grant.note {
            holder = holder.with_note(note);
        }
        if let Some(age) = grant.at.and_then(|at| at.elapsed().ok()) {
            holder = holder.with_age(age);
        }
    }
    holder
}

/// Writes `{fence}\n{value}`, unless the file already holds a later
/// holder's record: a proclaim that ran late (its lease ended while it
/// waited for a thread) never overwrites the next holder's value. Whether
/// it wrote.
pub(super) fn write_holder(path: &Path, fence: u64, value: &[u8]) -> Result<bool> {
    let mut file = locks::open(path)?;
    flock(&file, Op::LockExclusive, path)?;
    let mut stored = Vec::new();
    file.read_to_end(&mut stored)
        .map_err(|e| io_error("cannot read", path, e))?;
    if parse_holder(&stored).is_some_and(|(by, _)| by > fence) {
        return Ok(false);
    }
    let mut record = format!("{fence}\n").into_bytes();
    record.extend_from_slice(value);
    file.set_len(0)
        .and_then(|()| file.write_all_at(&record, 0))
        .map_err(|e| io_error("cannot write", path, e))?;
    Ok(true)
}

/// The fence and value in the holder file, if it has any.
fn read_holder(path: &Path) -> Result<Option<(u64, Vec<u8>)>> {
    let Some(mut file) = locks::open_read(path)? else {
        return Ok(None);
    };
    flock(&file, Op::LockShared, path)?;
    let mut record = Vec::new();
    file.read_to_end(&mut record)
        .map_err(|e| io_error("cannot read", path, e))?;
    Ok(parse_holder(&record))
}

/// `{fence}\n{value}`, if `record` is one.
fn parse_holder(record: &[u8]) -> Option<(u64, Vec<u8>)> {
    let newline = record.iter().position(|b| *b == b'\n')?;
    let fence = std::str::from_utf8(&record[..newline]).ok()?.parse().ok()?;
    Some((fence, record[newline + 1..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_proclaim_never_overwrites_a_later_holders_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.lock-holder");
        assert!(write_holder(&path, 5, b"new leader").unwrap());
        assert!(!write_holder(&path, 4, b"old leader, late").unwrap());
        assert_eq!(
            read_holder(&path).unwrap(),
            Some((5, b"new leader".to_vec()))
        );
        assert!(write_holder(&path, 6, b"next").unwrap());
        assert_eq!(read_holder(&path).unwrap(), Some((6, b"next".to_vec())));
    }
}
