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
