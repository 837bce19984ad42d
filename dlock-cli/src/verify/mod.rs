//! `dlock verify`: a randomized fault checker for the user's own
//! deployment. Workers (copies of this binary) take and hold locks and
//! record every hold; faults are injected on a seeded schedule; an exact
//! checker then looks for double grants across all of them.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use rustix::process::{kill_process, Signal};
use tokio::process::Command;

use crate::{exit, run, Server};

mod check;
mod inject;
mod logs;
mod worker;

use inject::{Injected, Injection, Workers};

pub(crate) use worker::{worker, WorkerArgs};

const VERIFY_HELP: &str = "\
Examples:
  dlock verify --url redis://10.0.0.5:6379 --duration 60s
  dlock verify --url etcd://10.0.0.5:2379/locks --primitive all --faults pause,kill,cancel --json report.json
  dlock verify --url postgres://app:pw@db/app --fault-cmd 'systemctl restart postgresql'
  dlock verify --url redis://10.0.0.5:6379 --no-lock     # must report overlaps

It starts --processes copies of itself on this machine, each with --tasks
tasks that take the lock again and again and record every hold on the
machine's monotonic clock (a holder stops recording the moment it sees its
hold lost). Meanwhile it pauses holders past their lease (SIGSTOP, then
SIGCONT; any worker when none holds), kills and restarts workers
(SIGKILL), drops acquires and releases at random points, and runs --fault-cmd, on a schedule from --seed (printed,
so that a run can be repeated). Then it checks every hold: no two exclusive
holds overlap, fences rise in grant order, a semaphore never has more
holders than permits, a writer never shares, leaders never overlap.

A run that checked less than it was asked to is quiet: a fault asked for
never happened, or pauses were injected but no hold saw its loss (where a
pause past the lease loses the lock: Redis, etcd). It says so,
and fails unless --allow-quiet.

Exit code 0 with no violation, 1 with one or more (each printed with both
holds), when a primitive recorded no hold at all (the backend may not
offer it) or when the run was quiet, 64 for bad options, 69 when the
server failed.";

const LEASE_HELP: &str = "The workers' watchdog lease: how long a lock outlives a worker that was \
killed or paused (500ms, 10s, 1m30s). Each pause lasts 1.5 times it, so that a paused \
holder's lock expires. Default (auto): a tenth of --duration, from 2s to 30s, so that \
a run has room for several pauses (with the 30s `dlock run` uses, one pause would \
take 45s).";

/// `--watchdog-lease` of `verify`: a duration, or `auto` (given as zero,
/// which no lease can be) for one sized to the run.
fn lease_or_auto(text: &str) -> Result<Duration, String> {
    if text == "auto" {
        return Ok(Duration::ZERO);
    }
    match run::duration(text)? {
        Duration::ZERO => Err("a lease must be longer than zero".to_owned()),
        lease => Ok(lease),
    }
}

/// The lease of a run of `duration` with no `--watchdog-lease`.
fn auto_lease(duration: Duration) -> Duration {
    (duration / 10).clamp(Duration::from_secs(2), Duration::from_secs(30))
}

/// What the workers take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Primitive {
    Mutex,
    Rw,
    Semaphore(u32),
    Election,
}

impl Primitive {
    fn parse(text: &str) -> Result<Primitive, String> {
        Ok(match text {
            "mutex" => Primitive::Mutex,
            "rw" => Primitive::Rw,
            "election" => Primitive::Election,
            _ => match text.strip_prefix("semaphore:").map(str::parse) {
                Some(Ok(limit)) if limit > 0 => Primitive::Semaphore(limit),
                _ => {
                    return Err(format!(
                        "`{text}`: expected mutex, rw, semaphore:N (N ≥ 1), election or all"
                    ))
                }
            },
        })
    }

    fn name(self) -> String {
        match self {
            Primitive::Mutex => "mutex".to_owned(),
            Primitive::Rw => "rw".to_owned(),
            Primitive::Semaphore(limit) => format!("semaphore:{limit}"),
            Primitive::Election => "election".to_owned(),
        }
    }

    fn limit(self) -> u32 {
        match self {
            Primitive::Semaphore(limit) => limit,
            _ => 1,
        }
    }
}

/// The primitives of one run, each on a key of its own.
#[derive(Debug, Clone)]
pub(crate) struct Primitives(Vec<Primitive>);

fn primitives(text: &str) -> Result<Primitives, String> {
    if text == "all" {
        return Ok(Primitives(vec![
            Primitive::Mutex,
            Primitive::Rw,
            Primitive::Semaphore(3),
            Primitive::Election,
        ]));
    }
    text.split(',')
        .map(Primitive::parse)
        .collect::<Result<_, _>>()
        .map(Primitives)
}

