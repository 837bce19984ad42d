//! Fault tests: nothing granted twice, nothing lost, under crashes, pauses,
//! cancel storms and bad input, on every backend and topology (memory where
//! a case applies: it cannot span processes).
//!
//! Cases tried here, per topology (Redis one node, Redlock over 5, etcd 1
//! and 3 members, ZooKeeper 1 and 3 servers, PostgreSQL, MariaDB). A
//! topology's cases share its servers, each on a key of its own (none stops
//! a server); the handoff case, which counts the servers' requests, starts
//! a topology of its own:
//! - the stock scenario across 4 OS processes × 8 tasks: 500 requests
//!   against a stock of 300 in a file, read-pause-write under the lock, each
//!   hold recorded on `CLOCK_MONOTONIC` in a [`HoldLog`] that must show no
//!   two at once (and does show them when run without the lock:
//!   `stock_without_a_lock_is_seen_overlapping`);
//! - handoffs across processes: 16 waiters in 4 processes queue for one
//!   key; every grant follows the previous release within 1/15 of the
//!   30 s lease that bounds every fallback timer (so only the release can
//!   have woken it), holds never overlap, and each handoff costs a few
//!   requests counted by the servers (`MONITOR`, etcd's `/metrics`,
//!   ZooKeeper's `mntr`), not a herd;
//! - a holder process SIGKILLed: others get the lock after its lease or
//!   session timeout, not before, and not much later;
//! - a holder process SIGSTOPped past its lease: another client acquires and
//!   writes with its fencing token; on SIGCONT the old holder's guard
//!   reports lost before any guarded work, and a fenced store rejects its
//!   late write (Redlock gives no fencing tokens, so only the first part);
//! - a cancel storm: 1,000 `lock()` futures dropped at random points while
//!   the key is contended, after which the key is free at once (memory too);
//! - permits across processes, on every topology with semaphores (all but
//!   Redlock): 3 permits,
//!   two holder processes (one SIGKILLed, one SIGSTOPped past its lease)
//!   and 4 worker processes × 3 tasks; every hold on `CLOCK_MONOTONIC`,
//!   never more than 3 at once (and more without the semaphore:
//!   `permits_without_a_semaphore_are_seen_exceeding`); a new client then
//!   takes all 3 (both holders' permits came back),
//!   and the resumed holder reports its permit lost before any work.
//!
//! Bad input, each a typed error with no panic and no hang:
//! - keys: empty, 1 MiB (and NUL, `/`, `..`, unicode are valid and distinct:
//!   the conformance suite's `invalid_input_gives_typed_errors` and
//!   `awkward_keys_are_distinct_locks`, run on every backend);
//! - durations: zero, 1 ns and 999 µs fixed leases, `Duration::MAX` leases,
//!   watchdog leases of 0, 1 ms and `Duration::MAX`, a `Duration::MAX` wait
//!   (same conformance check);
//! - malformed URLs for every scheme (`malformed_urls_are_typed_errors`);
//! - an unreachable port for every backend;
//! - a port that speaks another protocol: each backend pointed at another
//!   backend's server, and at a server that answers garbage;
//! - a server that closes the connection in the middle of a reply.
//!
//! Server restarts and connections cut mid-hold, and cluster members lost,
//! are in each backend's own tests (`dlock-redis/tests/redis.rs`,
//! `dlock-etcd/tests/etcd.rs`, `dlock-zk/tests/zk.rs`).

use std::{path::Path, process::Stdio, time::Duration};

use dlock_core::{LockError, LockOptions, Locker};
use dlock_testkit::{
    conformance,
    fixture::{
        free_port, EtcdServer, MariaDbServer, PostgresServer, RedisServer, Shared, ZooKeeperServer,
    },
    monotonic_ns, FencedStore, Harness, HoldLog,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdout, Command},
    time::Instant,
};

const HELPER: &str = env!("CARGO_BIN_EXE_dlock-fault-helper");

/// A running topology: its URL, its servers, and its holders' lease (or
/// session timeout) in the kill and pause cases.
struct Topology {
    name: &'static str,
    url: String,
    lease: Duration,
    fencing: bool,
    /// The server ends a client's locks when its connection closes
    /// (PostgreSQL): a killed holder's lock passes on at once.
    disconnect_releases: bool,
    /// Semaphores are offered (all but Redlock).
    semaphores: bool,
    /// Requests per handoff (per node for Redlock) that the handoff test
    /// allows, counted by the servers: a release and the next waiter's few
    /// steps, measured at about 0.7 of this. A herd (every waiter trying at
    /// each release) costs more.
    handoff_requests: f64,
    servers: Box<dyn Servers>,
}

/// A topology's servers, kept running while the test needs them.
trait Servers: Send + Sync {
    /// How many nodes each lock request goes to (5 for Redlock over 5; 1
    /// for a cluster whose client talks to one member).
    fn fan_out(&self) -> usize {
        1
    }
    /// Starts counting the requests clients send, summed over the nodes, by
    /// the servers' own count; the function returned says how many so far.
    fn count_requests(&self) -> Box<dyn Fn() -> u64 + '_>;
}

impl Servers for Vec<RedisServer> {
    fn fan_out(&self) -> usize {
        self.len()
    }
    fn count_requests(&self) -> Box<dyn Fn() -> u64 + '_> {
        let monitors: Vec<_> = self.iter().map(|s| s.monitor().expect("MONITOR")).collect();
        Box::new(move || {
            monitors
                .iter()
                .map(|m| m.commands().expect("MONITOR"))
                .sum()
        })
    }
}

/// Counts from a counter the servers keep since they started.
fn counted_since_now<'a>(total: impl Fn() -> u64 + 'a) -> Box<dyn Fn() -> u64 + 'a> {
    let before = total();
    Box::new(move || total() - before)
}

impl Servers for Vec<EtcdServer> {
    fn count_requests(&self) -> Box<dyn Fn() -> u64 + '_> {
        counted_since_now(|| {
            self.iter()
                .map(|s| {
                    s.grpc_requests()
                        .expect("etcd /metrics")
                        .values()
                        .sum::<u64>()
                })
                .sum()
        })
    }
}

