//! The memory backend's listing: the held objects under a prefix, in the
//! order of (key, kind), one page at a time.

use tokio::time::Instant;

use super::{Kind, State};
use crate::{
    backend::{HeldLock, ListCursor, ListPage, ListRequest, ListedKey},
    key::LockKey,
};

/// A cursor's text: the kind's letter, then the key.
fn cursor(key: &LockKey, kind: Kind) -> ListCursor {
    let letter = match kind {
        Kind::Lock => 'l',
        Kind::ReadWrite => 'r',
        Kind::Semaphore => 's',
    };
    ListCursor::new(format!("{letter}{key}"))
}

fn parse(cursor: &ListCursor) -> Option<(&str, Kind)> {
    let text = cursor.as_str();
    let kind = match text.chars().next()? {
        'l' => Kind::Lock,
        'r' => Kind::ReadWrite,
        's' => Kind::Semaphore,
        _ => return None,
    };
    Some((&text[1..], kind))
}

/// One page: the held objects after the cursor, the `limit` first of them
/// by (key, kind), found in one pass over the keys (and a partial sort).
pub(super) fn page(state: &mut State, req: &ListRequest<'_>) -> ListPage {
    let now = Instant::now();
    let after = req.after.and_then(parse);
    let mut found: Vec<(LockKey, Kind)> = state
        .keys
        .iter_mut()
        .filter(|((kind, key), _)| {
            key.as_str().starts_with(req.prefix)
                && after.is_none_or(|(k, kd)| (key.as_str(), *kind) > (k, kd))
        })
        .filter_map(|((kind, key), entry)| {
            entry.expire(now);
            (!entry.holders.is_empty()).then(|| (key.clone(), *kind))
        })
        .collect();
    let order =
        |a: &(LockKey, Kind), b: &(LockKey, Kind)| (a.0.as_str(), a.1).cmp(&(b.0.as_str(), b.1));
    let more = found.len() > req.limit;
    if more {
        found.select_nth_unstable_by(req.limit, order);
        found.truncate(req.limit);
    }
    found.sort_unstable_by(order);
    let next = more.then(|| found.last().map(|(key, kind)| cursor(key, *kind)));
    let locks = found
        .iter()
        .filter_map(|(key, kind)| {
            let entry = state.keys.get(&(*kind, key.clone()))?;
            let holders = entry.holders.iter().map(|h| h.shown(now)).collect();
            let waiters = u32::try_from(entry.queue.len()).unwrap_or(u32::MAX);
            Some(HeldLock::new(ListedKey::Named(key.to_string()), holders).with_waiters(waiters))
        })
        .collect();
    ListPage::new(locks, next.flatten())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{LockOptions, Locker, MemoryBackend};

    /// 100,000 held locks, listed a page of 1000 at a time: each once, in
    /// order, and no page larger than asked.
    #[tokio::test]
    async fn a_hundred_thousand_locks_are_listed_page_by_page() {
        const LOCKS: usize = 100_000;
        let locker = Locker::new(MemoryBackend::new());
        let fixed = LockOptions::new().lease(Duration::from_secs(600));
        let mut guards = Vec::with_capacity(LOCKS);
        for i in 0..LOCKS {
            guards.push(locker.lock_with(format!("k/{i:06}"), fixed).await.unwrap());
        }
        let mut listing = locker.list("k/").page_size(1000);
        let mut seen = 0;
        for _ in 0..=LOCKS / 1000 {
            let Some(page) = listing.next_page().await.unwrap() else {
                break;
            };
            assert!(page.len() <= 1000);
            for lock in &page {
                assert_eq!(lock.key().name(), Some(format!("k/{seen:06}").as_str()));
                seen += 1;
            }
        }
        assert_eq!(seen, LOCKS);
        assert!(listing.next_page().await.unwrap().is_none());
    }
}
