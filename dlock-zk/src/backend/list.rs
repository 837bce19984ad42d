//! The ZooKeeper listing: the key parents under the lock path whose first
//! nodes hold, a page at a time in the order of their names.
//!
//! ZooKeeper lists a node's children whole, never a page of them: each
//! page reads the names of all the lock path's children again, so a page
//! costs in proportion to every key under the path, not to the page, and
//! the names must fit in one answer of the server's `jute.maxbuffer`
//! (1 MB by default; past it the listing
//! fails). Then, for the page's keys only, their nodes and the holders'
//! data, [`CONCURRENT_KEYS`] keys at a time.

use dlock_core::{
    backend::{percent_decode, HeldLock, ListCursor, ListPage, ListRequest, ListedKey, Mode},
    LockKey, Result,
};
use futures_util::{stream, StreamExt, TryStreamExt};
use zookeeper_client::{Client, Error as ZkError};

use super::{admitted, backend_error, election, escape, mode_of, sequence, ZkBackend};

/// How many of a page's keys are read at once: their requests share the
/// session's connection, pipelined, without one key's round trips
/// waiting on another's.
const CONCURRENT_KEYS: usize = 16;

/// One page of held locks under `req.prefix`.
pub(super) async fn page(backend: &ZkBackend, req: &ListRequest<'_>) -> Result<ListPage> {
    let path = backend.inner.config.path();
    let root = if path.is_empty() { "/" } else { path };
    let client = backend.synced_client(root).await?;
    let start = match req.prefix {
        "" => String::new(),
        keys => escape(&LockKey::new(keys)?),
    };
    let after = req.after.map(ListCursor::as_str);
    let mut parents: Vec<String> = election::children(&client, root)
        .await?
        .unwrap_or_default()
        .into_iter()
        .filter(|name| name.starts_with(&start) && after.is_none_or(|after| name.as_str() > after))
        .collect();
    parents.sort_unstable();
    let more = parents.len() > req.limit;
    parents.truncate(req.limit);
    let next = parents.last().filter(|_| more).map(ListCursor::new);
    // Made here, run by `buffered` a few at a time (a closure in the
    // stream would make the future not `Send` for every lifetime).
    let reads: Vec<_> = parents
        .iter()
        .map(|name| held(&client, path, name))
        .collect();
    let locks: Vec<Option<HeldLock>> = stream::iter(reads)
        .buffered(CONCURRENT_KEYS)
        .try_collect()
        .await?;
    Ok(ListPage::new(locks.into_iter().flatten().collect(), next))
}

/// The lock `name` names under `path`, if it is held: its nodes (a list),
/// then its holders' data (a read each).
async fn held(client: &Client, path: &str, name: &str) -> Result<Option<HeldLock>> {
    let parent = format!("{path}/{name}");
    let Some(mut children) = election::children(client, &parent).await? else {
        return Ok(None);
    };
    children.sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
    let mut holders = Vec::new();
    for (position, child) in children.iter().enumerate() {
        let mode = mode_of(child).unwrap_or(Mode::Exclusive);
        if !admitted(&children, position, mode) {
            continue;
        }
        match client.get_data(&format!("{parent}/{child}")).await {
            Ok((data, stat)) => holders.push(election::holder_of(&data, &stat).with_mode(mode)),
            // Released between the two reads.
            Err(ZkError::NoNode) => {}
            Err(e) => return Err(backend_error(e)),
        }
    }
    if holders.is_empty() {
        return Ok(None);
    }
    let waiters = u32::try_from(children.len() - holders.len()).unwrap_or(u32::MAX);
    Ok(Some(
        HeldLock::new(key_of(name), holders).with_waiters(waiters),
    ))
}

/// The key a parent's name names: without the kind's suffix, unescaped.
fn key_of(name: &str) -> ListedKey {
    let escaped = name
        .strip_suffix("%rw")
        .or_else(|| name.strip_suffix("%sem"))
        .unwrap_or(name);
    match percent_decode(escaped) {
        Ok(key) => ListedKey::Named(key),
        Err(_) => ListedKey::Hashed(format!("ZooKeeper node {name}")),
    }
}
