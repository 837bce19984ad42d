//! `dlock-bench`: measures dlock against the raw client doing the same round
//! trips, in the same run, on every backend, with real servers started by
//! the testkit fixtures.
//!
//! ```text
//! cargo run --release -p dlock-bench -- --backend all [--quick] [--only SCENARIOS] [--json FILE]
//! ```
//!
//! Prints a markdown table and writes one JSON object per row to
//! `dlock-bench.jsonl` (or FILE). Scenarios:
//! 1. `serial`: uncontended lock + release on one key, one at a time
//!    (latency; ratio = dlock p50 / raw p50);
//! 2. `distinct-64`: 64 tasks on distinct keys (throughput; ratio = raw
//!    ops/s / dlock ops/s, so 1.10 means dlock is 10 % slower);
//! 3. `contended-16`: 16 tasks on one key, lock → short critical section →
//!    release (throughput, wait p50/p99/max, owner changes, overlaps);
//! 4. `contended-4x8`: the same across 4 OS processes of this binary with 8
//!    tasks each (server backends only);
//! 5. `reentrant`: re-locking a key inside the scope that holds it (no I/O);
//! 6. `held-N`: N locks held at once under the watchdog: heap bytes per held
//!    lock, and the renewal requests per watchdog tick;
//! 7. `retained-N`: N tasks, each lock + `release().await` (and, in a second
//!    row, lock + drop): heap bytes still allocated per task once the
//!    releases have settled (0 when nothing is left behind);
//!
//! Where the client crate ships a lock recipe, scenarios 1–3 also run it
//! beside dlock (`etcd lock API`, `zk lock recipe`).
//!
//! Every server-backed row also reports what the server itself counted
//! (Redis `total_commands_processed`, etcd's gRPC messages received,
//! ZooKeeper's `zk_packets_received`) per operation.

mod alloc;
mod multiproc;
mod peers;
mod raw;
mod scenarios;
mod stats;

use std::{fmt::Write as _, io::Write as _, process::ExitCode, time::Duration};

use dlock_core::{Locker, MemoryBackend};
use dlock_redis::redis;
use dlock_testkit::fixture::{EtcdServer, RedisServer, ZooKeeperServer};

use crate::raw::Raw;

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

/// One backend under test, with its servers and its raw floor.
pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) url: Option<String>,
    memory: Option<MemoryBackend>,
    pub(crate) raw: Option<std::sync::Arc<Raw>>,
    servers: Servers,
}

/// The servers of a target, kept alive for the run and asked for their own
/// request counters.
enum Servers {
    None,
    /// With one plain connection per node, opened once so that counting
    /// adds exactly one `INFO` per node.
    Redis(Vec<RedisServer>, std::sync::Mutex<Vec<redis::Connection>>),
    Etcd(EtcdServer),
    Zk(ZooKeeperServer),
}

impl Servers {
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

    /// Requests the servers have received so far, by their own count.
    fn requests(&self) -> Option<u64> {
        match self {
            Servers::None => None,
            Servers::Redis(..) => self.redis_commandstat(&SENT_BY_CLIENTS, "calls"),
            Servers::Etcd(server) => Some(server.grpc_requests().ok()?.values().sum()),
            Servers::Zk(server) => server.packets_received().ok(),
        }
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

    fn nodes(&self) -> u64 {
        match self {
            Servers::None => 0,
            Servers::Redis(servers, _) => servers.len() as u64,
            Servers::Etcd(_) | Servers::Zk(_) => 1,
        }
    }
}

/// The commands a client sends itself. Commands that scripts run inside
/// the server (`SET`, `INCR`, `GET`, `DEL`, `PUBLISH`, ...) count in their
/// own rows of `INFO commandstats`, which are left out, so one `EVALSHA` is
/// one request.
const SENT_BY_CLIENTS: [&str; 8] = [
    "evalsha",
    "eval",
    "script",
    "subscribe",
    "unsubscribe",
    "ping",
    "info",
    "client",
];

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

/// Counts the requests the servers receive while something runs.
pub(crate) struct RequestCount<'a> {
    servers: &'a Servers,
    before: Option<u64>,
}