/// The faults to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Fault {
    /// SIGSTOP a worker that holds a lock (any, if none does) past its
    /// lease, then SIGCONT.
    Pause,
    /// SIGKILL a worker and start a new one.
    Kill,
    /// Drop acquires and releases at random points.
    Cancel,
}

/// Check a deployment for double grants under faults.
#[derive(Debug, clap::Args)]
#[command(after_help = VERIFY_HELP)]
#[command(mut_arg("watchdog_lease", |arg| arg
    .default_value("auto")
    .value_parser(lease_or_auto)
    .help(LEASE_HELP)
    .long_help(None::<&str>)))]
pub(crate) struct VerifyArgs {
    #[command(flatten)]
    server: Server,
    /// How long to run.
    #[arg(long, value_parser = run::duration, default_value = "60s")]
    duration: Duration,
    /// How many worker processes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
    processes: u32,
    /// How many tasks in each worker.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    tasks: u32,
    /// mutex, rw, semaphore:N, election, or all (each on a key of its own).
    #[arg(long, default_value = "mutex", value_parser = primitives)]
    primitive: Primitives,
    /// The faults to inject.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "pause,kill,cancel"
    )]
    faults: Vec<Fault>,
    /// A command to run at random times (for example `systemctl restart
    /// redis`), through `sh -c`.
    #[arg(long, value_name = "COMMAND")]
    fault_cmd: Option<String>,
    /// The schedule's seed (random if not given; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Write the report as JSON to this file too.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Hold without taking the lock: the checker must report overlaps.
    #[arg(long)]
    no_lock: bool,
    /// The keys' prefix.
    #[arg(long, default_value = "dlock-verify")]
    key: String,
    /// Exit 0 after a quiet run too: one in which a fault asked for never
    /// happened, or no hold saw its loss.
    #[arg(long)]
    allow_quiet: bool,
}

impl VerifyArgs {
    /// The workers' watchdog lease.
    fn lease(&self) -> Duration {
        match self.server.watchdog_lease {
            Duration::ZERO => auto_lease(self.duration),
            lease => lease,
        }
    }
}

/// Now on the machine's monotonic clock, in nanoseconds: the same clock in
/// every process.
pub(crate) fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(now.tv_nsec).unwrap_or(0)
}