impl Servers for Vec<ZooKeeperServer> {
    fn count_requests(&self) -> Box<dyn Fn() -> u64 + '_> {
        counted_since_now(|| {
            self.iter()
                .map(|s| s.packets_received().expect("mntr"))
                .sum()
        })
    }
}

fn redis() -> Topology {
    let server = RedisServer::start().expect("redis-server");
    Topology {
        name: "redis",
        url: server.url(),
        lease: Duration::from_secs(1),
        fencing: true,
        disconnect_releases: false,
        semaphores: true,
        // The release, one attempt per process with a waiter (a process's
        // waiters queue locally: one is woken), and the woken one's
        // subscription: about 7.
        handoff_requests: 9.0,
        servers: Box::new(vec![server]),
    }
}

fn redlock() -> Topology {
    let servers = RedisServer::start_many(5).expect("redis-server");
    Topology {
        name: "redlock",
        url: RedisServer::redlock_url(&servers),
        lease: Duration::from_secs(1),
        fencing: false,
        disconnect_releases: false,
        semaphores: false,
        // The processes' woken contenders split the votes, give them back
        // and retry after a random delay: 12 to 15 per node. A queue across
        // processes is to bring this to the single node's.
        handoff_requests: 20.0,
        servers: Box::new(servers),
    }
}

fn etcd(members: usize) -> Topology {
    let servers = EtcdServer::cluster(members).expect("etcd");
    let endpoints: Vec<String> = servers.iter().map(EtcdServer::endpoint).collect();
    Topology {
        name: "etcd",
        url: format!("etcd://{}/faults", endpoints.join(",")),
        // The session TTL (etcd's shortest here is 1 s).
        lease: Duration::from_secs(2),
        fencing: true,
        disconnect_releases: false,
        semaphores: true,
        // Each waiter watches only the key ahead of it: about 2.
        handoff_requests: 4.0,
        servers: Box::new(servers),
    }
}

fn zookeeper(servers: usize) -> Topology {
    // An ensemble's JVMs share the two cores with the rest of the suite:
    // give its sessions more room.
    let timeout = if servers > 1 { 4 } else { 2 };
    let servers = ZooKeeperServer::ensemble(servers).expect("ZooKeeper");
    let endpoints: Vec<String> = servers.iter().map(ZooKeeperServer::endpoint).collect();
    Topology {
        name: "zookeeper",
        url: format!(
            "zk://{}/faults?session_timeout={timeout}s",
            endpoints.join(",")
        ),
        lease: Duration::from_secs(timeout),
        fencing: true,
        disconnect_releases: false,
        semaphores: true,
        // Each waiter watches only the node ahead of it: about 2.5.
        handoff_requests: 4.0,
        servers: Box::new(servers),
    }
}

impl Servers for PostgresServer {
    fn count_requests(&self) -> Box<dyn Fn() -> u64 + '_> {
        let count = self.count_statements().expect("log_statement");
        Box::new(move || count.so_far().expect("the server's log"))
    }
}

fn postgres() -> Topology {
    let server = PostgresServer::start().expect("PostgreSQL");
    Topology {
        name: "postgres",
        url: format!("{}?session_timeout=2s", server.url()),
        // The session timeout: a paused holder's session ends after it.
        lease: Duration::from_secs(2),
        fencing: true,
        disconnect_releases: true,
        semaphores: true,
        // The release, the next waiter's token, and the releaser's own
        // attempt if it locks again: the server's queue wakes one waiter.
        handoff_requests: 4.0,
        servers: Box::new(server),
    }
}

impl Servers for MariaDbServer {
    fn count_requests(&self) -> Box<dyn Fn() -> u64 + '_> {
        let count = self.count_statements().expect("general_log");
        Box::new(move || count.so_far().expect("the server's log"))
    }
}

fn mysql() -> Topology {
    let server = MariaDbServer::start().expect("MariaDB");
    Topology {
        name: "mysql",
        url: format!("{}?session_timeout=2s", server.url()),
        // The session timeout: a paused holder's session ends after it.
        lease: Duration::from_secs(2),
        fencing: true,
        disconnect_releases: true,
        semaphores: true,
        // As PostgreSQL's: the server's queue wakes one waiter.
        handoff_requests: 4.0,
        servers: Box::new(server),
    }
}

fn helper(args: &[&str]) -> Child {
    Command::new(HELPER)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start the helper")
}

async fn next_line(lines: &mut Lines<BufReader<ChildStdout>>, within: Duration) -> String {
    match tokio::time::timeout(within, lines.next_line()).await {
        Ok(Ok(Some(line))) => line,
        other => panic!("the helper printed nothing in {within:?}: {other:?}"),
    }
}

fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id().expect("the helper runs")).expect("a pid");
    // SAFETY: kill(2) on our own child, which has not been reaped.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signal {signal}");
}

