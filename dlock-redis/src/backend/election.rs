//! Holders, on one node: a proclaimed value beside the lock, its holder
//! read back, and the wait for it to change (Redlock has no single
//! holder).

use std::sync::Arc;

use dlock_core::{
    backend::{unsupported_holder, Holder},
    LockKey, Result, Token,
};
use tokio::sync::Notify;

use super::{backend_error, RedisBackend, NAME};
use crate::keys::names;

impl RedisBackend {
    pub(super) async fn proclaim_inner(
        &self,
        key: &LockKey,
        token: &Token,
        value: &[u8],
    ) -> Result<bool> {
        if !self.inner.fences {
            // A value on a majority is not one value: Redlock has no
            // single holder to read (nor fencing tokens to order them);
            // without fences (`fence=off`), nothing orders the holders.
            return Err(unsupported_holder(NAME));
        }
        let names = names(&self.inner.prefix, key);
        self.inner.nodes[0]
            .proclaim(&names, &token.to_string(), value)
            .await
            .map_err(backend_error)
    }

    pub(super) async fn holder_inner(&self, key: &LockKey) -> Result<Option<Holder>> {
        if !self.inner.fences {
            return Err(unsupported_holder(NAME));
        }
        let names = names(&self.inner.prefix, key);
        let read = self.inner.nodes[0]
            .holder(&names)
            .await
            .map_err(backend_error)?;
        Ok(read.map(|read| Holder::new(Some(read.fence), read.value)))
    }

    pub(super) async fn holder_changed_inner(
        &self,
        key: &LockKey,
        seen: Option<&Holder>,
    ) -> Result<()> {
        if !self.inner.fences {
            return Err(unsupported_holder(NAME));
        }
        let names = names(&self.inner.prefix, key);
        let node = &self.inner.nodes[0];
        let wake = Arc::new(Notify::new());
        let watcher = Token::generate().to_string();
        let _watch = node
            .watch(&names.holder_channel().to_string(), &watcher, &wake)
            .await
            .map_err(backend_error)?;
        let read = node.holder(&names).await.map_err(backend_error)?;
        let current = read
            .as_ref()
            .map(|read| Holder::new(Some(read.fence), read.value.clone()));
        if current.as_ref() != seen {
            return Ok(());
        }
        match read.and_then(|read| read.lease_left) {
            Some(left) => {
                tokio::select! {
                    () = wake.notified() => {}
                    () = tokio::time::sleep(left) => {}
                }
            }
            None => wake.notified().await,
        }
        Ok(())
    }
}

impl RedisBackend {
    /// The semaphore's holders whose lease (their score, in server ms)
    /// has not ended by the server's clock, read with it in one round
    /// trip; their entries say their counts.
    pub(super) async fn permits_taken_inner(&self, key: &LockKey) -> Result<u32> {
        let names = crate::keys::shared_names(
            &self.inner.prefix,
            key,
            dlock_core::backend::Mode::Permits { count: 1, limit: 1 },
        );
        // One script, routed by the key (on Cluster too): the server's
        // clock and the holders together.
        static READ: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
        let read = READ.get_or_init(|| {
            redis::Script::new(
                "local t = redis.call('TIME') \
                 return {t[1], t[2], redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}",
            )
        });
        let mut conn = self.inner.nodes[0].connection();
        let (secs, micros, holders): (u64, u64, Vec<(String, f64)>) = read
            .key(&names.lock)
            .invoke_async(&mut conn)
            .await
            .map_err(backend_error)?;
        let now_ms = (secs * 1000 + micros / 1000) as f64;
        Ok(holders
            .iter()
            .filter(|(_, ends)| *ends > now_ms)
            .filter_map(|(entry, _)| {
                let tag = entry.rsplit('|').next()?;
                match dlock_core::backend::Mode::from_tag(tag)? {
                    dlock_core::backend::Mode::Permits { count, .. } => Some(count),
                    _ => None,
                }
            })
            .sum())
    }
}
