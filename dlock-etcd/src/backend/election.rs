//! Holders: a proclaimed value in our entry's value, and the first entry
//! of a key's queue read as its holder.

use dlock_core::{
    backend::{Backend, Holder, Mode},
    LockError, LockKey, Result, Token,
};
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, WatchOptions};

use super::{backend_error, mode_value, retried, EtcdBackend, NAME};

/// A plain lock's entry with what its holder proclaimed: its mode tag (empty),
/// a NUL, and the value. The tag never holds a NUL.
fn with_proclaimed(value: &[u8]) -> Vec<u8> {
    let mut entry = mode_value(Mode::Exclusive).into_bytes();
    entry.push(0);
    entry.extend_from_slice(value);
    entry
}

/// What the holder of an entry proclaimed, if it has.
fn proclaimed(entry: &[u8]) -> Option<Vec<u8>> {
    let at = entry.iter().position(|&b| b == 0)?;
    Some(entry[at + 1..].to_vec())
}

impl EtcdBackend {
    pub(super) async fn proclaim_inner(
        &self,
        key: &LockKey,
        token: &Token,
        value: &[u8],
    ) -> Result<bool> {
        let held = self
            .owned()
            .get(token)
            .and_then(|owned| Some((owned.name.clone(), owned.granted?)));
        let Some((name, revision)) = held else {
            return Ok(false);
        };
        let queue = self.queue(key, Mode::Exclusive);
        if !name.starts_with(&queue) {
            return Ok(false);
        }
        let txn = super::put_if_created(
            &name,
            revision,
            with_proclaimed(value),
            PutOptions::new().with_ignore_lease(),
        );
        let answer = retried(|| {
            let (mut client, txn) = (self.client(), txn.clone());
            async move { client.txn(txn).await }
        })
        .await?;
        Ok(answer.succeeded())
    }

    pub(super) async fn holder_inner(&self, key: &LockKey) -> Result<Option<Holder>> {
        let queue = self.queue(key, Mode::Exclusive);
        let read = retried(|| {
            let (mut client, queue) = (self.client(), queue.clone());
            let read = self.queue_read(Mode::Exclusive);
            async move { client.get(queue, Some(read)).await }
        })
        .await?;
        Ok(self
            .direct(&queue, Mode::Exclusive, read.kvs())
            .first()
            .map(|kv| {
                let fence = u64::try_from(kv.create_revision()).unwrap_or(0);
                Holder::new(Some(fence), proclaimed(kv.value()))
            }))
    }

    /// Deletes the first key of the queue, the holder's: its watchers
    /// (the next in line) are told; its own session's next check finds it
    /// gone.
    pub(super) async fn force_release_inner(&self, key: &LockKey) -> Result<bool> {
        let queue = self.queue(key, Mode::Exclusive);
        let read = retried(|| {
            let (mut client, queue) = (self.client(), queue.clone());
            let read = self.queue_read(Mode::Exclusive);
            async move { client.get(queue, Some(read)).await }
        })
        .await?;
        let Some(first) = self
            .direct(&queue, Mode::Exclusive, read.kvs())
            .first()
            .copied()
        else {
            return Ok(false);
        };
        // Only the entry read: if it went meanwhile, a later key of that
        // name (its session's next acquisition) is not the holder asked.
        let name = first.key().to_vec();
        let delete = Txn::new()
            .when([Compare::create_revision(
                name.clone(),
                CompareOp::Equal,
                first.create_revision(),
            )])
            .and_then([TxnOp::delete(name, None)]);
        let answer = retried(|| {
            let (mut client, delete) = (self.client(), delete.clone());
            async move { client.txn(delete).await }
        })
        .await?;
        Ok(answer.succeeded())
    }

    pub(super) async fn holder_changed_inner(
        &self,
        key: &LockKey,
        seen: Option<&Holder>,
    ) -> Result<()> {
        let queue = self.queue(key, Mode::Exclusive);
        let mut end = queue.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1; // `/` + 1: just past every key under the queue
        }
        let ended = || LockError::backend(NAME, std::io::Error::other("the holder's watch ended"));
        let mut watch = self
            .client()
            .watch(queue.as_str(), Some(WatchOptions::new().with_range(end)))
            .await
            .map_err(backend_error)?;
        loop {
            match watch.message().await.map_err(backend_error)? {
                Some(response) if response.created() && !response.canceled() => break,
                Some(response) if response.created() => return Err(ended()),
                Some(_) => continue,
                None => return Err(ended()),
            }
        }
        if self.holder(key).await?.as_ref() != seen {
            return Ok(());
        }
        loop {
            match watch.message().await.map_err(backend_error)? {
                Some(response) if response.canceled() => return Err(ended()),
                Some(response) if !response.events().is_empty() => return Ok(()),
                Some(_) => continue,
                None => return Err(ended()),
            }
        }
    }
}

impl EtcdBackend {
    /// The permits of the semaphore's queue that are admitted, oldest
    /// first (see [`dlock_core::backend::permits_taken`]): an entry is
    /// there while its lease lives.
    pub(super) async fn permits_taken_inner(&self, key: &LockKey, limit: u32) -> Result<u32> {
        let mode = Mode::Permits { count: 1, limit };
        let queue = self.queue(key, mode);
        let read = retried(|| {
            let (mut client, queue) = (self.client(), queue.clone());
            let read = self.queue_read(mode);
            async move { client.get(queue, Some(read)).await }
        })
        .await?;
        let modes = self
            .direct(&queue, mode, read.kvs())
            .into_iter()
            .map(|kv| super::mode_of(kv.value()).unwrap_or(Mode::Exclusive));
        Ok(dlock_core::backend::permits_taken(modes))
    }
}
