//! The scenarios, each measured with dlock and, where one exists, with the
//! raw client floor in the same run.

use std::{sync::Arc, time::Duration};

use dlock_core::{LockOptions, Token};
use futures_util::future::BoxFuture;

pub(crate) use crate::lockable::{Lockable, Unlock};
use crate::{report::Row, Target};

mod contended;
mod held;
mod primitives;
mod serial;

use contended::{contended, contended_clients};
use held::{held, reentrant, retained, Release};

/// How many locks the `held` scenario holds at once on one locker.
pub(crate) const HELD_LOCKS: usize = 100_000;
use primitives::primitives;
use serial::{distinct, serial};

/// dlock through a [`dlock_core::Locker`] (one client, as in a service).
pub(crate) struct Dlock(pub(crate) dlock_core::Locker);

impl Lockable for Dlock {
    fn label(&self) -> &str {
        "dlock"
    }

    fn lock<'a>(&'a self, _task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let guard = self
                .0
                .lock_with(key, LockOptions::new().wait(Duration::from_secs(120)))
                .await
                .expect("lock");
            Unlock(Box::pin(
                async move { guard.release().await.expect("release") },
            ))
        })
    }

    fn settle(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.0.wait_for_releases())
    }
}

/// The scenario's name, with the subject's label unless it is dlock.
fn scenario(subject: &dyn Lockable, name: String) -> String {
    match subject.label() {
        "dlock" => name,
        peer => format!("{name} ({peer})"),
    }
}

/// The scenarios a run measures (`--only`); all by default. `peers` runs
/// the peers' recipes through the lock scenarios named beside it.
#[derive(Debug, Default)]
pub(crate) struct Only(Option<Vec<String>>);

impl Only {
    const NAMES: [&str; 10] = [
        "serial",
        "distinct",
        "contended",
        "contended-clients",
        "contended-4x8",
        "reentrant",
        "held",
        "retained",
        "primitives",
        "peers",
    ];

    /// A comma-separated list of [`Only::NAMES`]; `peers` needs a lock
    /// scenario beside it to run them through.
    pub(crate) fn parse(list: &str) -> Result<Only, String> {
        let names: Vec<String> = list.split(',').map(str::to_owned).collect();
        if let Some(unknown) = names.iter().find(|n| !Self::NAMES.contains(&n.as_str())) {
            return Err(format!(
                "unknown scenario `{unknown}`; expected some of {}",
                Self::NAMES.join(", ")
            ));
        }
        let only = Only(Some(names));
        if only.wants("peers")
            && !["serial", "distinct", "contended", "contended-clients"]
                .iter()
                .any(|n| only.wants(n))
        {
            return Err("`peers` runs the peers through serial, distinct, contended or contended-clients: name one of them too".into());
        }
        Ok(only)
    }

    fn wants(&self, name: &str) -> bool {
        self.0
            .as_ref()
            .is_none_or(|names| names.iter().any(|n| n == name))
    }
}

/// Every scenario for `target` that `only` names.
pub(crate) async fn run_all(target: &Target, quick: bool, only: &Only) -> Vec<Row> {
    let scale = if quick { 5 } else { 1 };
    let serial_ops = if target.raw.is_none() { 100_000 } else { 2_000 } / scale;
    let dlock: Arc<dyn Lockable> = Arc::new(Dlock(target.locker(None).await));
    let peers = if only.wants("peers") {
        crate::peers::of(target).await
    } else {
        Vec::new()
    };
    // Every side warmed alike, each on the client it is measured with.
    let sides: Vec<&dyn Lockable> = std::iter::once(&*dlock)
        .chain(peers.iter().map(|p| &**p))
        .collect();
    warm_up(&sides, target.raw.as_deref(), serial_ops / 2).await;
    let mut rows = lock_scenarios(target, dlock, serial_ops, scale, only).await;
    if only.wants("contended-clients") {
        let dlock = || async { Arc::new(Dlock(target.locker(None).await)) as Arc<dyn Lockable> };
        rows.push(contended_clients(target, dlock, 50 / scale).await);
    }
    if only.wants("contended-4x8") {
        let row = counted(target, None, || async {
            match crate::multiproc::contended(target, 4, 8, 100 / scale).await {
                Some(Ok(row)) => Some(row),
                Some(Err(e)) => panic!("contended across processes on {}: {e}", target.name),
                None => None,
            }
        })
        .await;
        rows.extend(row);
    }
    if only.wants("reentrant") {
        rows.push(reentrant(target, 100_000 / scale).await);
    }
    if only.wants("retained") {
        // A round trip of a millisecond (etcd, ZooKeeper) makes 100,000
        // tasks minutes a run; 10,000 still show a byte per task.
        let retained_tasks = match target.name {
            "etcd" | "zookeeper" => 10_000,
            _ => 100_000,
        };
        for release in [Release::Explicit, Release::Drop] {
            rows.push(retained(target, retained_tasks / scale, release).await);
        }
    }
    if only.wants("held") {
        // Each lock the file backend holds is an open file: 100,000 are
        // more than this machine's 20,000 descriptors a process.
        let locks = match target.name {
            "file" => 10_000,
            _ => HELD_LOCKS,
        };
        rows.push(held(target, locks / scale).await);
    }
    if only.wants("primitives") {
        rows.extend(primitives(target, serial_ops, scale).await);
    }
    for (kind, peer) in peers.into_iter().enumerate() {
        rows.extend(lock_scenarios(target, peer, serial_ops, scale, only).await);
        if only.wants("contended-clients") {
            let peer = || async { crate::peers::of(target).await.swap_remove(kind) };
            rows.push(contended_clients(target, peer, 50 / scale).await);
        }
    }
    rows
}

