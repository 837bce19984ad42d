//! Holders: a proclaimed value in our node's data, and the first child of
//! a key's parent read as its holder.

use dlock_core::{
    backend::{Holder, Mode},
    LockError, LockKey, Result, Token,
};
use zookeeper_client::{Client, Error as ZkError};

use super::{backend_error, mode_of, parent_of, sequence, ZkBackend};

/// The data of a node whose holder proclaimed `value`: a marker byte,
/// then the value (a node starts with no data: nothing proclaimed).
fn with_proclaimed(value: &[u8]) -> Vec<u8> {
    let mut data = Vec::with_capacity(value.len() + 1);
    data.push(PROCLAIMED);
    data.extend_from_slice(value);
    data
}

/// What a node's holder proclaimed, if it has.
fn proclaimed(data: &[u8]) -> Option<Vec<u8>> {
    match data.split_first() {
        Some((&PROCLAIMED, value)) => Some(value.to_vec()),
        _ => None,
    }
}

/// The child of a plain lock's parent that holds it: the first by
/// sequence, as acquisition orders them (an unreadable name last).
fn holding(children: Vec<String>) -> Option<String> {
    children
        .into_iter()
        .filter(|c| mode_of(c) == Some(Mode::Exclusive))
        .min_by_key(|c| sequence(c).unwrap_or(i64::MAX))
}

/// Brings the server this session reads from up to date with the leader
/// (`sync`): a follower serves reads from its own copy, which may lag, so
/// without it a holder released through another server could still be
/// read as holding.
async fn synced(client: &Client, path: &str) -> Result<()> {
    match client.sync(path).await {
        Ok(()) | Err(ZkError::NoNode) => Ok(()),
        Err(e) => Err(backend_error(e)),
    }
}

/// The first byte of a proclaimed node's data.
const PROCLAIMED: u8 = 1;

impl ZkBackend {
    pub(super) async fn proclaim_inner(
        &self,
        key: &LockKey,
        token: &Token,
        value: &[u8],
    ) -> Result<bool> {
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        let held = self
            .owned()
            .get(token)
            .filter(|o| o.granted && o.parent == parent)
            .and_then(|o| Some((o.path.clone()?, o.session.clone())));
        let Some((path, session)) = held else {
            return Ok(false);
        };
        let client = match session.client() {
            Ok(client) => client,
            Err(ZkError::SessionExpired) => return Ok(false),
            Err(e) => return Err(backend_error(e)),
        };
        match client.set_data(&path, &with_proclaimed(value), None).await {
            Ok(_) => Ok(true),
            Err(ZkError::NoNode | ZkError::SessionExpired) => Ok(false),
            Err(e) => Err(backend_error(e)),
        }
    }

    pub(super) async fn holder_inner(&self, key: &LockKey) -> Result<Option<Holder>> {
        let session = self.session().await?;
        let client = session.client().map_err(backend_error)?;
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        synced(&client, &parent).await?;
        let mut last = ZkError::NoNode;
        for _ in 0..5 {
            let children = match client.list_children(&parent).await {
                Ok(children) => children,
                Err(ZkError::NoNode) => return Ok(None),
                Err(e) => return Err(backend_error(e)),
            };
            let Some(first) = holding(children) else {
                return Ok(None);
            };
            match client.get_data(&format!("{parent}/{first}")).await {
                Ok((data, stat)) => {
                    let fence = u64::try_from(stat.czxid).unwrap_or(0);
                    return Ok(Some(Holder::new(Some(fence), proclaimed(&data))));
                }
                Err(e @ ZkError::NoNode) => last = e,
                Err(e) => return Err(backend_error(e)),
            }
        }
        Err(backend_error(last))
    }

