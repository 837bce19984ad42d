//! Who holds what: a plain lock's holder, and the held plain locks under
//! a key prefix, read with `SCAN` (every master of a cluster in turn;
//! every Redlock node in turn, each key answered by the first node that
//! holds it for the token a majority holds it for).

use std::time::Duration;

use dlock_core::{
    backend::{HeldLock, Holder, ListCursor, ListPage, ListRequest, ListedKey, Mode},
    LockError, Result,
};
use futures_util::future::join_all;
use redis::{
    cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
    ErrorKind, RedisError, RedisResult,
};

use super::{backend_error, first_error, RedisBackend, REDLOCK_NODE_TIMEOUT_MAX};
use crate::{
    keys::Names,
    node::{Conn, Node},
    scripts::election::{self, HolderRead},
};

/// How many keys one `SCAN` call looks at.
const SCAN_COUNT: usize = 1000;

/// The most `SCAN` calls one page makes before it answers (with fewer
/// locks than asked, and where to go on).
const SCANS_PER_PAGE: usize = 32;

/// Where a page ended: which targets were scanned (a fingerprint of
/// their addresses), the node (or cluster master) scanned, the `SCAN`
/// cursor of the batch being read, and the last name answered from it.
struct Position {
    targets: u64,
    target: usize,
    scan: u64,
    after: Option<String>,
}

impl Position {
    fn parse(cursor: &ListCursor) -> Result<Position> {
        let bad = || {
            backend_error(RedisError::from((
                ErrorKind::Client,
                "a list cursor this backend did not write",
            )))
        };
        let mut parts = cursor.as_str().splitn(4, ' ');
        let targets = parts
            .next()
            .and_then(|t| u64::from_str_radix(t, 16).ok())
            .ok_or_else(bad)?;
        let target = parts.next().and_then(|t| t.parse().ok()).ok_or_else(bad)?;
        let scan = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let after = parts.next().map(str::to_owned);
        Ok(Position {
            targets,
            target,
            scan,
            after,
        })
    }

    fn cursor(&self) -> ListCursor {
        match &self.after {
            Some(after) => ListCursor::new(format!(
                "{:x} {} {} {after}",
                self.targets, self.target, self.scan
            )),
            None => ListCursor::new(format!("{:x} {} {}", self.targets, self.target, self.scan)),
        }
    }
}