async fn locker(url: &str) -> Locker {
    // Servers under load (a cluster next to a busy test) may need a retry.
    for _ in 0..10 {
        if let Ok(client) = dlock_testkit::connect(url).await {
            return Locker::from_arc(client);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Locker::from_arc(dlock_testkit::connect(url).await.expect("connect"))
}

/// Runs the stock scenario: 4 processes × 8 tasks, 500 requests against a
/// stock of 300 in a file, each read-pause-write under the lock at `url`
/// (or under none, with `--no-lock`). Returns what was sold, what remains,
/// how many releases failed, and the log every hold was recorded in.
async fn stock_scenario(name: &str, url: &str, dir: &Path) -> (u64, i64, u64, HoldLog) {
    let file = dir.join("stock");
    std::fs::write(&file, "300").unwrap();
    let holds = HoldLog::new(&dir.join("holds"));
    let (file_arg, holds_arg) = (file.to_str().unwrap(), holds.path().to_str().unwrap());
    let children: Vec<Child> = (0..4)
        .map(|_| {
            let mut c = Command::new(HELPER);
            c.args(["stock", url, "stock:42", file_arg, "125", "8", holds_arg])
                .stdout(Stdio::piped())
                .kill_on_drop(true);
            c.spawn().expect("start the helper")
        })
        .collect();
    let (mut sold, mut failed_releases) = (0, 0);
    for child in children {
        let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("[{name}] a stock process did not finish"))
            .unwrap();
        assert!(out.status.success(), "[{name}] a stock process failed");
        let text = String::from_utf8_lossy(&out.stdout);
        let numbers: Vec<u64> = text
            .split_whitespace()
            .filter_map(|word| word.parse().ok())
            .collect();
        let [s, f] = numbers[..] else {
            panic!("[{name}] expected `sold <n> failed-releases <n>`, got {text}")
        };
        sold += s;
        failed_releases += f;
    }
    let remaining = std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (sold, remaining, failed_releases, holds)
}

async fn stock_across_processes(t: &Topology) {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let (sold, remaining, failed_releases, holds) =
        stock_scenario(t.name, &t.url, dir.path()).await;
    let (intervals, overlaps) = (holds.intervals().unwrap(), holds.overlaps().unwrap());
    println!(
        "[{}] 4 processes × 8 tasks, 500 requests: sold {sold}, remaining {remaining}, \
         {} holds, {overlaps} overlapping, in {:?}",
        t.name,
        intervals.len(),
        start.elapsed()
    );
    assert_eq!(intervals.len(), 500, "[{}] one hold per request", t.name);
    assert_eq!(overlaps, 0, "[{}] two holders at once", t.name);
    assert_eq!(failed_releases, 0, "[{}] releases failed", t.name);
    assert_eq!(sold, 300, "[{}] sold {sold} of a stock of 300", t.name);
    assert_eq!(remaining, 0, "[{}]", t.name);
}

/// The detector's self-test: the same scenario with no lock must be seen
/// overlapping, or a zero above would prove nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_without_a_lock_is_seen_overlapping() {
    let dir = tempfile::tempdir().unwrap();
    let (sold, _, _, holds) = stock_scenario("no lock", "--no-lock", dir.path()).await;
    let (intervals, overlaps) = (holds.intervals().unwrap(), holds.overlaps().unwrap());
    println!(
        "[no lock] {} holds, {overlaps} overlapping, sold {sold}",
        intervals.len()
    );
    assert_eq!(intervals.len(), 500, "one hold per request");
    assert!(overlaps > 0, "the detector saw no overlap without a lock");
}

