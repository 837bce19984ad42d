//! The scenarios, each measured with dlock and, where one exists, with the
//! raw client floor in the same run.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_core::{backend::Mode, LockOptions, Token};
use dlock_testkit::{CountingBackend, OverlapDetector};
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::{
    report::{micros, Row},
    stats::Samples,
    Target,
};

/// Something that locks a key: dlock, or a peer's recipe. `lock` returns the
/// unlock, to await when done.
pub(crate) trait Lockable: Send + Sync {
    /// What the rows call it (`dlock` for ours).
    fn label(&self) -> &str;

    /// Locks `key` for `task` (peers whose ownership is per lease keep one
    /// per task), and returns the unlock.
    fn lock<'a>(&'a self, task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>>;

    /// On Redis, the commands it sends itself, whose server time is its
    /// "Redis busy" (commands its scripts run count inside them).
    fn redis_commands(&self) -> &'static [&'static str] {
        &["evalsha"]
    }

    /// Completes when nothing it started is still on its way to the server
    /// (dlock's background releases): run before the next scenario, so
    /// that no side is counted or slowed by another's leftovers.
    fn settle(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// The unlock of a held lock.
pub(crate) struct Unlock<'a>(pub(crate) BoxFuture<'a, ()>);

impl Unlock<'_> {
    /// Unlocks.
    pub(crate) async fn unlock(self) {
        self.0.await;
    }
}

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
        rows.push(held(target, 10_000 / scale).await);
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

/// The independent clients of `contended-clients`.
const CLIENTS: usize = 16;

/// Pairs of lock + unlock each client of `contended-clients` runs first.
const CLIENT_WARM_UP: usize = 20;

/// One client per task, each with its own connections and session, as
/// separate processes would have: task `i` locks through client `i`.
struct PerTask(Vec<Arc<dyn Lockable>>);

impl Lockable for PerTask {
    fn label(&self) -> &str {
        self.0[0].label()
    }

    fn lock<'a>(&'a self, task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        self.0[task % self.0.len()].lock(task, key)
    }

    fn redis_commands(&self) -> &'static [&'static str] {
        self.0[0].redis_commands()
    }

    fn settle(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            for client in &self.0 {
                client.settle().await;
            }
        })
    }
}

/// `contended-clients-16`: [`CLIENTS`] independent clients made by `make`
/// (dlock's, or a peer's), one task each, on one key: what 16 processes
/// contending look like, without the processes. Each client is warmed
/// first, alike.
async fn contended_clients<F, Fut>(target: &Target, make: F, per_task: usize) -> Row
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Arc<dyn Lockable>>,
{
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        clients.push(make().await);
    }
    let sides: Vec<&dyn Lockable> = clients.iter().map(|c| &**c).collect();
    warm_up(&sides, None, CLIENT_WARM_UP).await;
    let clients: Arc<dyn Lockable> = Arc::new(PerTask(clients));
    let name = format!("contended-clients-{CLIENTS}");
    let row = counted(target, Some(&*clients), || async {
        Some(contended(target, clients.clone(), &name, CLIENTS, per_task).await)
    })
    .await;
    row.expect("a contended row")
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

/// How many turns dlock (or a peer) and the raw floor take in the serial
/// and distinct-key scenarios. On this kind of VM the speed of the whole
/// machine drifts during a run (the floor moves by a third between runs);
/// taking turns, first one side and then the other, makes a drift fall on
/// both alike instead of on whichever ran second.
const TURNS: usize = 8;

/// What one side of a comparison measured, summed over its turns.
struct Side {
    samples: Vec<Duration>,
    elapsed: Duration,
    /// Server requests; `None` once a turn could not count them.
    requests: Option<u64>,
    /// Redis server time on the side's commands, in µs; `None` elsewhere.
    server_usec: Option<u64>,
}

impl Side {
    fn new() -> Side {
        Side {
            samples: Vec::new(),
            elapsed: Duration::ZERO,
            requests: Some(0),
            server_usec: Some(0),
        }
    }

