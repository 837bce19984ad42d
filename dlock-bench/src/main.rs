//! `dlock-bench`: measures dlock against the raw client doing the same round
//! trips, in the same run, on every backend, with real servers started by
//! the testkit fixtures.
//!
//! ```text
//! cargo run --release -p dlock-bench -- --backend all [--runs N] [--quick] [--only SCENARIOS] [--json FILE]
//! ```
//!
//! Runs every scenario `N` times (3 by default) on the same servers and
//! prints a markdown table of each figure's median and `[min–max]` over
//! the runs; writes one JSON object per scenario and run to
//! `dlock-bench.jsonl` (or FILE). Scenarios:
//! 1. `serial`: uncontended lock + release on one key, one at a time
//!    (latency; ratio = dlock p50 / raw p50);
//! 2. `distinct-64`: 64 tasks on distinct keys (throughput; ratio = raw
//!    ops/s / dlock ops/s, so 1.10 means dlock is 10 % slower);
//! 3. `contended-16`: 16 tasks on one key, lock → short critical section →
//!    release (throughput, wait p50/p99/max, owner changes, overlaps);
//! 4. `contended-4x8`: the same across 4 OS processes of this binary with 8
//!    tasks each (server backends only), and `contended-clients-16`: 16
//!    independent clients in this process, one task each;
//! 5. `reentrant`: re-locking a key inside the scope that holds it (no I/O);
//! 6. `held-N`: N locks held at once under the watchdog: heap bytes per held
//!    lock, and the renewal requests per watchdog tick;
//! 7. `retained-N`: N tasks, each lock + `release().await` (and, in a second
//!    row, lock + drop): heap bytes still allocated per task once the
//!    releases have settled (0 when nothing is left behind);
//!
//! `dlock-bench chart --panel LABEL=FILE.jsonl … --out FILE.svg` draws the
//! `serial` and `distinct-64` ratios of such files, dlock beside its peer.
//!
//! Where a client crate ships a lock recipe, scenarios 1–3 also run it
//! beside dlock (`rslock`, `etcd lock API`, `zk lock recipe`).
//! `redis-unfair` (`fence=off&fair=false`) and `redlock-unfair`
//! (`fair=false`) measure unfair locking beside rslock.
//!
//! Every server-backed row reports every request the servers received per
//! operation, with no list of the commands that count: on Redis each
//! command a client sent (`MONITOR`, without the commands scripts run
//! inside the server), counted in a second, untimed pass of the same
//! scenario since `MONITOR` slows the server; etcd's gRPC messages
//! received; ZooKeeper's `zk_packets_received`. The serial, distinct-key
//! and in-process contended rows also report the CPU time per operation
//! of the bench process and of the server processes (with their
//! children), from each process's CPU-time clock.

mod alloc;
mod chart;
mod contention;
mod cpu;
mod lockable;
mod multiproc;
mod peers;
mod raw;
mod report;
mod scenarios;
mod stats;

use std::{io::Write as _, process::ExitCode, time::Duration};

use dlock_core::{Locker, MemoryBackend};
use dlock_redis::redis;
use dlock_testkit::fixture::{
    EtcdServer, MariaDbServer, PostgresServer, RedisServer, ZooKeeperServer,
};

use crate::{raw::Raw, report::Row};

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

/// One backend under test, with its servers and its raw floor.
pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) url: Option<String>,
    memory: Option<MemoryBackend>,
    pub(crate) raw: Option<std::sync::Arc<Raw>>,
    servers: Servers,
    /// The servers' process ids, whose CPU time (with their children's)
    /// the serial and distinct-key rows report.
    server_pids: Vec<u32>,
    /// Set while a scenario runs again only to count its requests.
    counting: std::sync::atomic::AtomicBool,
}

/// The servers of a target, kept alive for the run and asked for their own
/// request counters.
enum Servers {
    None,
    /// With one plain connection per node, opened once, for the server
    /// time `INFO commandstats` reports.
    Redis(Vec<RedisServer>, std::sync::Mutex<Vec<redis::Connection>>),
    Etcd(EtcdServer),
    Zk(ZooKeeperServer),
    Postgres(PostgresServer),
    MariaDb(MariaDbServer),
    /// The file backend's lock directory (no server), removed when the
    /// target goes.
    Dir {
        _dir: tempfile::TempDir,
    },
}