/// Scenarios 1–3 for dlock or a peer, those `only` names.
async fn lock_scenarios(
    target: &Target,
    subject: Arc<dyn Lockable>,
    serial_ops: usize,
    scale: usize,
    only: &Only,
) -> Vec<Row> {
    let mut rows = Vec::new();
    let side = Some(&*subject);
    if only.wants("serial") {
        rows.extend(
            counted(target, side, || async {
                Some(serial(target, &*subject, serial_ops).await)
            })
            .await,
        );
    }
    if only.wants("distinct") {
        rows.extend(
            counted(target, side, || async {
                Some(distinct(target, subject.clone(), 64, 40 / scale).await)
            })
            .await,
        );
    }
    if only.wants("contended") {
        rows.extend(
            counted(target, side, || async {
                Some(contended(target, subject.clone(), "contended-16", 16, 100 / scale).await)
            })
            .await,
        );
    }
    rows
}

/// Runs a scenario for its timings and, where counting requests would slow
/// the servers (`MONITOR` on Redis), once more in a counting pass whose
/// counts the row takes; its timings are dropped. `subject` settles after
/// each run, so that no run is counted or slowed by another's leftovers.
async fn counted<F, Fut>(
    target: &Target,
    subject: Option<&dyn Lockable>,
    scenario: F,
) -> Option<Row>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Option<Row>>,
{
    let settle = || async {
        if let Some(subject) = subject {
            subject.settle().await;
        }
    };
    let mut row = scenario().await?;
    settle().await;
    if target.counts_apart() {
        let _pass = target.counting_pass();
        let counted = scenario().await?;
        settle().await;
        row.requests = counted.requests;
        row.raw_requests = counted.raw_requests;
    }
    Some(row)
}

/// Runs every side and the raw floor alike before anything is measured,
/// each on the client it will be measured with: a JVM server (ZooKeeper)
/// is several times slower until its JIT has warmed up, and a client's
/// first requests set up connections and caches; either would otherwise
/// count against whichever is measured first.
async fn warm_up(sides: &[&dyn Lockable], raw: Option<&crate::raw::Raw>, ops: usize) {
    let token = Token::generate().to_string();
    for _ in 0..ops {
        for side in sides {
            side.lock(0, "bench:warm").await.unlock().await;
        }
        if let Some(raw) = raw {
            raw.lock_unlock("bench-raw-warm", &token).await;
        }
    }
    for side in sides {
        side.settle().await;
    }
}

#[cfg(test)]
mod tests {
    use super::Only;

    #[test]
    fn only_runs_the_named_scenarios_and_refuses_unknown_ones() {
        let only = Only::parse("serial,peers").expect("known names");
        assert!(only.wants("serial") && only.wants("peers"));
        assert!(!only.wants("distinct") && !only.wants("held"));
        assert!(Only::default().wants("contended-4x8"));
        assert!(Only::parse("peers").is_err(), "peers through no scenario");
        let error = Only::parse("serial,seriel").expect_err("a typo");
        assert!(
            error.contains("`seriel`") && error.contains("distinct"),
            "{error}"
        );
    }
}