    /// One turn: `ops` calls of `op`, one after another.
    async fn serial_turn<F, Fut>(&mut self, target: &Target, commands: &[&str], ops: usize, op: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        // Redis's server time on the side's own commands (a counting pass
        // reads none: its `INFO`s would count as requests).
        let usec = || {
            if target.in_counting_pass() {
                None
            } else {
                target.redis_server_usec(commands)
            }
        };
        let usec_before = usec();
        let requests = target.count_requests();
        let start = Instant::now();
        self.samples.extend(timed(ops, op).await);
        self.elapsed += start.elapsed();
        self.add_requests(requests.so_far());
        let usec = usec_before
            .zip(usec())
            .map(|(before, after)| after - before);
        self.server_usec = self.server_usec.zip(usec).map(|(a, b)| a + b);
    }

    /// Adds a turn's requests; none counted makes the sum none.
    fn add_requests(&mut self, turn: Option<u64>) {
        self.requests = self.requests.zip(turn).map(|(a, b)| a + b);
    }

    /// Requests per operation over the side's turns.
    fn requests_per_op(&self) -> Option<f64> {
        Some(self.requests? as f64 / self.ops().max(1) as f64)
    }

    fn ops(&self) -> u64 {
        self.samples.len() as u64
    }
}

/// The order of the two sides in turn `turn`: each goes first every other
/// turn. `true` means dlock (or the peer) first.
fn subject_first(turn: usize) -> bool {
    turn.is_multiple_of(2)
}

async fn serial(target: &Target, subject: &dyn Lockable, ops: usize) -> Row {
    let raw = target.raw.as_ref();
    let turns = if raw.is_some() { TURNS } else { 1 };
    let per_turn = ops / turns;
    let token = Token::generate().to_string();
    let (mut ours, mut floor) = (Side::new(), Side::new());
    for turn in 0..turns {
        for subject_now in [subject_first(turn), !subject_first(turn)] {
            match raw {
                _ if subject_now => {
                    ours.serial_turn(target, subject.redis_commands(), per_turn, || async {
                        subject.lock(0, "bench:serial").await.unlock().await
                    })
                    .await
                }
                // The floor sends a `SET` and a script.
                Some(raw) => {
                    floor
                        .serial_turn(target, &["set", "evalsha"], per_turn, || {
                            raw.lock_unlock("bench-raw-serial", &token)
                        })
                        .await
                }
                None => {}
            }
        }
    }
    let ops = ours.ops();
    let requests = ours.requests_per_op();
    let samples = Samples::new(ours.samples);
    let mut row = Row {
        scenario: scenario(subject, "serial".into()),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / ours.elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        requests,
        ..Row::default()
    };
    if raw.is_some() {
        let per_op = |usec: Option<u64>, ops: u64| usec.map(|u| u as f64 / ops.max(1) as f64);
        let mut notes = Vec::new();
        if let (Some(dlock), Some(raw)) = (
            per_op(ours.server_usec, ops),
            per_op(floor.server_usec, floor.ops()),
        ) {
            notes.push(format!("Redis busy {dlock:.1} µs/op (raw {raw:.1})"));
        }
        notes.push(format!("{turns} turns each"));
        row.notes = notes.join("; ");
        row.raw_requests = floor.requests_per_op();
        let floor = Samples::new(floor.samples).quantile(0.5);
        row.raw_p50 = Some(floor);
        row.ratio = Some(row.p50.as_secs_f64() / floor.as_secs_f64());
    }
    row
}

/// Runs `task(i)` for `i` in `0..tasks`, each spawned (as a service's
/// handlers are: futures joined in one task would share its wake-ups and
/// writes); adds their samples to `side`, and the time they all took.
async fn spawn_each<F>(target: &Target, side: &mut Side, tasks: usize, task: F)
where
    F: Fn(usize) -> BoxFuture<'static, Vec<Duration>>,
{
    let requests = target.count_requests();
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks).map(|i| tokio::spawn(task(i))).collect();
    for h in handles {
        side.samples.extend(h.await.expect("task"));
    }
    side.elapsed += start.elapsed();
    side.add_requests(requests.so_far());
}

/// The latency of each of `ops` calls of `op`, one after another.
async fn timed<F, Fut>(ops: usize, mut op: F) -> Vec<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut samples = Vec::with_capacity(ops);
    for _ in 0..ops {
        let t = Instant::now();
        op().await;
        samples.push(t.elapsed());
    }
    samples
}