/// A waiter killed while it stands in line, with a lease of an hour,
/// holds the line up for seconds, not for its lease: once the holder
/// releases, the next waiter gets the lock within seconds: the longer of
/// 15 s and two leases or session timeouts (a Redis ticket lives two
/// response timeouts unrefreshed, 10 s by default; etcd's waiting session
/// 10 s; ZooKeeper's its timeout; a database ends the session at once).
async fn waiter_killed_in_line(t: &Topology) {
    let bound = Duration::from_secs(15).max(t.lease * 2);
    let holder = locker(&t.url).await;
    let held = holder
        .lock_with("line", LockOptions::new().wait(Duration::from_secs(30)))
        .await
        .unwrap();
    let mut child = helper(&["wait-long", &t.url, "line", "3600000"]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(
        next_line(&mut lines, Duration::from_secs(30)).await,
        "waiting"
    );
    // In line (on every backend a first attempt takes well under this).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let next = locker(&t.url).await;
    let waiting = tokio::spawn(async move {
        let won = next
            .lock_with(
                "line",
                LockOptions::new().wait(bound + Duration::from_secs(5)),
            )
            .await;
        (won, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&child, libc::SIGKILL);
    let _ = child.wait().await;
    let released = Instant::now();
    held.release().await.unwrap();
    let (won, at) = waiting.await.unwrap();
    let after = at.saturating_duration_since(released);
    println!(
        "[{}] the next waiter got the lock {after:?} after the release, behind a killed one",
        t.name
    );
    let _won = won.unwrap_or_else(|e| panic!("[{}] the next waiter: {e}", t.name));
    assert!(
        after < bound,
        "[{}] a killed waiter held the line up for {after:?} (bound {bound:?})",
        t.name
    );
}

async fn holder_killed(t: &Topology) {
    let lease = t.lease.as_millis().to_string();
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().to_str().unwrap();
    let holds = HoldLog::new(&dir.path().join("holds"));
    let holds_arg = holds.path().to_str().unwrap();
    let mut child = helper(&["hold", &t.url, "killed", &lease, store_dir, holds_arg]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let acquired = next_line(&mut lines, Duration::from_secs(30)).await;
    assert!(acquired.starts_with("acquired"), "{acquired}");
    // A waiter queues while the holder lives and renews (for a whole lease):
    // granted before the kill, its hold would overlap the holder's last
    // recorded work.
    let other = locker(&t.url).await;
    let waiting = tokio::spawn({
        let other = other.clone();
        async move {
            let next = other
                .lock_with("killed", LockOptions::new().wait(Duration::from_secs(60)))
                .await;
            (next, Instant::now(), monotonic_ns())
        }
    });
    tokio::time::sleep(t.lease).await;
    let killed = Instant::now();
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let early = other.try_lock("killed").await.unwrap();
    let (next, granted, granted_ns) = waiting.await.unwrap();
    let next = next.unwrap();
    let after = granted.saturating_duration_since(killed);
    holds.record("next", granted_ns, monotonic_ns()).unwrap();
    assert_eq!(
        holds.intervals().unwrap().len(),
        2,
        "[{}] the killed holder's hold and the next",
        t.name
    );
    assert_eq!(
        holds.overlaps().unwrap(),
        0,
        "[{}] two holders at once",
        t.name
    );
    assert!(early.is_none(), "[{}] free right after the kill", t.name);
    println!(
        "[{}] a killed holder's lock passed on after {after:?} (lease {:?})",
        t.name, t.lease
    );
    if t.disconnect_releases {
        // The kill closed its connections, and the server gave the lock to
        // the waiter first in line at once.
        assert!(
            after < t.lease / 2,
            "[{}] a killed holder's closed connection kept its lock {after:?}",
            t.name
        );
        drop(next);
        return;
    }
    // Its last renewal was about a third of the lease before the kill (a
    // late tick makes it earlier): half the lease is a safe lower bound.
    assert!(
        after >= t.lease / 2,
        "[{}] acquired {after:?} after the kill",
        t.name
    );
    assert!(
        after < t.lease + Duration::from_secs(5),
        "[{}] took {after:?}",
        t.name
    );
    drop(next);
}

async fn holder_paused(t: &Topology) {
    let lease = t.lease.as_millis().to_string();
    let dir = tempfile::tempdir().unwrap();
    let store = FencedStore::new(dir.path());
    let store_dir = dir.path().to_str().unwrap();
    // The fenced store is this case's exact detector: a holder stopped
    // between its check and its write acts once more after another owner
    // took the lock (the window fencing exists for), so its hold log could
    // show an overlap a correct lock does not prevent; the store must
    // refuse that act.
    let holds = dir.path().join("holds");
    let mut child = helper(&[
        "hold",
        &t.url,
        "paused",
        &lease,
        store_dir,
        holds.to_str().unwrap(),
    ]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let acquired = next_line(&mut lines, Duration::from_secs(30)).await;
    let old_fence = acquired
        .strip_prefix("acquired ")
        .expect("acquired <fence>")
        .to_owned();
    tokio::time::sleep(t.lease / 2).await;

    // Paused outside a write: a holder stopped inside one would keep the
    // store locked (resumed for a moment while its lease is still good).
    signal(&child, libc::SIGSTOP);
    for _ in 0..100 {
        if !store.is_busy().unwrap() {
            break;
        }
        signal(&child, libc::SIGCONT);
        tokio::time::sleep(Duration::from_millis(2)).await;
        signal(&child, libc::SIGSTOP);
    }
    assert!(
        !store.is_busy().unwrap(),
        "the holder kept the store locked"
    );
    let paused_at = store.log().unwrap().len();
    let other = locker(&t.url).await;
    let next = other
        .lock_with("paused", LockOptions::new().wait(Duration::from_secs(30)))
        .await
        .unwrap();
    if t.fencing {
        let fence = next.fencing_token().expect("a fence");
        assert!(
            store.write("next", fence).unwrap(),
            "the new owner was refused"
        );
    }
    signal(&child, libc::SIGCONT);

    // The first thing the resumed holder says is that it lost the lock.
    let first = next_line(&mut lines, Duration::from_secs(10)).await;
    assert!(
        first.starts_with("lost"),
        "[{}] a resumed holder went on: {first}",
        t.name
    );
    let late = next_line(&mut lines, Duration::from_secs(10)).await;
    let late_fence = late
        .strip_prefix("late-write ")
        .expect("late-write <fence> <verdict>");
    assert!(
        late_fence.starts_with(&old_fence),
        "{late} after {acquired}"
    );
    let log = store.log().unwrap();
    if t.fencing {
        let before: Vec<_> = log[..paused_at]
            .iter()
            .filter(|w| w.writer == "holder")
            .collect();
        assert!(
            !before.is_empty() && before.iter().all(|w| w.accepted),
            "[{}] the holder did no guarded work while it held: {before:?}",
            t.name
        );
        let after: Vec<_> = log[paused_at..]
            .iter()
            .filter(|w| w.writer == "holder")
            .collect();
        assert!(
            !after.is_empty() && after.iter().all(|w| !w.accepted),
            "[{}] the store took a write of the resumed holder: {after:?}",
            t.name
        );
        assert!(late.ends_with(" rejected"), "[{}] {late}", t.name);
    } else {
        assert_eq!(
            late_fence, "none",
            "[{}] fences where none are promised",
            t.name
        );
        assert!(
            log.is_empty(),
            "[{}] writes without fences: {log:?}",
            t.name
        );
    }
    println!(
        "[{}] the resumed holder said `{first}` first; its late write was refused",
        t.name
    );
    drop(next);
    let _ = child.wait().await;
}

/// The watchdog lease in the handoff test, for its first holder and the
/// helpers' waiters alike: a holder's TTL stays between 20 and 30 s, and
/// every other fallback timer is as long (see the helper's `waiters`), so a
/// waiter granted within a fraction of it was woken by the release.
const LONG: Duration = dlock_testkit::HANDOFF_FALLBACKS;

/// 16 waiters in 4 processes (4 tasks each) queue for one key; each holds
/// it 50 ms. Every grant must follow the previous release promptly (well
/// inside [`LONG`], which no wake-up but the release's beats), no two holds
/// may overlap, and each handoff may cost only a few server requests.
async fn handoffs_across_processes(t: &Topology) {
    let dir = tempfile::tempdir().unwrap();
    let holds = HoldLog::new(&dir.path().join("holds"));
    let holds_arg = holds.path().to_str().unwrap();
    let client = dlock_testkit::connect(&t.url).await.expect("connect");
    let first = dlock_core::LockerBuilder::from_arc(client)
        .watchdog_lease(LONG)
        .build()
        .unwrap();
    let held = first.lock("herd").await.unwrap();
    let start = monotonic_ns();
    let mut children: Vec<_> = (0..4)
        .map(|_| {
            let mut child = helper(&["waiters", &t.url, "herd", "4", "50", holds_arg]);
            let lines = BufReader::new(child.stdout.take().unwrap()).lines();
            (child, lines)
        })
        .collect();
    for (_, lines) in &mut children {
        let waiting = next_line(lines, Duration::from_secs(30)).await;
        assert_eq!(waiting, "waiting", "[{}]", t.name);
    }
    // Time for every waiter to reach the servers and settle on its watch.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let requests = t.servers.count_requests();
    holds.record("first", start, monotonic_ns()).unwrap();
    held.release().await.unwrap();
    for (child, lines) in &mut children {
        let done = next_line(lines, Duration::from_secs(120)).await;
        assert_eq!(done, "done", "[{}]", t.name);
        assert!(child.wait().await.unwrap().success(), "[{}]", t.name);
    }
    let used = requests();
    let intervals = holds.intervals().unwrap();
    assert_eq!(intervals.len(), 17, "[{}] the first hold and 16", t.name);
    assert_eq!(
        holds.overlaps().unwrap(),
        0,
        "[{}] two holders at once",
        t.name
    );
    let mut gaps: Vec<Duration> = intervals
        .windows(2)
        .map(|w| Duration::from_nanos(w[1].start.saturating_sub(w[0].end)))
        .collect();
    gaps.sort();
    #[allow(clippy::cast_precision_loss)] // counts far below 2^52
    let per_handoff = used as f64 / 16.0 / t.servers.fan_out() as f64;
    println!(
        "[{}] 16 handoffs over 4 processes: gap median {:?}, max {:?}; \
         {used} requests, {per_handoff:.1} per handoff (and node it goes to)",
        t.name,
        gaps[gaps.len() / 2],
        gaps[gaps.len() - 1],
    );
    assert!(
        gaps[gaps.len() - 1] < LONG / 15,
        "[{}] a waiter slept through a release: gaps {gaps:?}",
        t.name
    );
    assert!(
        per_handoff <= t.handoff_requests,
        "[{}] {per_handoff:.1} requests per handoff: a herd",
        t.name
    );
}

async fn cancel_storm(t: &Topology) {
    let url = t.url.clone();
    let harness = Harness::new(t.name, move || {
        let url = url.clone();
        async move { dlock_testkit::connect(&url).await }
    });
    let start = Instant::now();
    conformance::cancel_storm(&harness, 1000).await;
    println!(
        "[{}] 1,000 cancelled acquires, key free afterwards, in {:?}",
        t.name,
        start.elapsed()
    );
}

/// Three candidates in three processes elect a leader; it is SIGKILLed,
/// and another leads within its lease; that one is SIGSTOPped past its
/// lease, and the third leads; resumed, the stopped one's first word is
/// `deposed`, and its late write with its old term is refused by the
/// fenced store. Every leadership's fenced work is recorded on
/// `CLOCK_MONOTONIC`: no two overlap (the exact detector), and terms
/// strictly increase.
async fn election_across_processes(t: &Topology) {
    if !t.fencing {
        let refused = locker(&t.url).await.elect("scheduler");
        assert!(
            matches!(refused, Err(LockError::Unsupported { .. })),
            "[{}] an election without fencing tokens: {refused:?}",
            t.name
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = FencedStore::new(dir.path());
    let holds = HoldLog::new(&dir.path().join("holds"));
    let lease = t.lease.as_millis().to_string();
    let args = [
        "lead",
        &t.url,
        "scheduler",
        &lease,
        dir.path().to_str().unwrap(),
        holds.path().to_str().unwrap(),
    ];
    // Each candidate's lines, tagged with its index, on one channel.
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<(usize, String)>();
    let mut children = Vec::new();
    for i in 0..3 {
        let mut child = helper(&args);
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let tx = lines_tx.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                let _ = tx.send((i, line));
            }
        });
        children.push(child);
    }
    let name = t.name;
    async fn said(
        lines: &mut tokio::sync::mpsc::UnboundedReceiver<(usize, String)>,
        within: Duration,
        name: &str,
    ) -> (usize, String) {
        tokio::time::timeout(within, lines.recv())
            .await
            .unwrap_or_else(|_| panic!("[{name}] no candidate spoke in {within:?}"))
            .expect("the candidates' lines")
    }
    let term_of = |line: &str| -> u64 {
        line.strip_prefix("leader ")
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("[{name}] expected `leader <term>`, got {line}"))
    };
    // A follower outside the election asks who leads: the term the
    // leader announced, and the process it proclaimed.
    let follower = locker(&t.url).await;
    let pids: Vec<u32> = children.iter().map(|c| c.id().expect("a pid")).collect();
    let follower_reads = |term: u64, i: usize| {
        let (follower, pid) = (&follower, pids[i]);
        async move {
            let leader = follower.leader("scheduler").await;
            let leader = leader.unwrap_or_else(|e| panic!("[{name}] who leads: {e}"));
            let leader = leader.unwrap_or_else(|| panic!("[{name}] nobody leads in term {term}"));
            assert_eq!(
                (leader.term, leader.value),
                (term, Some(format!("pid {pid}").into_bytes())),
                "[{name}] the leader a follower reads"
            );
        }
    };
    let (first, line) = said(&mut lines, Duration::from_secs(60), name).await;
    let first_term = term_of(&line);
    follower_reads(first_term, first).await;
    children[first].start_kill().unwrap();
    let killed = Instant::now();
    let (second, line) = said(&mut lines, t.lease + Duration::from_secs(10), name).await;
    let second_term = term_of(&line);
    assert_ne!(second, first, "[{name}] the killed candidate spoke");
    println!(
        "[{name}] a killed leader's successor led after {:?} (lease {:?})",
        killed.elapsed(),
        t.lease
    );
    follower_reads(second_term, second).await;
    signal(&children[second], libc::SIGSTOP);
    let (third, line) = said(&mut lines, t.lease + Duration::from_secs(10), name).await;
    let third_term = term_of(&line);
    assert!(
        third != first && third != second,
        "[{name}] candidate {third} spoke after leading"
    );
    follower_reads(third_term, third).await;
    // The new leader works for a while, then the stopped one resumes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&children[second], libc::SIGCONT);
    let (who, line) = said(&mut lines, Duration::from_secs(10), name).await;
    assert_eq!(
        (who, line.as_str()),
        (second, "deposed"),
        "[{name}] the resumed leader's first word"
    );
    let (who, line) = said(&mut lines, Duration::from_secs(10), name).await;
    assert_eq!(
        (who, line),
        (second, format!("late-write {second_term} rejected")),
        "[{name}] the deposed leader's late write"
    );
    assert!(
        first_term < second_term && second_term < third_term,
        "[{name}] terms {first_term}, {second_term}, {third_term}"
    );
    // A leader killed or stopped right after it spoke may not have
    // recorded any work; the third has worked for 300 ms.
    let leaderships = holds.intervals().unwrap().len();
    assert!(
        (1..=3).contains(&leaderships),
        "[{name}] {leaderships} leaderships recorded"
    );
    assert_eq!(
        holds.overlaps().unwrap(),
        0,
        "[{name}] two leaders at once: terms {first_term}, {second_term}, {third_term}; {:?}",
        std::fs::read_to_string(holds.path()).unwrap_or_default()
    );
    let log = store.log().unwrap();
    assert!(
        log.iter().any(|w| w.accepted && w.fence == third_term),
        "[{name}] the last leader's writes were not accepted"
    );
    assert!(
        log.iter().all(|w| w.accepted || w.fence == second_term),
        "[{name}] a write refused that was not the deposed leader's"
    );
    for mut child in children {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

/// The limit of the permit tests' semaphore.
const PERMITS: usize = 3;

/// Starts `processes` permit workers (3 tasks each) on one of the
/// [`PERMITS`] permits of `sem` at `url` (or `--no-lock`), recording their
/// work in `holds`.
fn permit_workers(
    url: &str,
    rounds: u64,
    lease: Duration,
    holds: &HoldLog,
    n: usize,
) -> Vec<Child> {
    let (limit, rounds) = (PERMITS.to_string(), rounds.to_string());
    let lease = lease.as_millis().to_string();
    let holds = holds.path().to_str().unwrap();
    (0..n)
        .map(|_| helper(&["permits", url, "sem", &limit, &rounds, "3", &lease, holds]))
        .collect()
}

/// Waits for permit workers to finish; how many permits they lost.
async fn workers_done(name: &str, workers: Vec<Child>) -> u64 {
    let mut lost = 0;
    for child in workers {
        let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("[{name}] a permit worker did not finish"))
            .unwrap();
        assert!(out.status.success(), "[{name}] a permit worker failed");
        let text = String::from_utf8_lossy(&out.stdout);
        lost += text
            .trim()
            .strip_prefix("done ")
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("[{name}] expected `done <lost>`, got {text}"));
    }
    lost
}

/// N permits across processes under a SIGKILLed and a SIGSTOPped holder:
/// two processes take a permit each and keep it, 4 processes × 3 tasks
/// then work under the one left, and half a lease later one holder is
/// killed and the other paused. Every hold is recorded on
/// `CLOCK_MONOTONIC`: no instant may have more than [`PERMITS`] holds
/// (the paused holder's included, so a resumed holder that worked on
/// would show); a new client must then take every permit (both holders'
/// permits came back, by a lease and 5 s after the pause if the workers
/// finish sooner), and hold them while the paused
/// holder resumes, whose first word is that its permit is lost.
async fn permits_across_processes(t: &Topology) {
    let one = dlock_core::backend::Mode::permits(1, PERMITS as u32).unwrap();
    if !t.semaphores {
        // Redlock: a majority of per-node holder sets is not one set.
        let refused = locker(&t.url)
            .await
            .try_lock_mode("sem", one, LockOptions::new())
            .await;
        assert!(
            matches!(refused, Err(LockError::Unsupported { .. })),
            "[{}] semaphores where none are offered: {refused:?}",
            t.name
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lease = t.lease.as_millis().to_string();
    let (held, worked) = (
        HoldLog::new(&dir.path().join("held")),
        HoldLog::new(&dir.path().join("worked")),
    );
    let limit = PERMITS.to_string();
    let hold_args = [
        "permit-hold",
        &t.url,
        "sem",
        &limit,
        &lease,
        held.path().to_str().unwrap(),
    ];
    let mut killed = helper(&hold_args);
    let mut stopped = helper(&hold_args);
    let mut stopped_lines = BufReader::new(stopped.stdout.take().unwrap()).lines();
    let mut killed_lines = BufReader::new(killed.stdout.take().unwrap()).lines();
    for lines in [&mut killed_lines, &mut stopped_lines] {
        let acquired = next_line(lines, Duration::from_secs(30)).await;
        assert_eq!(acquired, "acquired", "[{}]", t.name);
    }
    // Long enough under one permit that the workers still run when the
    // other two come back (at 140 holds a second or so).
    let rounds = 30 * t.lease.as_secs().max(1);
    let workers = permit_workers(&t.url, rounds, t.lease, &worked, 4);
    tokio::time::sleep(t.lease / 2).await;
    killed.start_kill().unwrap();
    let _ = killed.wait().await;
    signal(&stopped, libc::SIGSTOP);
    let stopped_at = Instant::now();
    let lost = workers_done(t.name, workers).await;
    // Both holders' permits are back within a lease (and the slack the
    // kill test allows): a new client takes every permit at once.
    let back_by = stopped_at + t.lease + Duration::from_secs(5);
    let every = locker(&t.url)
        .await
        .lock_mode(
            "sem",
            dlock_core::backend::Mode::permits(PERMITS as u32, PERMITS as u32).unwrap(),
            LockOptions::new().wait(
                back_by
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_secs(1)),
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("[{}] the killed and paused holders' permits: {e}", t.name));
    let every_from = monotonic_ns();
    signal(&stopped, libc::SIGCONT);
    let first = next_line(&mut stopped_lines, Duration::from_secs(10)).await;
    let _ = stopped.wait().await;
    let every_to = monotonic_ns();
    drop(every);

    let all = HoldLog::new(&dir.path().join("all"));
    for log in [&held, &worked] {
        for i in log.intervals().unwrap() {
            all.record(&format!("h{}-{}", i.start, i.end), i.start, i.end)
                .unwrap();
        }
    }
    // The new client's permits, one hold each, over the resumed holder's
    // first steps: its work then would make one too many.
    for n in 0..PERMITS {
        all.record(&format!("every-{n}"), every_from, every_to)
            .unwrap();
    }
    let (most, workers_most) = (all.most_at_once().unwrap(), worked.most_at_once().unwrap());
    println!(
        "[{}] {} permits, {} worker holds: at most {most} at once ({workers_most} among the \
         workers), {lost} lost; every permit back {:?} after the pause; the resumed holder \
         said `{first}`",
        t.name,
        PERMITS,
        worked.intervals().unwrap().len(),
        stopped_at.elapsed()
    );
    assert!(
        most <= PERMITS,
        "[{}] {most} holds of {PERMITS} permits at once",
        t.name
    );
    assert_eq!(lost, 0, "[{}] a running worker lost a permit", t.name);
    assert!(
        first.starts_with("lost"),
        "[{}] a resumed holder went on: {first}",
        t.name
    );
}

/// The permit detector's self-test: workers that take no permit are seen
/// more than [`PERMITS`] at once, or a count within it above would prove
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_without_a_semaphore_are_seen_exceeding() {
    let dir = tempfile::tempdir().unwrap();
    let worked = HoldLog::new(&dir.path().join("worked"));
    let workers = permit_workers("--no-lock", 5, Duration::from_secs(1), &worked, 2);
    assert_eq!(workers_done("no lock", workers).await, 0);
    let most = worked.most_at_once().unwrap();
    println!("[no lock] 6 tasks without permits: {most} at once");
    assert!(most > PERMITS, "the detector saw at most {most} at once");
}

/// The file backend's "servers": the lock directory, on this host. It
/// runs only [`holder_killed`]: there is no server to count requests, and
/// a paused holder keeps its `flock` (the kernel frees it only when the
/// process dies), so the other fault tests do not apply.
impl Servers for tempfile::TempDir {
    fn count_requests(&self) -> Box<dyn Fn() -> u64 + '_> {
        panic!("no server counts a file lock's requests");
    }
}

fn file() -> Topology {
    let dir = tempfile::tempdir().expect("a temp dir");
    Topology {
        name: "file",
        url: format!("file://{}", dir.path().join("locks").display()),
        lease: Duration::from_secs(1),
        fencing: true,
        // The kernel frees a dead process's `flock` locks at once.
        disconnect_releases: true,
        semaphores: true,
        handoff_requests: 0.0,
        servers: Box::new(dir),
    }
}

/// A file-lock holder killed with SIGKILL (no release, no destructor):
/// the waiter queued behind it gets the lock at once, though the holder's
/// lease had time to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_holder_killed() {
    holder_killed(&file()).await;
}

macro_rules! per_topology {
    ($($topology:ident => $make:expr),* $(,)?) => {
        $(
            mod $topology {
                use super::*;

                /// The topology this module's tests share, each on keys of
                /// its own (the handoff test, which counts the servers'
                /// requests, starts its own).
                static SHARED: Shared<Topology> = Shared::new(|| Ok($make));

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn stock_across_processes() {
                    super::stock_across_processes(SHARED.get()).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn holder_killed() {
                    super::holder_killed(SHARED.get()).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn waiter_killed_in_line() {
                    super::waiter_killed_in_line(SHARED.get()).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn holder_paused() {
                    super::holder_paused(SHARED.get()).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn handoffs_across_processes() {
                    super::handoffs_across_processes(&$make).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn cancel_storm_of_1000() {
                    super::cancel_storm(SHARED.get()).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn permits_across_processes() {
                    super::permits_across_processes(SHARED.get()).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn election_across_processes() {
                    super::election_across_processes(SHARED.get()).await;
                }
            }
        )*
    };
}

per_topology! {
    redis_single => redis(),
    redlock_5 => redlock(),
    etcd_1 => etcd(1),
    etcd_3 => etcd(3),
    zookeeper_1 => zookeeper(1),
    zookeeper_3 => zookeeper(3),
    postgres_1 => postgres(),
    mysql_1 => mysql(),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_cancel_storm_of_1000() {
    let server = dlock_core::MemoryBackend::new();
    let harness = Harness::new("memory", move || {
        let client: std::sync::Arc<dyn dlock_core::backend::DynBackend> =
            std::sync::Arc::new(server.clone());
        async move { Ok(client) }
    });
    conformance::cancel_storm(&harness, 1000).await;
}

#[tokio::test]
async fn malformed_urls_are_typed_errors() {
    for url in [
        "",
        "localhost:6379",
        "ftp://h:1",
        "redis://",
        "redis://h:port",
        "redis://h:1/db",
        "redis://h?x=1",
        "redis://h:1?connect_timeout=5",
        "redis://h:1?response_timeout=0s",
        "rediss://h:1?tls_cert=client.pem",
        "redis://h:1?tls_ca=ca.pem",
        "rediss+cluster://h:1/2",
        "redis+cluster://a:1,b:2?wait_replicas=1",
        "redis://h:1?wait_timeout=1s",
        "redis+cluster://a:1,b:2/3",
        "etcds://h:1/x?tls_key=key.pem",
        "zks://h:1/x?tls_cert=client.pem",
        "zk://h:1/x?tls_ca=ca.pem",
        "redis+redlock://a:1,b:1",
        "redis+redlock://a:1,a:1,b:1",
        "etcd://",
        "etcd://h",
        "etcd://h:x",
        "etcd://:pw@h:1",
        "etcd://h:1/x?request_timeout=2h",
        "etcd://h:1/x?timeout=1s",
        "zk://",
        "zk://h",
        "zk://h:1/a/../b",
        "zk://h:1?session_timeout=forever",
        "postgres://h:port/db",
        "postgres://h:1/db?session_timeout=forever",
        "postgres://h:1/db?max_waiters=0",
        "postgres://h:1/db?lock_prefix=Not-An-Identifier",
        "postgresql://h:1/db?sslmode=sometimes",
        "mysql://h:port/db",
        "mysql://h:1/db?session_timeout=forever",
        "mysql://h:1/db?fence=sequence",
        "mariadb://h:1/db?lock_prefix=Not-An-Identifier",
        "mysql://h:1/db?ssl-mode=sometimes",
    ] {
        let result = tokio::time::timeout(Duration::from_secs(5), dlock_testkit::connect(url))
            .await
            .unwrap_or_else(|_| panic!("`{url}` hung"));
        match result {
            Err(LockError::InvalidOptions { .. }) => {}
            Err(other) => panic!("`{url}`: expected InvalidOptions, got {other}"),
            Ok(_) => panic!("`{url}`: accepted"),
        }
    }
}

/// Expects `url` to fail with a backend error, quickly and without a panic:
/// at connect, or (for clients that connect lazily) at the first lock.
async fn expect_backend_error(url: &str) {
    let start = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), dlock_testkit::connect(url)).await;
    match result {
        Ok(Err(LockError::Backend { .. })) => {}
        Ok(Ok(client)) => {
            let locker = Locker::from_arc(client);
            let wait = LockOptions::new().wait(Duration::from_secs(3));
            let lock = tokio::time::timeout(Duration::from_secs(30), locker.lock_with("k", wait))
                .await
                .unwrap_or_else(|_| panic!("`{url}`: a lock hung past its wait limit"));
            assert!(
                matches!(
                    lock,
                    Err(LockError::Backend { .. } | LockError::Timeout { .. })
                ),
                "`{url}`: {lock:?}"
            );
        }
        Ok(Err(other)) => panic!("`{url}`: expected a backend error, got {other}"),
        Err(_) => panic!("`{url}`: connecting hung"),
    }
    println!("`{url}` failed as it should, in {:?}", start.elapsed());
}

/// [`expect_backend_error`] for every URL of `urls` at once: each waits on
/// its own connect or wait limit, and none depends on another.
async fn expect_backend_errors(urls: &[String]) {
    futures_util::future::join_all(urls.iter().map(|url| expect_backend_error(url))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_ports_are_backend_errors() {
    let ports: Vec<u16> = (0..3).map(|_| free_port().unwrap()).collect();
    let urls = [
        format!("redis://127.0.0.1:{}/", ports[0]),
        format!(
            "redis+redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
            ports[0], ports[1], ports[2]
        ),
        format!("etcd://127.0.0.1:{}", ports[0]),
        format!(
            "zk://127.0.0.1:{}?session_timeout=2s&connect_timeout=3s",
            ports[0]
        ),
        format!("postgres://u@127.0.0.1:{}/db?connect_timeout=3s", ports[0]),
        format!("mysql://u@127.0.0.1:{}/db?connect_timeout=3s", ports[0]),
    ];
    expect_backend_errors(&urls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_that_speaks_another_protocol_is_a_backend_error() {
    let redis = RedisServer::start().expect("redis-server");
    let etcd = EtcdServer::start().expect("etcd");
    let mut urls = vec![
        format!("redis://{}/", etcd.endpoint()),
        format!("etcd://{}", redis.host_port()),
        format!(
            "zk://{}?session_timeout=2s&connect_timeout=3s",
            redis.host_port()
        ),
        format!("postgres://u@{}/db?connect_timeout=3s", redis.host_port()),
        format!("mysql://u@{}/db?connect_timeout=3s", redis.host_port()),
    ];
    let garbage = misbehaving_server(Behaviour::Garbage).await;
    let half = misbehaving_server(Behaviour::HalfReplyThenClose).await;
    for port in [garbage, half] {
        urls.extend([
            format!("redis://127.0.0.1:{port}/"),
            format!("etcd://127.0.0.1:{port}"),
            format!("zk://127.0.0.1:{port}?session_timeout=2s&connect_timeout=3s"),
            format!("postgres://u@127.0.0.1:{port}/db?connect_timeout=3s"),
            format!("mysql://u@127.0.0.1:{port}/db?connect_timeout=3s"),
        ]);
    }
    expect_backend_errors(&urls).await;
}

#[derive(Clone, Copy)]
enum Behaviour {
    /// Answers every connection with bytes no lock protocol expects.
    Garbage,
    /// Reads the request, starts a plausible reply, and closes mid-way.
    HalfReplyThenClose,
}

/// A loopback server that misbehaves, until the test ends.
async fn misbehaving_server(behaviour: Behaviour) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ =
                    tokio::time::timeout(Duration::from_millis(500), socket.read(&mut buf)).await;
                let reply: &[u8] = match behaviour {
                    Behaviour::Garbage => b"HTTP/1.1 418 I'm a teapot\r\n\r\n\x00\xff\xfe garbage",
                    // The start of a RESP bulk string and of an HTTP/2 frame.
                    Behaviour::HalfReplyThenClose => b"$1000\r\nabc\x00\x00\x12\x04",
                };
                let _ = socket.write_all(reply).await;
            });
        }
    });
    port
}

/// A waiter whose servers go away mid-wait answers with their error when
/// its wait limit passes, not with `Timeout` (which would tell the caller
/// that someone holds the lock: a web service would answer 409 where 500
/// is true).
async fn servers_gone_mid_wait(url: &str, kill: impl FnOnce()) {
    let (holder, waiter) = (locker(url).await, locker(url).await);
    let held = holder.lock("gone-mid-wait").await.expect("lock");
    let wait = tokio::spawn(async move {
        waiter
            .lock_with(
                "gone-mid-wait",
                LockOptions::new().wait(Duration::from_secs(3)),
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    kill();
    let answer = tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .expect("the wait limit is kept")
        .expect("waiter task");
    assert!(
        matches!(answer, Err(LockError::Backend { .. })),
        "{url}: expected the servers' error, got {answer:?}"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_gone_mid_wait_is_a_backend_error() {
    let mut server = RedisServer::start().expect("redis-server");
    let url = server.url();
    servers_gone_mid_wait(&url, || server.process().kill()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_gone_mid_wait_is_a_backend_error() {
    let mut server = EtcdServer::start().expect("etcd");
    let url = format!("etcd://{}/gone", server.endpoint());
    servers_gone_mid_wait(&url, || server.process().kill()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_gone_mid_wait_is_a_backend_error() {
    let mut server = ZooKeeperServer::start().expect("ZooKeeper");
    let url = format!("zk://{}/gone", server.endpoint());
    servers_gone_mid_wait(&url, || server.process().kill()).await;
}