pub(crate) async fn verify(args: VerifyArgs) -> ExitCode {
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    let mut rng = fastrand::Rng::with_seed(seed);
    let primitive_names: Vec<String> = args.primitive.0.iter().map(|p| p.name()).collect();
    let lease = args.lease();
    say!(
        "dlock verify: {} for {:?}, {} processes × {} tasks, faults {:?}, lease {lease:?}{}, seed {seed}",
        primitive_names.join(", "),
        args.duration,
        args.processes,
        args.tasks,
        args.faults,
        if args.no_lock {
            ", WITHOUT the lock"
        } else {
            ""
        }
    );
    // A bad URL or a server that is not there is said once, here, rather
    // than by every worker.
    if (args.processes * args.tasks) < args.primitive.0.len() as u32 {
        say!(
            "dlock verify: {} primitives need at least as many tasks in all (--processes × --tasks)",
            args.primitive.0.len()
        );
        return ExitCode::from(exit::USAGE);
    }
    let url = match args.server.url() {
        Ok(url) => url,
        Err(code) => return code,
    };
    let mut server = args.server.clone();
    server.watchdog_lease = lease;
    if let Err(code) = server.connect_to(&url).await {
        return code;
    }
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(e) => {
            say!("dlock verify: a temporary directory: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let until = tokio::time::Instant::now() + args.duration;
    let mut workers = Workers {
        args: &args,
        dir: dir.path(),
        seed,
        lease,
        running: Vec::new(),
        next_id: 0,
        killed_at: HashMap::new(),
    };
    for slot in 0..args.processes {
        if let Err(e) = workers.spawn(until, &url, slot) {
            say!("dlock verify: starting a worker: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    }
    let progress = indicatif::ProgressBar::new(args.duration.as_secs().max(1));
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let started = tokio::time::Instant::now();
    let mut injected = Injected::default();
    let pause_for = lease.mul_f64(1.5);
    let mut choices: Vec<Injection> = Vec::new();
    if args.faults.contains(&Fault::Pause) {
        choices.push(Injection::Pause);
    }
    if args.faults.contains(&Fault::Kill) {
        choices.push(Injection::Kill);
    }
    if args.fault_cmd.is_some() {
        choices.push(Injection::Command);
    }
    let mut signals = match crate::child::Signals::listen() {
        Ok(signals) => signals,
        Err(code) => return code,
    };
    loop {
        // The next fault, at a random point of the next few seconds.
        let gap = Duration::from_millis(rng.u64(500..=2_500));
        let next = tokio::time::Instant::now() + gap;
        let last = next + pause_for >= until;
        tokio::select! {
            () = tokio::time::sleep_until(if last { until } else { next }) => {}
            signal = signals.recv() => {
                // Stopped: no worker is left paused (holding its locks)
                // or running.
                progress.finish_and_clear();
                for (_, _, child) in &mut workers.running {
                    if let Some(pid) = Workers::pid(child) {
                        let _ = kill_process(pid, Signal::CONT);
                    }
                    let _ = child.start_kill();
                }
                for (_, _, child) in &mut workers.running {
                    let _ = child.wait().await;
                }
                say!("dlock verify: stopped by signal {}", signal.as_raw());
                return exit::for_signal(signal.as_raw());
            }
        }
        if last {
            break;
        }
        progress.set_position(started.elapsed().as_secs());
        if choices.is_empty() || workers.running.is_empty() {
            continue;
        }
        // One of the faults injected least so far, so that a run has each
        // as soon as it has room for them.
        let least = choices.iter().map(|&c| injected.count(c)).min();
        let tied: Vec<Injection> = choices
            .iter()
            .copied()
            .filter(|&c| Some(injected.count(c)) == least)
            .collect();
        let pick = tied[rng.usize(..tied.len())];
        let at = rng.usize(..workers.running.len());
        match pick {
            Injection::Pause => {
                if let Some(pid) = workers.stop_a_holder(at, lease).await {
                    tokio::time::sleep(pause_for).await;
                    let _ = kill_process(pid, Signal::CONT);
                    injected.pauses += 1;
                }
            }
            Injection::Kill => {
                let (id, slot, mut child) = workers.running.swap_remove(at);
                // Its open holds end when the signal is sent: the server
                // may free them the moment the process is gone, before
                // the wait below returns.
                workers.killed_at.insert(id, monotonic_ns());
                let _ = child.start_kill();
                let _ = child.wait().await;
                injected.kills += 1;
                if let Err(e) = workers.spawn(until, &url, slot) {
                    say!("dlock verify: restarting a worker: {e}");
                }
            }
            Injection::Command => {
                if let Some(command) = &args.fault_cmd {
                    let ran = tokio::time::timeout(
                        Duration::from_secs(60),
                        Command::new("sh").args(["-c", command]).status(),
                    )
                    .await;
                    if !matches!(ran, Ok(Ok(status)) if status.success()) {
                        say!("dlock verify: --fault-cmd: {ran:?}");
                    }
                    injected.commands += 1;
                }
            }
        }
        progress.set_message(format!(
            "{} pauses, {} kills, {} commands",
            injected.pauses, injected.kills, injected.commands
        ));
    }
    progress.finish_and_clear();
    // The workers stop at the end themselves; a hung one is killed.
    let mut failed = Vec::new();
    for (id, _, mut child) in std::mem::take(&mut workers.running) {
        match tokio::time::timeout(Duration::from_secs(15), child.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(status) => failed.push(format!("worker {id}: {status:?}")),
            Err(_) => {
                workers.killed_at.insert(id, monotonic_ns());
                let _ = child.start_kill();
                let _ = child.wait().await;
                failed.push(format!("worker {id}: still running 15 s after the end"));
            }
        }
    }
    for failure in &failed {
        say!("dlock verify: {failure}");
    }
    let code = report(&args, &url, dir.path(), &workers.killed_at, &injected, seed);
    if failed.is_empty() {
        code
    } else {
        // A worker that failed left holds unchecked.
        ExitCode::FAILURE
    }
}

/// Reads the logs, checks them, prints the summary, writes the JSON.
fn report(
    args: &VerifyArgs,
    url: &str,
    dir: &Path,
    killed_at: &HashMap<u32, u64>,
    injected: &Injected,
    seed: u64,
) -> ExitCode {
    let logs = match logs::read_logs(dir, killed_at) {
        Ok(logs) => logs,
        Err(e) => {
            say!("dlock verify: reading the logs: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let lost = logs.lost;
    let mut rows = Vec::new();
    let mut all_violations = Vec::new();
    let mut unchecked = Vec::new();
    println!("{:<14} {:>8} {:>11}", "primitive", "holds", "violations");
    for (at, primitive) in args.primitive.0.iter().enumerate() {
        let holds = logs.holds.get(&at).map(Vec::as_slice).unwrap_or_default();
        let violations = check::check(holds, primitive.limit());
        println!(
            "{:<14} {:>8} {:>11}",
            primitive.name(),
            holds.len(),
            violations.len()
        );
        if holds.is_empty() {
            println!(
                "{}: no hold was recorded, so nothing was checked (see the workers' errors above)",
                primitive.name()
            );
            unchecked.push(primitive.name());
        }
        rows.push(serde_json::json!({
            "primitive": primitive.name(),
            "holds": holds.len(),
            "violations": violations.iter().map(ToString::to_string).collect::<Vec<_>>(),
        }));
        all_violations.extend(violations);
    }
    println!(
        "faults: {} pauses, {} kills, {} commands, {} cancels; holds that saw their loss: {lost}; lease {:?}; seed {seed}",
        injected.pauses,
        injected.kills,
        injected.commands,
        logs.cancels,
        args.lease(),
    );
    for violation in all_violations.iter().take(20) {
        println!("VIOLATION {violation}");
    }
    if all_violations.len() > 20 {
        println!("… and {} more", all_violations.len() - 20);
    }
    if !killed_at.is_empty() {
        let mut kills: Vec<_> = killed_at.iter().collect();
        kills.sort();
        for (worker, at) in kills {
            println!("worker {worker} killed at {:.6} s", *at as f64 / 1e9);
        }
    }
    let quiet = quiet(args, url, injected, &logs);
    for why in &quiet {
        println!("QUIET: {why}");
    }
    let ok =
        all_violations.is_empty() && unchecked.is_empty() && (quiet.is_empty() || args.allow_quiet);
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "url": dlock::backend::redact_url(url),
            "seed": seed,
            "duration_ms": args.duration.as_millis(),
            "watchdog_lease_ms": args.lease().as_millis(),
            "processes": args.processes,
            "tasks": args.tasks,
            "no_lock": args.no_lock,
            "faults": {
                "pauses": injected.pauses,
                "kills": injected.kills,
                "commands": injected.commands,
                "cancel": args.faults.contains(&Fault::Cancel),
                "cancels": logs.cancels,
            },
            "losses_seen": lost,
            "primitives": rows,
            "unchecked": unchecked,
            "quiet": quiet,
            "ok": ok,
        });
        if let Err(e) = std::fs::write(path, format!("{json:#}\n")) {
            say!("dlock verify: {}: {e}", path.display());
            return ExitCode::from(exit::SOFTWARE);
        }
    }
    if !unchecked.is_empty() {
        println!("unchecked: {}", unchecked.join(", "));
    }
    if !all_violations.is_empty() {
        println!("{} violations", all_violations.len());
    } else if unchecked.is_empty() {
        println!("no violation");
    }
    if !quiet.is_empty() {
        println!(
            "a quiet run: it checked less than asked{}",
            if args.allow_quiet {
                " (allowed by --allow-quiet)"
            } else {
                "; pass --allow-quiet to accept it"
            }
        );
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Why the run checked less than it was asked to: each fault asked for
/// that never happened; pauses that lost no lock where a pause past the
/// lease loses it.
fn quiet(args: &VerifyArgs, url: &str, injected: &Injected, logs: &logs::Logs) -> Vec<String> {
    let mut quiet = Vec::new();
    let lease = args.lease();
    if args.faults.contains(&Fault::Pause) && injected.pauses == 0 {
        quiet.push(format!(
            "no pause happened: each lasts {:?} (1.5 times the lease, {lease:?}), and the run had no room for one; a longer --duration or a shorter --watchdog-lease makes room",
            lease.mul_f64(1.5)
        ));
    }
    if args.faults.contains(&Fault::Kill) && injected.kills == 0 {
        quiet.push(
            "no kill happened: the run had no room for one; a longer --duration makes room"
                .to_owned(),
        );
    }
    if args.faults.contains(&Fault::Cancel) && logs.cancels == 0 {
        quiet.push("no acquire or release was dropped: no task took a lock".to_owned());
    }
    if args.fault_cmd.is_some() && injected.commands == 0 {
        quiet.push("--fault-cmd never ran: the run had no room for it".to_owned());
    }
    if injected.pauses > 0 && logs.lost == 0 && !args.no_lock && pause_loses_the_lock(url) {
        quiet.push(format!(
            "{} pauses, and no hold saw its loss: no pause stopped a holder past its lease",
            injected.pauses
        ));
    }
    quiet
}

/// Whether a holder paused past its watchdog lease loses its lock on the
/// backend of `url`: on Redis and etcd. Not a file lock, which has no
/// lease, nor a ZooKeeper or database lock, which lives as long as its
/// session (the URL's `session_timeout`).
fn pause_loses_the_lock(url: &str) -> bool {
    let scheme = url.split_once("://").map_or(url, |(scheme, _)| scheme);
    scheme.starts_with("redis") || scheme.starts_with("etcd")
}