/// What the targets of a listing are: the addresses of the nodes, or of
/// the cluster's masters, in order.
fn fingerprint(targets: &[Target<'_>]) -> u64 {
    let addresses: Vec<String> = targets
        .iter()
        .map(|target| match target {
            Target::Node(node) => node.addr.clone(),
            Target::Master(_, host, port) => format!("{host}:{port}"),
        })
        .collect();
    dlock_core::backend::key_hash("redis list targets", &addresses.join(" "))
}

/// What `SCAN` is sent to: one node, or one master of a cluster.
enum Target<'a> {
    Node(&'a Node),
    Master(&'a Node, String, u16),
}

/// `%`, `{` and `}` escaped as key names escape them (see `keys::names`),
/// then glob characters escaped for `MATCH`.
fn pattern(namespace: &str, prefix: &str) -> String {
    let mut out = String::with_capacity(namespace.len() + prefix.len() + 5);
    for c in namespace.chars() {
        glob_escaped(&mut out, c);
    }
    out.push_str(":{");
    for c in prefix.chars() {
        match c {
            '%' | '{' | '}' => {
                let mut utf8 = [0u8; 4];
                for b in c.encode_utf8(&mut utf8).bytes() {
                    out.push_str(&format!("%{b:02X}"));
                }
            }
            c => glob_escaped(&mut out, c),
        }
    }
    out.push_str("*}");
    out
}

fn glob_escaped(out: &mut String, c: char) {
    if matches!(c, '*' | '?' | '[' | ']' | '\\') {
        out.push('\\');
    }
    out.push(c);
}

/// The key a plain lock's name holds, unescaped; `None` for a name that
/// is no lock's.
fn key_of(namespace: &str, name: &str) -> Option<String> {
    let escaped = name
        .strip_prefix(namespace)?
        .strip_prefix(":{")?
        .strip_suffix('}')?;
    let bytes = escaped.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl RedisBackend {
    /// A holder as `Backend::holder` and `list` answer it. With fences, a
    /// held key whose counter is missing is an error for `holder`
    /// (`strict`), and listed without a fence, so that one such key does
    /// not fail every listing.
    pub(super) fn holder_of(&self, read: HolderRead, strict: bool) -> Result<Holder> {
        if strict && self.inner.fences && read.fence.is_none() {
            return Err(backend_error(RedisError::from((
                ErrorKind::Parse,
                "the lock is held, but its fence counter is missing",
            ))));
        }
        let fence = read.fence.filter(|_| self.inner.fences);
        let mut holder = Holder::new(fence, read.value).with_mode(Mode::Exclusive);
        if let Some(note) = read.note {
            holder = holder.with_note(note);
        }
        if let Some(left) = read.lease_left {
            holder = holder.with_lease_left(left);
        }
        Ok(holder)
    }

    /// Who holds the plain lock of `names`, and the first node that holds
    /// it for that token (on Redlock, a token a majority holds it for).
    pub(super) async fn read_holder(
        &self,
        names: &Names,
        strict: bool,
    ) -> Result<Option<(usize, Holder)>> {
        let timeout = self.inner.redlock.then_some(REDLOCK_NODE_TIMEOUT_MAX);
        let answers = self
            .on_every_node(timeout, |node| election::holder(node, names))
            .await;
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if answered < self.inner.quorum {
            return Err(first_error(answers));
        }
        let reads: Vec<(usize, HolderRead)> = answers
            .into_iter()
            .enumerate()
            .filter_map(|(i, a)| Some((i, a.ok()??)))
            .collect();
        for (i, read) in &reads {
            let same: Vec<&HolderRead> = reads
                .iter()
                .filter(|(_, r)| r.token == read.token)
                .map(|(_, r)| r)
                .collect();
            if same.len() >= self.inner.quorum {
                let mut read = read.clone();
                // The shortest lease left of the majority: when it may end.
                read.lease_left = same.iter().filter_map(|r| r.lease_left).min();
                return Ok(Some((*i, self.holder_of(read, strict)?)));
            }
        }
        Ok(None)
    }

    /// The nodes `SCAN` runs on, in a fixed order: every node, or every
    /// master of a cluster (sorted by address).
    async fn targets(&self) -> Result<Vec<Target<'_>>> {
        let node = &self.inner.nodes[0];
        if !node.cluster {
            return Ok(self.inner.nodes.iter().map(Target::Node).collect());
        }
        // The master of each slot range, as the cluster's configuration
        // says: every master that holds keys.
        let (slots, _): (Vec<Vec<redis::Value>>, _) = node
            .query(&redis::cmd("CLUSTER").arg("SLOTS").clone(), false)
            .await
            .map_err(backend_error)?;
        let mut masters: Vec<(String, u16)> = slots
            .iter()
            .filter_map(|range| {
                let master: Vec<redis::Value> = redis::from_redis_value_ref(range.get(2)?).ok()?;
                let host = redis::from_redis_value_ref(master.first()?).ok()?;
                let port = redis::from_redis_value_ref(master.get(1)?).ok()?;
                Some((host, port))
            })
            .collect();
        masters.sort();
        masters.dedup();
        Ok(masters
            .into_iter()
            .map(|(host, port)| Target::Master(node, host, port))
            .collect())
    }

    /// One page of the plain locks held under `req.prefix`.
    pub(super) async fn list_page(&self, req: ListRequest<'_>) -> Result<ListPage> {
        let targets = self.targets().await?;
        let fingerprint = fingerprint(&targets);
        let mut at = match req.after {
            Some(cursor) => Position::parse(cursor)?,
            None => Position {
                targets: fingerprint,
                target: 0,
                scan: 0,
                after: None,
            },
        };
        // A cluster whose masters changed between pages (a failover, a
        // master added or removed) would resume on another node's scan:
        // keys skipped or listed twice.
        if at.targets != fingerprint {
            return Err(backend_error(RedisError::from((
                ErrorKind::Client,
                "the cluster's masters changed during the listing: list again",
            ))));
        }
        let namespace = &self.inner.prefix;
        let pattern = pattern(namespace, req.prefix);
        let mut locks = Vec::new();
        for _ in 0..SCANS_PER_PAGE {
            let Some(target) = targets.get(at.target) else {
                return Ok(ListPage::new(sorted(locks), None));
            };
            let (next, mut names) = scan(target, at.scan, &pattern)
                .await
                .map_err(backend_error)?;
            names.sort();
            names.dedup();
            if let Some(after) = &at.after {
                names.retain(|name| name > after);
            }
            let reads = join_all(names.iter().map(|name| async move {
                let Some(key) = key_of(namespace, name) else {
                    return Ok(None);
                };
                let names = Names { lock: name.clone() };
                Ok::<_, LockError>(
                    self.read_holder(&names, false)
                        .await?
                        .map(|read| (key, read)),
                )
            }))
            .await;
            for (name, read) in names.iter().zip(reads) {
                // Held, and answered here: by the first node that holds
                // it for the majority's token.
                if let Some((key, (first, holder))) = read? {
                    if first == at.target || targets.len() == 1 || self.inner.nodes[0].cluster {
                        locks.push(HeldLock::new(ListedKey::Named(key), vec![holder]));
                    }
                }
                if locks.len() == req.limit {
                    at.after = Some(name.clone());
                    return Ok(ListPage::new(sorted(locks), Some(at.cursor())));
                }
            }
            at.after = None;
            if next == 0 {
                at.target += 1;
            }
            at.scan = next;
        }
        let more = (at.target < targets.len()).then(|| at.cursor());
        Ok(ListPage::new(sorted(locks), more))
    }
}

/// A page's locks in key order.
fn sorted(mut locks: Vec<HeldLock>) -> Vec<HeldLock> {
    locks.sort_by_key(|lock| lock.key().to_string());
    locks
}

/// One `SCAN` call: the next cursor and the names it matched.
async fn scan(target: &Target<'_>, cursor: u64, pattern: &str) -> RedisResult<(u64, Vec<String>)> {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_COUNT)
        .arg("TYPE")
        .arg("string");
    let within = Duration::from_secs(5);
    let answer: (u64, Vec<Vec<u8>>) = match target {
        Target::Node(node) => {
            tokio::time::timeout(within, node.query(&cmd, false))
                .await
                .map_err(|_| super::timed_out())??
                .0
        }
        Target::Master(node, host, port) => {
            let Conn::Cluster(mut conn) = node.connection() else {
                return Err(RedisError::from((ErrorKind::Client, "not a cluster")));
            };
            let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            });
            let value = tokio::time::timeout(within, conn.route_command(cmd, routing))
                .await
                .map_err(|_| super::timed_out())??;
            redis::from_redis_value(value)?
        }
    };
    // A name that is not UTF-8 is no name of ours.
    let names = answer
        .1
        .into_iter()
        .filter_map(|n| String::from_utf8(n).ok());
    Ok((answer.0, names.collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_matches_only_lock_names_under_it() {
        assert_eq!(pattern("dlock", "jobs/"), "dlock:{jobs/*}");
        assert_eq!(pattern("dlock", "a*{b}"), "dlock:{a\\*%7Bb%7D*}");
        assert_eq!(key_of("dlock", "dlock:{a%7Bb%7D%25}"), Some("a{b}%".into()));
        assert_eq!(key_of("dlock", "dlock:{a}:fence"), None);
    }
}
