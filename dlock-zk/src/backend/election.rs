//! Holders: a proclaimed value in our node's data, and the first child of
//! a key's parent read as its holder.

use dlock_core::{
    backend::{Holder, Mode},
    Result,
};
use zookeeper_client::{Client, Error as ZkError, Stat};

use super::{backend_error, mode_of, queue::OURS, sequence};

/// The first byte of a proclaimed node's data.
const PROCLAIMED: u8 = 1;

/// The data of a node whose holder proclaimed `value`: a marker byte,
/// then the value (a node starts with no data: nothing proclaimed).
pub(super) fn with_proclaimed(value: &[u8]) -> Vec<u8> {
    let mut data = Vec::with_capacity(value.len() + 1);
    data.push(PROCLAIMED);
    data.extend_from_slice(value);
    data
}

/// The holder a node's data and stat show: its czxid as the fence, and
/// what it proclaimed, if it has.
pub(super) fn holder_of(data: &[u8], stat: &Stat) -> Holder {
    let proclaimed = match data.split_first() {
        Some((&PROCLAIMED, value)) => Some(value.to_vec()),
        _ => None,
    };
    Holder::new(Some(u64::try_from(stat.czxid).unwrap_or(0)), proclaimed)
}

/// Whether a node's data is what dlock writes (before or after a
/// proclaim), not a Curator client's.
pub(super) fn written_by_dlock(data: &[u8]) -> bool {
    data == OURS || data.first() == Some(&PROCLAIMED)
}

/// The children of `parent`; `None` if it does not exist.
pub(super) async fn children(client: &Client, parent: &str) -> Result<Option<Vec<String>>> {
    match client.list_children(parent).await {
        Ok(children) => Ok(Some(children)),
        Err(ZkError::NoNode) => Ok(None),
        Err(e) => Err(backend_error(e)),
    }
}

/// The child of a plain lock's parent that holds it: the first by
/// sequence, as acquisition orders them (an unreadable name last).
pub(super) fn holding(children: Vec<String>) -> Option<String> {
    children
        .into_iter()
        .filter(|c| mode_of(c) == Some(Mode::Exclusive))
        .min_by_key(|c| sequence(c).unwrap_or(i64::MAX))
}

/// Brings the server this session reads from up to date with the leader
/// (`sync`): a follower serves reads from its own copy, which may lag, so
/// without it a holder released through another server could still be
/// read as holding.
pub(super) async fn synced(client: &Client, path: &str) -> Result<()> {
    match client.sync(path).await {
        Ok(()) | Err(ZkError::NoNode) => Ok(()),
        Err(e) => Err(backend_error(e)),
    }
}
