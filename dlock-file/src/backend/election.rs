//! The holder of a key's plain lock, for elections: its fence is the
//! counter's last, and what it proclaimed is in `{stem}.lock-holder`,
//! shown only while the lock is held by the fence that wrote it.

use std::{
    fs::File,
    io::{self, Read},
    os::unix::fs::FileExt,
    path::Path,
};

use dlock_core::{
    backend::{Holder, Mode},
    LockError, LockKey, Result, Token,
};
use rustix::fs::FlockOperation as Op;

use super::{
    lock,
    locks::{self, flock},
    FileBackend,
};
use crate::{config::io_error, NAME};

impl FileBackend {
    /// Writes `{fence}\n{value}` to the holder file, if `token` holds
    /// `key`'s plain lock here.
    pub(super) async fn proclaim_inner(
        &self,
        key: &LockKey,
        token: &Token,
        value: &[u8],
    ) -> Result<bool> {
        let fence = {
            let owned = lock(&self.inner.owned);
            match owned.get(token) {
                Some(o) if o.key == *key && o.mode == Mode::Exclusive => o.held.fence,
                _ => return Ok(false),
            }
        };
        let path = self.names(key, Mode::Exclusive).holder();
        let mut record = format!("{fence}\n").into_bytes();
        record.extend_from_slice(value);
        blocking(move || write_holder(&path, &record)).await?;
        Ok(true)
    }

    /// Whether the plain lock of `key` is held (a shared lock on its file
    /// is refused), and if so its fence, and its value if the holder of
    /// that fence proclaimed one.
    pub(super) async fn holder_inner(&self, key: &LockKey) -> Result<Option<Holder>> {
        let names = self.names(key, Mode::Exclusive);
        blocking(move || {
            if !locks::is_locked(&names.main)? {
                return Ok(None);
            }
            let fence = locks::last_fence(&names.fence())?;
            let value = read_holder(&names.holder())?
                .filter(|(by, _)| *by == fence)
                .map(|(_, value)| value);
            Ok(Some(Holder::new(Some(fence), value)))
        })
        .await
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| LockError::backend(NAME, e))?
}

fn write_holder(path: &Path, record: &[u8]) -> Result<()> {
    let file = locks::open(path)?;
    flock(&file, Op::LockExclusive, path)?;
    file.set_len(0)
        .and_then(|()| file.write_all_at(record, 0))
        .map_err(|e| io_error("cannot write", path, e))
}

/// The fence and value in the holder file, if it has any.
fn read_holder(path: &Path) -> Result<Option<(u64, Vec<u8>)>> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error("cannot open", path, e)),
    };
    flock(&file, Op::LockShared, path)?;
    let mut record = Vec::new();
    file.read_to_end(&mut record)
        .map_err(|e| io_error("cannot read", path, e))?;
    let Some(newline) = record.iter().position(|b| *b == b'\n') else {
        return Ok(None);
    };
    let fence = std::str::from_utf8(&record[..newline])
        .ok()
        .and_then(|f| f.parse().ok());
    Ok(fence.map(|fence| (fence, record[newline + 1..].to_vec())))
}