impl Servers {
    /// The process ids of the servers.
    fn pids(&mut self) -> Vec<u32> {
        match self {
            Servers::None | Servers::Dir { .. } => Vec::new(),
            Servers::Redis(servers, _) => servers.iter_mut().map(|s| s.process().pid()).collect(),
            Servers::Etcd(server) => vec![server.process().pid()],
            Servers::Zk(server) => vec![server.process().pid()],
            Servers::Postgres(server) => vec![server.process().pid()],
            Servers::MariaDb(server) => vec![server.process().pid()],
        }
    }

    fn redis(servers: Vec<RedisServer>) -> Result<Servers, String> {
        let conns = servers
            .iter()
            .map(|s| {
                redis::Client::open(s.url())
                    .and_then(|c| c.get_connection())
                    .map_err(|e| format!("redis: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Servers::Redis(servers, std::sync::Mutex::new(conns)))
    }

    /// Redis only: [`commandstat`] summed over the nodes.
    fn redis_commandstat(&self, commands: &[&str], field: &str) -> Option<u64> {
        let Servers::Redis(_, conns) = self else {
            return None;
        };
        let mut conns = conns.lock().ok()?;
        let mut total = 0;
        for conn in conns.iter_mut() {
            let info: String = redis::cmd("INFO").arg("commandstats").query(conn).ok()?;
            total += commandstat(&info, commands, field);
        }
        Some(total)
    }
}

/// The sum of `field` (`calls`, `usec`) over the rows of `INFO
/// commandstats` for `commands` (subcommands, `script|load`, count as
/// their command).
fn commandstat(commandstats: &str, commands: &[&str], field: &str) -> u64 {
    commandstats
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, stats) = l.split_once(':')?;
            if !commands.contains(&name.split('|').next()?) {
                return None;
            }
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(field)?.strip_prefix('='))?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Counts every request the servers receive while something runs, from
/// any client, with no list of the commands that count.
pub(crate) enum RequestCount<'a> {
    /// No server, or Redis outside a counting pass (see
    /// [`Target::counting_pass`]).
    None,
    /// Redis: `MONITOR` on every node, which shows each command a client
    /// sends and, apart, those a script runs inside the server (left out:
    /// one `EVALSHA` is one request, however much its script does).
    Monitors(Vec<dlock_testkit::fixture::CommandMonitor>),
    /// etcd's gRPC messages received, or ZooKeeper's packets received: the
    /// servers' own totals, read before and after.
    Totals(&'a Servers, u64),
    /// PostgreSQL: the statements in the server's log (`log_statement`).
    Statements(dlock_testkit::fixture::StatementCount<'a>),
}

impl RequestCount<'_> {
    /// Requests received since the count started.
    pub(crate) fn so_far(&self) -> Option<u64> {
        match self {
            RequestCount::None => None,
            RequestCount::Monitors(monitors) => monitors
                .iter()
                .map(|m| m.commands().ok())
                .sum::<Option<u64>>(),
            RequestCount::Totals(servers, before) => totals(servers)?.checked_sub(*before),
            RequestCount::Statements(count) => count.so_far().ok(),
        }
    }

    /// [`so_far`](Self::so_far) per operation.
    pub(crate) fn per_op(&self, ops: u64) -> Option<f64> {
        Some(self.so_far()? as f64 / ops.max(1) as f64)
    }
}

/// The request totals etcd and ZooKeeper keep (`None` elsewhere).
fn totals(servers: &Servers) -> Option<u64> {
    match servers {
        Servers::Etcd(server) => Some(server.grpc_requests().ok()?.values().sum()),
        Servers::Zk(server) => server.packets_received().ok(),
        Servers::None
        | Servers::Dir { .. }
        | Servers::Redis(..)
        | Servers::Postgres(_)
        | Servers::MariaDb(_) => None,
    }
}

impl Target {
    /// Starts the target's servers and its floor's client.
    async fn start(name: &str) -> Result<Target, String> {
        let mut target = Target::start_servers(name).await?;
        target.server_pids = target.servers.pids();
        Ok(target)
    }

    /// Opens a window on the CPU time the bench and the servers take (see
    /// [`cpu::CpuTimes::open`]).
    pub(crate) fn cpu_open(&self) -> Option<cpu::CpuTimes> {
        cpu::CpuTimes::open(&self.server_pids)
    }

    /// What the bench and the servers took since `opened`.
    pub(crate) fn cpu_close(&self, opened: Option<cpu::CpuTimes>) -> Option<cpu::CpuTimes> {
        opened?.close(&self.server_pids)
    }

    async fn start_servers(name: &str) -> Result<Target, String> {
        let fixture = |e: dlock_testkit::fixture::FixtureError| e.to_string();
        Ok(match name {
            "memory" => Target {
                name: "memory",
                url: None,
                memory: Some(MemoryBackend::new()),
                raw: None,
                servers: Servers::None,
                counting: Default::default(),
                server_pids: Vec::new(),
            },
            // One node: dlock with fencing tokens, and without
            // (`fence=off`: an uncontended acquire is a plain `SET NX PX`),
            // against the same floor.
            // `redis-unfair`: `fence=off` and `fair=false` (plain locks
            // taken without the line, as rslock takes them).
            "redis" | "redis-unfenced" | "redis-unfair" => {
                let server = RedisServer::start().map_err(fixture)?;
                let (name, query) = match name {
                    "redis" => ("redis", ""),
                    "redis-unfenced" => ("redis-unfenced", "?fence=off"),
                    _ => ("redis-unfair", "?fence=off&fair=false"),
                };
                Target {
                    name,
                    raw: Some(std::sync::Arc::new(Raw::redis(&[server.url()]).await)),
                    url: Some(format!("{}{query}", server.url())),
                    memory: None,
                    servers: Servers::redis(vec![server])?,
                    counting: Default::default(),
                    server_pids: Vec::new(),
                }
            }
            "redlock" | "redlock-unfair" => {
                let unfair = name == "redlock-unfair";
                let servers = (0..5)
                    .map(|_| RedisServer::start())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(fixture)?;
                let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
                let hosts: Vec<String> = servers.iter().map(RedisServer::host_port).collect();
                Target {
                    name: if unfair {
                        "redlock-5-unfair"
                    } else {
                        "redlock-5"
                    },
                    raw: Some(std::sync::Arc::new(Raw::redis(&urls).await)),
                    url: Some(format!(
                        "redis+redlock://{}{}",
                        hosts.join(","),
                        if unfair { "?fair=false" } else { "" }
                    )),
                    memory: None,
                    servers: Servers::redis(servers)?,
                    counting: Default::default(),
                    server_pids: Vec::new(),
                }
            }
            "etcd" => {
                let server = EtcdServer::start().map_err(fixture)?;
                Target {
                    name: "etcd",
                    raw: Some(std::sync::Arc::new(Raw::etcd(&server.endpoint()).await)),
                    url: Some(format!("etcd://{}/bench", server.endpoint())),
                    memory: None,
                    servers: Servers::Etcd(server),
                    counting: Default::default(),
                    server_pids: Vec::new(),
                }
            }
            // Locks on this host: `flock(2)` on files in a directory of
            // its own.
            "file" => {
                let dir = tempfile::tempdir().map_err(|e| format!("file: {e}"))?;
                let locks = dir.path().join("locks");
                Target {
                    name: "file",
                    raw: Some(std::sync::Arc::new(Raw::file(dir.path().join("raw"))?)),
                    url: Some(format!("file://{}", locks.display())),
                    memory: None,
                    servers: Servers::Dir { _dir: dir },
                    counting: Default::default(),
                    server_pids: Vec::new(),
                }
            }
            "postgres" => {
                // Room for the `held` scenario's locks.
                let server =
                    PostgresServer::start_holding(scenarios::HELD_LOCKS).map_err(fixture)?;
                Target {
                    name: "postgres",
                    raw: Some(std::sync::Arc::new(Raw::postgres(&server.url()).await)),
                    url: Some(server.url()),
                    memory: None,
                    servers: Servers::Postgres(server),
                    counting: Default::default(),
                    server_pids: Vec::new(),
                }
            }
            // MariaDB: dlock with fencing tokens (a durable counter-row
            // commit per grant), and without (`fence=off`), against the
            // same floor.
            "mysql" | "mysql-unfenced" => {
                let server = MariaDbServer::start().map_err(fixture)?;
                let fenced = name == "mysql";
                Target {
                    name: if fenced { "mysql" } else { "mysql-unfenced" },
                    raw: Some(std::sync::Arc::new(Raw::mysql(&server.url()).await)),
                    url: Some(if fenced {
                        server.url()
                    } else {
                        format!("{}?fence=off", server.url())
                    }),
                    memory: None,
                    servers: Servers::MariaDb(server),
                    counting: Default::default(),
                    server_pids: Vec::new(),
                }
            }
            "zk" => {
                let server = ZooKeeperServer::start().map_err(fixture)?;
                Target {
                    name: "zookeeper",
                    raw: Some(std::sync::Arc::new(Raw::zk(&server.endpoint()).await)),
                    url: Some(format!("zk://{}/bench", server.endpoint())),
                    memory: None,
                    servers: Servers::Zk(server),
                    counting: Default::default(),
                    server_pids: Vec::new(),
                }
            }
            other => {
                return Err(format!(
                    "unknown backend `{other}`: memory, file, redis, redis-unfenced, \
                     redis-unfair, redlock, redlock-unfair, etcd, zk, postgres, mysql, \
                     mysql-unfenced or all"
                ))
            }
        })
    }

    /// Starts counting the requests the servers receive. etcd and
    /// ZooKeeper count for free; on Redis the count is `MONITOR`, which
    /// slows the server, so it counts only inside a
    /// [counting pass](Self::counting_pass).
    pub(crate) fn count_requests(&self) -> RequestCount<'_> {
        match &self.servers {
            Servers::None => RequestCount::None,
            Servers::Redis(servers, _) => {
                if !self.counting.load(std::sync::atomic::Ordering::SeqCst) {
                    return RequestCount::None;
                }
                let monitors = servers
                    .iter()
                    .map(RedisServer::monitor)
                    .collect::<Result<Vec<_>, _>>()
                    .expect("MONITOR");
                RequestCount::Monitors(monitors)
            }
            Servers::Postgres(server) => {
                if !self.counting.load(std::sync::atomic::Ordering::SeqCst) {
                    return RequestCount::None;
                }
                RequestCount::Statements(server.count_statements().expect("log_statement"))
            }
            Servers::MariaDb(server) => {
                if !self.counting.load(std::sync::atomic::Ordering::SeqCst) {
                    return RequestCount::None;
                }
                RequestCount::Statements(server.count_statements().expect("general_log"))
            }
            servers => match totals(servers) {
                Some(before) => RequestCount::Totals(servers, before),
                None => RequestCount::None,
            },
        }
    }

    /// Whether counting requests slows the servers, so that a scenario runs
    /// once timed and once more, under [`counting_pass`](Self::counting_pass),
    /// for its counts (Redis).
    pub(crate) fn counts_apart(&self) -> bool {
        matches!(
            self.servers,
            Servers::Redis(..) | Servers::Postgres(_) | Servers::MariaDb(_)
        )
    }

    /// While the returned guard lives, [`count_requests`](Self::count_requests)
    /// counts on Redis too.
    pub(crate) fn counting_pass(&self) -> CountingPass<'_> {
        self.counting
            .store(true, std::sync::atomic::Ordering::SeqCst);
        CountingPass(&self.counting)
    }

    /// Whether a counting pass is on: its timings are not reported.
    pub(crate) fn in_counting_pass(&self) -> bool {
        self.counting.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Redis only: the server time spent on `commands` so far, in µs,
    /// summed over the nodes.
    pub(crate) fn redis_server_usec(&self, commands: &[&str]) -> Option<u64> {
        self.servers.redis_commandstat(commands, "usec")
    }

    /// The Redis nodes' URLs (none for other targets).
    pub(crate) fn redis_urls(&self) -> Vec<String> {
        match &self.servers {
            Servers::Redis(servers, _) => servers.iter().map(RedisServer::url).collect(),
            _ => Vec::new(),
        }
    }

    /// The etcd endpoint or ZooKeeper host list, for the peer recipes.
    pub(crate) fn endpoint(&self) -> Option<String> {
        match &self.servers {
            Servers::Etcd(server) => Some(server.endpoint()),
            Servers::Zk(server) => Some(server.endpoint()),
            Servers::Postgres(server) => Some(server.url()),
            _ => None,
        }
    }

    /// A new client (another process would have its own).
    pub(crate) async fn locker(&self, watchdog: Option<Duration>) -> Locker {
        match (&self.memory, &self.url) {
            (Some(memory), _) => {
                multiproc::build_locker(std::sync::Arc::new(memory.clone()), watchdog)
            }
            (None, Some(url)) => multiproc::locker_for(url, watchdog).await.expect("connect"),
            (None, None) => unreachable!("a target has a server"),
        }
    }
}

/// A counting pass, over when dropped.
pub(crate) struct CountingPass<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for CountingPass<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

struct Args {
    backends: Vec<String>,
    quick: bool,
    runs: usize,
    only: scenarios::Only,
    json: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backends: vec!["all".to_owned()],
        quick: false,
        runs: 3,
        only: scenarios::Only::default(),
        json: "dlock-bench.jsonl".to_owned(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--backend" => {
                let value = it.next().ok_or("--backend needs a value")?;
                args.backends = value.split(',').map(str::to_owned).collect();
            }
            "--quick" => args.quick = true,
            "--runs" => {
                let value = it.next().ok_or("--runs needs a value")?;
                args.runs = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("--runs takes a count of 1 or more, not `{value}`"))?;
            }
            "--only" => {
                let value = it.next().ok_or("--only needs a value")?;
                args.only = scenarios::Only::parse(&value)?;
            }
            "--json" => args.json = it.next().ok_or("--json needs a file")?,
            "-h" | "--help" => {
                return Err("usage: dlock-bench [--backend all|memory,file,redis,redis-unfenced,redis-unfair,redlock,redlock-unfair,etcd,zk,postgres,mysql,mysql-unfenced] [--quick] [--runs N] [--only serial,distinct,contended,contended-clients,contended-4x8,reentrant,held,retained,peers] [--json FILE]".into())
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if args.backends == ["all"] {
        args.backends = [
            "memory",
            "file",
            "redis",
            "redis-unfenced",
            "redis-unfair",
            "redlock",
            "redlock-unfair",
            "etcd",
            "zk",
            "postgres",
            "mysql",
            "mysql-unfenced",
        ]
        .map(str::to_owned)
        .to_vec();
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some(multiproc::CHILD) {
        return multiproc::child(&argv[1..]).await;
    }
    if argv.first().map(String::as_str) == Some("chart") {
        return chart::main(&argv[1..]);
    }
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    // runs[i]: every row of run i, over all backends.
    let mut runs: Vec<Vec<Row>> = vec![Vec::new(); args.runs];
    // Written as the rows come: a run cut short keeps what it measured.
    let mut json = match std::fs::File::create(&args.json) {
        Ok(file) => file,
        Err(e) => {
            eprintln!("{}: {e}", args.json);
            return ExitCode::FAILURE;
        }
    };
    for name in &args.backends {
        let target = match Target::start(name).await {
            Ok(target) => target,
            Err(e) => {
                eprintln!("{name}: {e}");
                return ExitCode::FAILURE;
            }
        };
        // What the CPU figures count with nothing measured: the servers'
        // housekeeping and the idle clients.
        let idle = target.cpu_open();
        tokio::time::sleep(Duration::from_secs(1)).await;
        if let Some(idle) = target.cpu_close(idle) {
            eprintln!(
                "{}: idle CPU over 1 s: client {:.0} µs, servers {:.0} µs",
                target.name,
                idle.client.as_secs_f64() * 1e6,
                idle.servers.as_secs_f64() * 1e6
            );
        }
        for (i, run) in runs.iter_mut().enumerate() {
            eprintln!(
                "benchmarking {}, run {} of {}",
                target.name,
                i + 1,
                args.runs
            );
            for row in scenarios::run_all(&target, args.quick, &args.only).await {
                if let Err(e) = writeln!(json, "{}", row.json(i + 1)).and_then(|()| json.flush()) {
                    eprintln!("{}: {e}", args.json);
                    return ExitCode::FAILURE;
                }
                eprintln!("  {} done", row.scenario);
                run.push(row);
            }
        }
        // So far, for a run cut short.
        eprintln!("{}", report::markdown(&runs));
    }
    println!("{}", report::markdown(&runs));
    eprintln!("JSON lines written to {}", args.json);
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstat_sums_the_named_commands_and_their_subcommands() {
        let info = "# Commandstats\r\n\
            cmdstat_evalsha:calls=10,usec=70,usec_per_call=7.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_set:calls=25,usec=30,usec_per_call=1.20\r\n\
            cmdstat_script|load:calls=3,usec=9,usec_per_call=3.00\r\n";
        assert_eq!(commandstat(info, &["evalsha", "script"], "calls"), 13);
        assert_eq!(commandstat(info, &["evalsha", "set"], "usec"), 100);
        assert_eq!(commandstat(info, &["get"], "calls"), 0);
    }
}