impl RequestCount<'_> {
    /// Requests received since the count started, less the counting's own
    /// (one `INFO` per Redis node).
    pub(crate) fn used(self) -> Option<u64> {
        let after = self.servers.requests()?;
        let own = match self.servers {
            Servers::Redis(..) => self.servers.nodes(),
            _ => 0,
        };
        after.checked_sub(self.before? + own)
    }

    /// [`used`](Self::used) per operation.
    pub(crate) fn per_op(self, ops: u64) -> Option<f64> {
        Some(self.used()? as f64 / ops.max(1) as f64)
    }
}

impl Target {
    async fn start(name: &str) -> Result<Target, String> {
        let fixture = |e: dlock_testkit::fixture::FixtureError| e.to_string();
        Ok(match name {
            "memory" => Target {
                name: "memory",
                url: None,
                memory: Some(MemoryBackend::new()),
                raw: None,
                servers: Servers::None,
            },
            "redis" => {
                let server = RedisServer::start().map_err(fixture)?;
                Target {
                    name: "redis",
                    raw: Some(std::sync::Arc::new(Raw::redis(&[server.url()]).await)),
                    url: Some(server.url()),
                    memory: None,
                    servers: Servers::redis(vec![server])?,
                }
            }
            "redlock" => {
                let servers = (0..5)
                    .map(|_| RedisServer::start())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(fixture)?;
                let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
                let hosts: Vec<String> = servers.iter().map(RedisServer::host_port).collect();
                Target {
                    name: "redlock-5",
                    raw: Some(std::sync::Arc::new(Raw::redis(&urls).await)),
                    url: Some(format!("redis+redlock://{}", hosts.join(","))),
                    memory: None,
                    servers: Servers::redis(servers)?,
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
                }
            }
            other => {
                return Err(format!(
                    "unknown backend `{other}`: memory, redis, redlock, etcd, zk or all"
                ))
            }
        })
    }

    /// Starts counting the requests the servers receive.
    pub(crate) fn count_requests(&self) -> RequestCount<'_> {
        RequestCount {
            servers: &self.servers,
            before: self.servers.requests(),
        }
    }

    /// Redis only: the server time spent on `commands` so far, in µs,
    /// summed over the nodes.
    pub(crate) fn redis_server_usec(&self, commands: &[&str]) -> Option<u64> {
        self.servers.redis_commandstat(commands, "usec")
    }

    /// Redis only: how many `commands` the nodes have run so far.
    pub(crate) fn redis_calls(&self, commands: &[&str]) -> Option<u64> {
        self.servers.redis_commandstat(commands, "calls")
    }

    /// The etcd endpoint or ZooKeeper host list, for the peer recipes.
    /// The Redis nodes' URLs (none for other targets).
    pub(crate) fn redis_urls(&self) -> Vec<String> {
        match &self.servers {
            Servers::Redis(servers, _) => servers.iter().map(RedisServer::url).collect(),
            _ => Vec::new(),
        }
    }

    pub(crate) fn endpoint(&self) -> Option<String> {
        match &self.servers {
            Servers::Etcd(server) => Some(server.endpoint()),
            Servers::Zk(server) => Some(server.endpoint()),
            _ => None,
        }
    }

    /// A new client (another process would have its own).
    pub(crate) async fn locker(&self, watchdog: Option<Duration>) -> Locker {
        match (&self.memory, &self.url) {
            (Some(memory), _) => build_locker(std::sync::Arc::new(memory.clone()), watchdog),
            (None, Some(url)) => locker_for(url, watchdog).await.expect("connect"),
            (None, None) => unreachable!("a target has a server"),
        }
    }
}