async fn distinct(
    target: &Target,
    subject: Arc<dyn Lockable>,
    tasks: usize,
    per_task: usize,
) -> Row {
    let raw = target.raw.clone();
    let turns = if raw.is_some() {
        TURNS.min(per_task)
    } else {
        1
    };
    let per_turn = per_task / turns;
    let (mut ours, mut floor) = (Side::new(), Side::new());
    for turn in 0..turns {
        for subject_now in [subject_first(turn), !subject_first(turn)] {
            match &raw {
                _ if subject_now => {
                    spawn_each(target, &mut ours, tasks, |i| {
                        let subject = subject.clone();
                        Box::pin(async move {
                            let key = format!("bench:distinct:{i}");
                            timed(per_turn, || async {
                                subject.lock(i, &key).await.unlock().await
                            })
                            .await
                        })
                    })
                    .await
                }
                Some(raw) => {
                    spawn_each(target, &mut floor, tasks, |i| {
                        let raw = raw.clone();
                        Box::pin(async move {
                            let key = format!("bench-raw-distinct-{i}");
                            let token = Token::generate().to_string();
                            timed(per_turn, || raw.lock_unlock(&key, &token)).await
                        })
                    })
                    .await
                }
                None => {}
            }
        }
    }
    let ops = ours.ops();
    let requests = ours.requests_per_op();
    let samples = Samples::new(ours.samples);
    let mut row = Row {
        scenario: scenario(&*subject, format!("distinct-{tasks}")),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / ours.elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        requests,
        ..Row::default()
    };
    if raw.is_some() {
        let raw_ops = floor.ops() as f64 / floor.elapsed.as_secs_f64();
        row.raw_ops_per_sec = Some(raw_ops);
        row.ratio = Some(raw_ops / row.ops_per_sec);
        row.raw_requests = floor.requests_per_op();
        row.notes = format!("{turns} turns each");
    }
    row
}

/// What a contended run saw, from one process or several.
#[derive(Default)]
pub(crate) struct Contention {
    pub(crate) waits: Vec<Duration>,
    pub(crate) holds: Vec<Duration>,
    pub(crate) owner_changes: usize,
    pub(crate) overlaps: usize,
}

impl Contention {
    /// The row: wait percentiles, owner changes, overlaps, and the wait p99
    /// against `contenders` × (hold + handoff), where hold + handoff is the
    /// measured time per operation.
    pub(crate) fn row(
        self,
        scenario: String,
        target: &Target,
        ops: u64,
        elapsed: Duration,
        requests_per_op: Option<f64>,
        contenders: usize,
    ) -> Row {
        let per_op = elapsed / ops.max(1) as u32;
        let mean_hold = self.holds.iter().sum::<Duration>() / self.holds.len().max(1) as u32;
        let waits = Samples::new(self.waits);
        let turn = per_op * contenders as u32;
        Row {
            scenario,
            backend: target.name.into(),
            ops,
            ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
            p50: waits.quantile(0.5),
            p99: waits.quantile(0.99),
            max: waits.max(),
            requests: requests_per_op,
            overlaps: Some(self.overlaps as u64),
            notes: format!(
                "wait times; owner changes {} of {ops}; hold {:.0} µs + handoff {:.0} µs; wait p99 = {:.2} × {contenders}·(hold + handoff)",
                self.owner_changes,
                micros(mean_hold),
                micros(per_op.saturating_sub(mean_hold)),
                waits.quantile(0.99).as_secs_f64() / turn.as_secs_f64(),
            ),
            ..Row::default()
        }
    }
}