    /// Deletes the first node of the key's queue, the holder's: its own
    /// watch tells its guard at once, and the next node's watch wakes the
    /// next in line.
    pub(super) async fn force_release_inner(&self, key: &LockKey) -> Result<bool> {
        let session = self.session().await?;
        let client = session.client().map_err(backend_error)?;
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        synced(&client, &parent).await?;
        {
            let children = match client.list_children(&parent).await {
                Ok(children) => children,
                Err(ZkError::NoNode) => return Ok(false),
                Err(e) => return Err(backend_error(e)),
            };
            let Some(first) = holding(children) else {
                return Ok(false);
            };
            let path = format!("{parent}/{first}");
            let curators = super::is_curator(&first)
                && match client.get_data(&path).await {
                    Ok((data, _)) => {
                        data != super::queue::OURS && data.first() != Some(&PROCLAIMED)
                    }
                    Err(ZkError::NoNode) => return Ok(false),
                    Err(e) => return Err(backend_error(e)),
                };
            if curators {
                // Curator's holder does not watch its own node: it would
                // never learn, and hold beside the next one.
                return Err(LockError::Unsupported {
                    backend: super::NAME,
                    what: "forcing the lock of a Curator holder, which would never learn of it",
                });
            }
            match client.delete(&path, None).await {
                Ok(()) => Ok(true),
                // Gone meanwhile (released, expired): the holder asked
                // about left; the next one is not ours to remove.
                Err(ZkError::NoNode) => Ok(false),
                Err(e) => Err(backend_error(e)),
            }
        }
    }

    pub(super) async fn holder_changed_inner(
        &self,
        key: &LockKey,
        seen: Option<&Holder>,
    ) -> Result<()> {
        let session = self.session().await?;
        let client = session.client().map_err(backend_error)?;
        let parent = parent_of(self.inner.config.path(), key, Mode::Exclusive);
        synced(&client, &parent).await?;
        // A first child deleted between the listing and its read is
        // read past a few times; then the caller reads again.
        for _ in 0..5 {
            let (children, children_changed) = match client.list_and_watch_children(&parent).await {
                Ok(listed) => listed,
                Err(ZkError::NoNode) => {
                    let (stat, created) = client
                        .check_and_watch_stat(&parent)
                        .await
                        .map_err(backend_error)?;
                    if stat.is_some() {
                        continue;
                    }
                    if seen.is_some() {
                        return Ok(());
                    }
                    created.changed().await;
                    return Ok(());
                }
                Err(e) => return Err(backend_error(e)),
            };
            let Some(first) = holding(children) else {
                if seen.is_some() {
                    return Ok(());
                }
                children_changed.changed().await;
                return Ok(());
            };
            let read = client
                .get_and_watch_data(&format!("{parent}/{first}"))
                .await;
            let (data, stat, data_changed) = match read {
                Ok(read) => read,
                Err(ZkError::NoNode) => continue,
                Err(e) => return Err(backend_error(e)),
            };
            let current = Holder::new(
                Some(u64::try_from(stat.czxid).unwrap_or(0)),
                proclaimed(&data),
            );
            if Some(&current) != seen {
                return Ok(());
            }
            tokio::select! {
                _ = children_changed.changed() => {}
                _ = data_changed.changed() => {}
            }
            return Ok(());
        }
        Ok(())
    }
}

impl ZkBackend {
    /// The permits of the semaphore's queue that are admitted, read after
    /// a `sync` (see [`dlock_core::backend::permits_taken`]): a node is
    /// there while its session lives.
    pub(super) async fn permits_taken_inner(&self, key: &LockKey, limit: u32) -> Result<u32> {
        let session = self.session().await?;
        let client = session.client().map_err(backend_error)?;
        let parent = parent_of(
            self.inner.config.path(),
            key,
            Mode::Permits { count: 1, limit },
        );
        synced(&client, &parent).await?;
        let mut children = match client.list_children(&parent).await {
            Ok(children) => children,
            Err(ZkError::NoNode) => return Ok(0),
            Err(e) => return Err(backend_error(e)),
        };
        children.sort_by_key(|c| sequence(c).unwrap_or(i64::MAX));
        let modes = children
            .iter()
            .map(|c| mode_of(c).unwrap_or(Mode::Exclusive));
        Ok(dlock_core::backend::permits_taken(modes))
    }
}

impl ZkBackend {
    /// See [`Backend::extend`](dlock_core::backend::Backend::extend): our
    /// node, checked on the leader's state, then the end moved.
    pub(super) async fn extend_inner(
        &self,
        token: &Token,
        lease: std::time::Duration,
    ) -> Result<Option<(tokio::time::Instant, std::time::Duration)>> {
        let held = match self.owned().get(token) {
            Some(owned) if owned.granted => owned.path.clone().map(|p| (p, owned.session.clone())),
            _ => None,
        };
        let Some((path, session)) = held else {
            return Ok(None);
        };
        let client = session.client().map_err(backend_error)?;
        synced(&client, &path).await?;
        match client.check_stat(&path).await {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(None),
            Err(e) => return Err(backend_error(e)),
        }
        Ok(session.extend_fixed(token, lease, &self.inner.lease_ends))
    }
}