/// A locker on the backend at `url`.
pub(crate) async fn locker_for(url: &str, watchdog: Option<Duration>) -> Result<Locker, String> {
    let backend = dlock_testkit::connect(url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    Ok(build_locker(backend, watchdog))
}

fn build_locker(
    backend: std::sync::Arc<dyn dlock_core::backend::Backend>,
    watchdog: Option<Duration>,
) -> Locker {
    let mut builder = dlock_core::LockerBuilder::from_arc(backend);
    if let Some(lease) = watchdog {
        builder = builder.watchdog_lease(lease);
    }
    builder.build().expect("valid options")
}

/// One line of the results.
#[derive(Debug, Default)]
pub(crate) struct Row {
    pub(crate) scenario: String,
    pub(crate) backend: String,
    pub(crate) ops: u64,
    pub(crate) ops_per_sec: f64,
    pub(crate) p50: Duration,
    pub(crate) p99: Duration,
    pub(crate) max: Duration,
    pub(crate) raw_p50: Option<Duration>,
    pub(crate) raw_ops_per_sec: Option<f64>,
    pub(crate) ratio: Option<f64>,
    pub(crate) notes: String,
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Row {
    fn markdown(&self) -> String {
        let raw = match (self.raw_p50, self.raw_ops_per_sec) {
            (Some(p50), _) if self.scenario.starts_with("serial") => {
                format!("{:.1} µs", micros(p50))
            }
            (_, Some(ops)) => format!("{ops:.0}/s"),
            _ => "-".to_owned(),
        };
        let ratio = self
            .ratio
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}×"));
        format!(
            "| {} | {} | {} | {:.0} | {:.1} µs | {:.1} µs | {:.1} µs | {} | {} | {} |",
            self.scenario,
            self.backend,
            self.ops,
            self.ops_per_sec,
            micros(self.p50),
            micros(self.p99),
            micros(self.max),
            raw,
            ratio,
            self.notes
        )
    }

    fn json(&self) -> String {
        let opt = |v: Option<f64>| v.map_or_else(|| "null".to_owned(), |v| format!("{v:.3}"));
        format!(
            "{{\"scenario\":\"{}\",\"backend\":\"{}\",\"ops\":{},\"ops_per_sec\":{:.1},\"p50_us\":{:.1},\"p99_us\":{:.1},\"max_us\":{:.1},\"raw_p50_us\":{},\"raw_ops_per_sec\":{},\"ratio\":{},\"notes\":\"{}\"}}",
            self.scenario,
            self.backend,
            self.ops,
            self.ops_per_sec,
            micros(self.p50),
            micros(self.p99),
            micros(self.max),
            opt(self.raw_p50.map(micros)),
            opt(self.raw_ops_per_sec),
            opt(self.ratio),
            self.notes.replace('"', "'")
        )
    }
}

struct Args {
    backends: Vec<String>,
    quick: bool,
    only: scenarios::Only,
    json: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backends: vec!["all".to_owned()],
        quick: false,
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
            "--only" => {
                let value = it.next().ok_or("--only needs a value")?;
                args.only = scenarios::Only::parse(&value)?;
            }
            "--json" => args.json = it.next().ok_or("--json needs a file")?,
            "-h" | "--help" => {
                return Err("usage: dlock-bench [--backend all|memory,redis,redlock,etcd,zk] [--quick] [--only serial,distinct,contended,contended-4x8,reentrant,held,retained,peers] [--json FILE]".into())
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if args.backends == ["all"] {
        args.backends = ["memory", "redis", "redlock", "etcd", "zk"]
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
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let mut table = String::from(
        "| scenario | backend | ops | ops/s | p50 | p99 | max | raw floor | ratio | notes |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut json = String::new();
    for name in &args.backends {
        let target = match Target::start(name).await {
            Ok(target) => target,
            Err(e) => {
                eprintln!("{name}: {e}");
                return ExitCode::FAILURE;
            }
        };
        eprintln!("benchmarking {}", target.name);
        for row in scenarios::run_all(&target, args.quick, &args.only).await {
            let _ = writeln!(table, "{}", row.markdown());
            let _ = writeln!(json, "{}", row.json());
            eprintln!("  {} done", row.scenario);
        }
    }
    println!("{table}");
    match std::fs::File::create(&args.json).and_then(|mut f| f.write_all(json.as_bytes())) {
        Ok(()) => eprintln!("JSON lines written to {}", args.json),
        Err(e) => {
            eprintln!("{}: {e}", args.json);
            return ExitCode::FAILURE;
        }
    }
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
        assert_eq!(commandstat(info, &SENT_BY_CLIENTS, "calls"), 13);
        assert_eq!(commandstat(info, &["evalsha", "set"], "usec"), 100);
        assert_eq!(commandstat(info, &["get"], "calls"), 0);
    }
}