async fn contended(
    target: &Target,
    subject: Arc<dyn Lockable>,
    name: &str,
    tasks: usize,
    per_task: usize,
) -> Row {
    let detector = Arc::new(OverlapDetector::default());
    let last_owner = Arc::new(AtomicUsize::new(usize::MAX));
    let changes = Arc::new(AtomicUsize::new(0));
    let requests = target.count_requests();
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|me| {
            let (subject, detector) = (subject.clone(), detector.clone());
            let (last_owner, changes) = (last_owner.clone(), changes.clone());
            tokio::spawn(async move {
                let (mut waits, mut holds) = (Vec::new(), Vec::new());
                for _ in 0..per_task {
                    let t = Instant::now();
                    let unlock = subject.lock(me, "bench:contended").await;
                    let held = Instant::now();
                    waits.push(held - t);
                    {
                        let _section = detector.enter();
                        if last_owner.swap(me, Ordering::SeqCst) != me {
                            changes.fetch_add(1, Ordering::SeqCst);
                        }
                        // A short critical section.
                        tokio::time::sleep(Duration::from_micros(100)).await;
                    }
                    holds.push(held.elapsed());
                    unlock.unlock().await;
                }
                (waits, holds)
            })
        })
        .collect();
    let mut contention = Contention::default();
    for h in handles {
        let (waits, holds) = h.await.expect("task");
        contention.waits.extend(waits);
        contention.holds.extend(holds);
    }
    let elapsed = start.elapsed();
    let ops = (tasks * per_task) as u64;
    contention.owner_changes = changes.load(Ordering::SeqCst);
    contention.overlaps = detector.overlaps();
    contention.row(
        scenario(&*subject, name.to_owned()),
        target,
        ops,
        elapsed,
        requests.per_op(ops),
        tasks,
    )
}

/// dlock taking `mode` of a key rather than the whole key.
struct DlockMode(dlock_core::Locker, Mode, &'static str);

impl Lockable for DlockMode {
    fn label(&self) -> &str {
        self.2
    }

    fn lock<'a>(&'a self, _task: usize, key: &'a str) -> BoxFuture<'a, Unlock<'a>> {
        Box::pin(async move {
            let options = LockOptions::new().wait(Duration::from_secs(120));
            let guard = self.0.lock_mode(key, self.1, options).await.expect("lock");
            Unlock(Box::pin(
                async move { guard.release().await.expect("release") },
            ))
        })
    }

    fn settle(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.0.wait_for_releases())
    }
}

/// The permits of the semaphore rows, and the share of writes in the
/// read-mostly row (one op in ten).
const PERMITS: u32 = 4;
const WRITE_EVERY: usize = 10;

/// Semaphores and read-write locks, where the backend has them: a permit
/// (1 of [`PERMITS`]) taken and given back serially against the plain
/// lock's raw floor; 16 tasks contending for the [`PERMITS`] permits; and
/// 16 tasks reading one key, one op in [`WRITE_EVERY`] a write.
async fn primitives(target: &Target, serial_ops: usize, scale: usize) -> Vec<Row> {
    let locker = target.locker(None).await;
    let caps = locker.backend().capabilities();
    let mut rows = Vec::new();
    let permit = Mode::Permits {
        count: 1,
        limit: PERMITS,
    };
    if caps.supports(permit) {
        let subject = DlockMode(locker.clone(), permit, "permit 1 of 4");
        warm_up(&[&subject], None, serial_ops / 4).await;
        rows.extend(
            counted(target, Some(&subject), || async {
                Some(serial(target, &subject, serial_ops / 2).await)
            })
            .await,
        );
        rows.extend(
            counted(target, Some(&subject), || async {
                Some(
                    shared_contended(target, &locker, "permits-16", 100 / scale, move |_, _| {
                        permit
                    })
                    .await,
                )
            })
            .await,
        );
    }
    if caps.supports(Mode::Read) {
        rows.extend(
            counted(target, None, || async {
                let row =
                    shared_contended(target, &locker, "read-mostly-16", 100 / scale, |me, i| {
                        if (me + i) % WRITE_EVERY == 0 {
                            Mode::Write
                        } else {
                            Mode::Read
                        }
                    })
                    .await;
                locker.wait_for_releases().await;
                Some(row)
            })
            .await,
        );
    }
    rows
}

