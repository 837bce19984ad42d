//! The etcd listing: the queues under the prefix whose first entries hold,
//! a page of queues at a time, in the order of their names.
//!
//! A page is one range read of at most a few entries per queue asked for,
//! from the cursor (the end of the last queue listed); a queue the read
//! cut is left for the next page, unless it is the page's only one, which
//! is then read whole. Each queue's entries, oldest first, hold as the
//! acquire admits them ([`admitted`]); the rest wait. One more read per
//! distinct lease on the page (a few at a time) gives the holders' lease
//! left. The cursor is the next page's first key in hex: keys under the
//! prefix that other tools wrote need not be UTF-8.

use std::{collections::HashMap, time::Duration};

use dlock_core::{
    backend::{
        admitted, percent_decode, HeldLock, Holder, ListCursor, ListPage, ListRequest, ListedKey,
        Mode,
    },
    InvalidReason, LockError, LockKey, Result,
};
use etcd_client::{GetOptions, KeyValue, SortOrder, SortTarget};
use futures_util::{stream, StreamExt, TryStreamExt};

use super::{escape, holder_of, mode_of, EtcdBackend, NAME};

/// The end of the range of keys that start with `start`: its last byte
/// below 0xFF raised by one, the bytes after it dropped.
fn prefix_end(start: &[u8]) -> Vec<u8> {
    let mut end = start.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The queue an entry's key is in: up to its last `/`.
fn queue_of(key: &[u8]) -> &[u8] {
    let at = key.iter().rposition(|&b| b == b'/').map_or(0, |at| at + 1);
    &key[..at]
}

impl EtcdBackend {
    /// The plain lock's first entry, as a holder, and its lease; one read.
    pub(super) async fn first_holder(&self, key: &LockKey) -> Result<Option<(Holder, i64)>> {
        let (_, entries) = self.read_queue(key, Mode::Exclusive).await?;
        Ok(entries.first().map(|kv| (holder_of(kv), kv.lease())))
    }

    /// How long each of `leases` has left, one read each (retried, a few
    /// at a time); a lease gone or unknown is left out.
    pub(super) async fn leases_left(
        &self,
        leases: impl IntoIterator<Item = i64>,
    ) -> Result<HashMap<i64, Duration>> {
        let mut distinct: Vec<i64> = leases.into_iter().filter(|&l| l != 0).collect();
        distinct.sort_unstable();
        distinct.dedup();
        // Made here, run by `buffer_unordered` a few at a time (a closure
        // in the stream would make the future not `Send` for every
        // lifetime).
        let reads: Vec<_> = distinct
            .into_iter()
            .map(|lease| async move { Ok::<_, LockError>((lease, self.lease_left(lease).await?)) })
            .collect();
        stream::iter(reads)
            .buffer_unordered(CONCURRENT_LEASES)
            .try_filter_map(|(lease, left)| std::future::ready(Ok(left.map(|left| (lease, left)))))
            .try_collect()
            .await
    }
}

/// How many leases' time to live a page reads at once.
const CONCURRENT_LEASES: usize = 16;

/// A cursor holding where the next page starts: an etcd key, any bytes,
/// written as hex (a key need not be UTF-8).
fn cursor_at(key: &[u8]) -> ListCursor {
    ListCursor::new(key.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// The etcd key a [`cursor_at`] cursor holds.
fn cursor_key(cursor: &ListCursor) -> Result<Vec<u8>> {
    let hex = cursor.as_str().as_bytes();
    let bad = || LockError::InvalidOptions {
        reason: InvalidReason::Other(
            "a listing cursor that an etcd backend's listing did not give".to_owned(),
        ),
    };
    if !hex.len().is_multiple_of(2) {
        return Err(bad());
    }
    hex.chunks(2)
        .map(|pair| {
            std::str::from_utf8(pair)
                .ok()
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(bad)
        })
        .collect()
}

/// One page of held locks under `req.prefix`.
pub(super) async fn page(backend: &EtcdBackend, req: &ListRequest<'_>) -> Result<ListPage> {
    if backend.inner.etcdctl {
        return Err(dlock_core::backend::unsupported_list(
            NAME,
            "listing of held locks with layout=etcdctl (its plain locks live outside \
             the prefix, among other tools' keys)",
        ));
    }
    let root = format!("{}/", backend.inner.prefix);
    let start = match req.prefix {
        "" => root.clone(),
        keys => format!("{root}{}", escape(&LockKey::new(keys)?)),
    };
    let end = prefix_end(start.as_bytes());
    let after = req.after.map(cursor_key).transpose()?;
    let from = after.as_deref().unwrap_or(start.as_bytes());
    let fetch = (req.limit * 4 + 16).min(4000);
    let options = GetOptions::new()
        .with_range(end.clone())
        .with_limit(fetch as i64)
        .with_sort(SortTarget::Key, SortOrder::Ascend);
    let mut read = backend.get_bytes(from, options).await?;
    let cut = read.more();
    let mut queues: Vec<Vec<KeyValue>> = Vec::new();
    for kv in read.take_kvs() {
        match queues.last_mut() {
            Some(queue) if queue_of(queue[0].key()) == queue_of(kv.key()) => queue.push(kv),
            _ => queues.push(vec![kv]),
        }
    }
    let mut more = cut;
    if cut && queues.len() > 1 {
        queues.pop();
    } else if cut {
        if let Some(queue) = queues.pop() {
            let name = queue_of(queue[0].key()).to_vec();
            let whole = GetOptions::new().with_prefix();
            queues.push(backend.get_bytes(&name, whole).await?.take_kvs());
        }
    }
    if queues.len() > req.limit {
        queues.truncate(req.limit);
        more = true;
    }
    let next = queues
        .last()
        .filter(|_| more)
        .map(|queue| cursor_at(&prefix_end(queue_of(queue[0].key()))));
    let mut locks = Vec::with_capacity(queues.len());
    let mut leases = Vec::new();
    for mut queue in queues {
        queue.sort_by_key(KeyValue::create_revision);
        let name = String::from_utf8_lossy(queue_of(queue[0].key())).into_owned();
        let mut modes = Vec::with_capacity(queue.len());
        let mut holders = Vec::new();
        for kv in &queue {
            let mode = mode_of(kv.value()).unwrap_or(Mode::Exclusive);
            if admitted(mode, modes.iter().copied()) {
                holders.push((holder_of(kv), kv.lease()));
                leases.push(kv.lease());
            }
            modes.push(mode);
        }
        if holders.is_empty() {
            continue;
        }
        let waiters = u32::try_from(queue.len() - holders.len()).unwrap_or(u32::MAX);
        locks.push((key_of(&name[root.len()..]), holders, waiters));
    }
    let left = backend.leases_left(leases).await?;
    let locks = locks
        .into_iter()
        .map(|(key, holders, waiters)| {
            let holders = holders
                .into_iter()
                .map(|(holder, lease)| match left.get(&lease) {
                    Some(&left) => holder.with_lease_left(left),
                    None => holder,
                })
                .collect();
            HeldLock::new(key, holders).with_waiters(waiters)
        })
        .collect();
    Ok(ListPage::new(locks, next))
}

/// The key a queue's name (after the prefix) names: its escaped key
/// without the kind's suffix and the last `/`, unescaped.
fn key_of(queue: &str) -> ListedKey {
    let escaped = queue.strip_suffix('/').unwrap_or(queue);
    let escaped = escaped
        .strip_suffix("%rw")
        .or_else(|| escaped.strip_suffix("%sem"))
        .unwrap_or(escaped);
    match percent_decode(escaped) {
        Ok(key) => ListedKey::Named(key),
        Err(_) => ListedKey::Hashed(format!("etcd queue {queue}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_and_keys_are_read_back_from_entry_names() {
        assert_eq!(prefix_end(b"locks/a/"), b"locks/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(queue_of(b"locks/a%2Fb%rw/00ff-t"), b"locks/a%2Fb%rw/");
        assert_eq!(key_of("a%2Fb%rw/"), ListedKey::Named("a/b".into()));
        assert_eq!(key_of("x%25sem%sem/"), ListedKey::Named("x%sem".into()));
        assert_eq!(key_of("plain/"), ListedKey::Named("plain".into()));
        for key in [&b"locks/a0"[..], b"locks/b\xff0", b""] {
            assert_eq!(cursor_key(&cursor_at(key)).unwrap(), key);
        }
        for foreign in ["locks/a0", "6", "zz"] {
            let cursor = ListCursor::new(foreign);
            assert!(matches!(
                cursor_key(&cursor),
                Err(LockError::InvalidOptions { .. })
            ));
        }
    }
}