/// 16 tasks on one key, each op taking the mode `pick(task, op)` gives and
/// holding it 100 µs: ops/s, the wait, the most permits (or readers) held
/// at once, and writers that found anyone inside (must be 0).
async fn shared_contended(
    target: &Target,
    locker: &dlock_core::Locker,
    name: &str,
    per_task: usize,
    pick: impl Fn(usize, usize) -> Mode + Copy + Send + 'static,
) -> Row {
    const TASKS: usize = 16;
    let inside = Arc::new(AtomicUsize::new(0));
    let writing = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let broken = Arc::new(AtomicUsize::new(0));
    let requests = target.count_requests();
    let start = Instant::now();
    let handles: Vec<_> = (0..TASKS)
        .map(|me| {
            let locker = locker.clone();
            let (inside, writing, most, broken) = (
                inside.clone(),
                writing.clone(),
                most.clone(),
                broken.clone(),
            );
            tokio::spawn(async move {
                let mut waits = Vec::with_capacity(per_task);
                for i in 0..per_task {
                    let mode = pick(me, i);
                    let t = Instant::now();
                    let options = LockOptions::new().wait(Duration::from_secs(120));
                    let guard = locker
                        .lock_mode("bench:shared", mode, options)
                        .await
                        .expect("lock");
                    waits.push(t.elapsed());
                    if mode == Mode::Write {
                        if inside.load(Ordering::SeqCst) != 0
                            || writing.fetch_add(1, Ordering::SeqCst) != 0
                        {
                            broken.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_micros(100)).await;
                        writing.fetch_sub(1, Ordering::SeqCst);
                    } else {
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        if writing.load(Ordering::SeqCst) != 0 {
                            broken.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_micros(100)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                    guard.release().await.expect("release");
                }
                waits
            })
        })
        .collect();
    let mut waits = Vec::new();
    for h in handles {
        waits.extend(h.await.expect("task"));
    }
    let elapsed = start.elapsed();
    let ops = (TASKS * per_task) as u64;
    let samples = Samples::new(waits);
    let most = most.load(Ordering::SeqCst);
    let broken = broken.load(Ordering::SeqCst);
    assert_eq!(broken, 0, "{name} on {}: a writer had company", target.name);
    if name.starts_with("permits") {
        assert!(most <= PERMITS as usize, "{name}: {most} permits at once");
    }
    Row {
        scenario: name.into(),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        requests: requests.per_op(ops),
        overlaps: Some(broken as u64),
        notes: format!(
            "wait times; at most {most} holders at once besides writers; writers with company 0"
        ),
        ..Row::default()
    }
}

async fn reentrant(target: &Target, ops: usize) -> Row {
    let locker = target.locker(None).await;
    let outer = locker.lock("bench:reentrant").await.expect("lock");
    let start = Instant::now();
    outer
        .scope(async {
            for _ in 0..ops {
                drop(locker.lock("bench:reentrant").await.expect("re-lock"));
            }
        })
        .await;
    let elapsed = start.elapsed();
    outer.release().await.expect("release");
    locker.wait_for_releases().await;
    let per_op = elapsed / ops as u32;
    Row {
        scenario: "reentrant".into(),
        backend: target.name.into(),
        ops: ops as u64,
        ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
        p50: per_op,
        p99: per_op,
        max: per_op,
        notes: "mean per re-lock; no I/O".into(),
        ..Row::default()
    }
}

async fn held(target: &Target, locks: usize) -> Row {
    // Ticks (a third of it) far enough apart that a renewal of all the
    // locks, counted through `MONITOR` on one pinned CPU, ends before the
    // next begins.
    let lease = Duration::from_secs(6);
    let base = target.locker(Some(lease)).await;
    // One lock first: the session, connections and caches any first lock
    // sets up are not a per-lock cost.
    base.lock("bench:held:first")
        .await
        .expect("lock")
        .release()
        .await
        .expect("release");
    let counting = Arc::new(CountingBackend::new(base.backend().clone()));
    let locker = dlock_core::LockerBuilder::from_arc(counting.clone())
        .watchdog_lease(lease)
        .build()
        .expect("options");
    let keys: Vec<String> = (0..locks).map(|i| format!("bench:held:{i}")).collect();
    let heap_before = crate::alloc::live_bytes();
    let start = Instant::now();
    let tasks: Vec<_> = (0..64)
        .map(|t| {
            let locker = locker.clone();
            let keys: Vec<String> = keys.iter().skip(t).step_by(64).cloned().collect();
            tokio::spawn(async move {
                let mut guards = Vec::with_capacity(keys.len());
                for key in keys {
                    guards.push(locker.lock(key).await.expect("lock"));
                }
                guards
            })
        })
        .collect();
    let mut guards = Vec::with_capacity(locks);
    for t in tasks {
        guards.extend(t.await.expect("task"));
    }
    let acquired_in = start.elapsed();
    // Counted here on every server (no timing is reported past this
    // point); what the count itself keeps on the heap is left out.
    let _pass = target.counting_pass();
    let heap_at_count = crate::alloc::live_bytes();
    let requests = target.count_requests();
    let counting_heap = crate::alloc::live_bytes() - heap_at_count;
    // The window starts and ends with no renewal on its way, so that it
    // counts whole renewals (a pipeline of 10,000 commands takes a while).
    let settled = || async {
        let until = Instant::now() + lease;
        while Instant::now() < until {
            if counting.renewals_answered() == counting.renewals() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("renewals kept coming without a pause for a whole lease");
    };
    settled().await;
    let (renewals_before, requests_before) = (counting.renewals(), requests.so_far());
    // Two watchdog ticks (a third of the lease each). The heap is sampled
    // meanwhile and its lowest reading kept: what the held locks cost, not
    // the buffers of a renewal batch in flight.
    let until = Instant::now() + lease * 2 / 3 + Duration::from_millis(100);
    let mut heap = isize::MAX;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
        heap = heap.min(crate::alloc::live_bytes());
    }
    settled().await;
    let heap_per_lock = (heap - heap_before - counting_heap) as f64 / locks as f64;
    let ticks_renewals = counting.renewals() - renewals_before;
    let server_requests = requests_before
        .zip(requests.so_far())
        .map(|(before, after)| (after - before) as f64 / ticks_renewals.max(1) as f64);
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    drop(guards);
    // Settled before the next scenario: its requests are not these
    // releases'.
    locker.wait_for_releases().await;
    Row {
        scenario: format!("held-{locks}"),
        backend: target.name.into(),
        ops: locks as u64,
        ops_per_sec: locks as f64 / acquired_in.as_secs_f64(),
        notes: format!(
            "{heap_per_lock:.0} heap bytes per held lock; {ticks_renewals} renew calls in 2 watchdog ticks (0 = the session keepalive covers them){}; lost {lost}",
            match (ticks_renewals, server_requests) {
                (0, Some(n)) => format!(", {:.0} server requests in them", n),
                (_, Some(n)) => format!(", {n:.0} server requests per call"),
                (_, None) => String::new(),
            },
        ),
        ..Row::default()
    }
}

/// How the `retained` scenario's tasks give their lock back.
#[derive(Debug, Clone, Copy)]
enum Release {
    /// `release().await`.
    Explicit,
    /// Dropping the guard (the release runs in a task of its own).
    Drop,
}

/// `tasks` tasks, 64 at a time on 64 keys, each locking and releasing once:
/// the heap bytes still allocated per task once every release has settled.
/// Anything a lock leaves behind after its release grows this number.
async fn retained(target: &Target, tasks: usize, release: Release) -> Row {
    const AT_ONCE: usize = 64;
    let locker = target.locker(None).await;
    let run = |count: usize| {
        let locker = locker.clone();
        async move {
            for batch in 0..count.div_ceil(AT_ONCE) {
                let handles: Vec<_> = (0..AT_ONCE.min(count - batch * AT_ONCE))
                    .map(|i| {
                        let locker = locker.clone();
                        tokio::spawn(async move {
                            let guard = locker
                                .lock(format!("bench:retained:{i}"))
                                .await
                                .expect("lock");
                            match release {
                                Release::Explicit => guard.release().await.expect("release"),
                                Release::Drop => drop(guard),
                            }
                        })
                    })
                    .collect();
                for h in handles {
                    h.await.expect("task");
                }
            }
            locker.wait_for_releases().await;
        }
    };
    // The first rounds grow what is reused later (connection buffers, the
    // runtime's task slabs, the server-side maps of a memory backend).
    run(tasks / 10).await;
    let before = crate::alloc::live_bytes();
    let start = Instant::now();
    run(tasks).await;
    let elapsed = start.elapsed();
    let after = crate::alloc::live_bytes();
    let per_task = (after - before) as f64 / tasks as f64;
    let how = match release {
        Release::Explicit => "release().await",
        Release::Drop => "drop",
    };
    Row {
        scenario: format!("retained-{tasks} ({how})"),
        backend: target.name.into(),
        ops: tasks as u64,
        ops_per_sec: tasks as f64 / elapsed.as_secs_f64(),
        notes: format!(
            "{per_task:.1} heap bytes retained per task after lock + {how} and settled releases ({} in all)",
            after - before
        ),
        ..Row::default()
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
