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

use rustix::process::{kill_process, Pid, Signal};
use tokio::process::{Child, Command};

use crate::{exit, run, Server};

mod check;
mod worker;

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

Exit code 0 with no violation, 1 with one or more (each printed with both
holds) or when a primitive recorded no hold at all (the backend may not
offer it), 64 for bad options, 69 when the server failed.";

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
}

/// Now on the machine's monotonic clock, in nanoseconds: the same clock in
/// every process.
pub(crate) fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(now.tv_nsec).unwrap_or(0)
}

/// The running workers.
struct Workers<'a> {
    args: &'a VerifyArgs,
    dir: &'a Path,
    seed: u64,
    /// Each worker's number, slot and process.
    running: Vec<(u32, u32, Child)>,
    next_id: u32,
    /// When each killed worker died: its open holds end there.
    killed_at: HashMap<u32, u64>,
}

impl Workers<'_> {
    fn spawn(&mut self, until: tokio::time::Instant, url: &str, slot: u32) -> std::io::Result<()> {
        let id = self.next_id;
        self.next_id += 1;
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let exe = std::env::current_exe()?;
        let primitives: Vec<String> = self.args.primitive.0.iter().map(|p| p.name()).collect();
        let mut command = Command::new(exe);
        command
            .arg("verify-worker")
            // In the environment, not the arguments: any local user can
            // read a process's arguments (ps), and the URL may hold a
            // password.
            .env("DLOCK_URL", url)
            .arg("--watchdog-lease")
            .arg(format!("{}ms", self.args.server.watchdog_lease.as_millis()))
            .args(["--key", &self.args.key])
            .args(["--primitives", &primitives.join(",")])
            .args(["--worker", &id.to_string()])
            .args(["--slot", &slot.to_string()])
            .args(["--tasks", &self.args.tasks.to_string()])
            .arg("--log")
            .arg(self.log(id))
            .args(["--seed", &self.seed.to_string()])
            .arg("--duration")
            .arg(format!("{}ms", left.as_millis().max(1)))
            .kill_on_drop(true);
        if self.args.faults.contains(&Fault::Cancel) {
            command.arg("--cancel");
        }
        if self.args.no_lock {
            command.arg("--no-lock");
        }
        self.running.push((id, slot, command.spawn()?));
        Ok(())
    }

    fn log(&self, id: u32) -> PathBuf {
        self.dir.join(format!("worker-{id}.log"))
    }

    /// Stops a worker that holds a lock now, looking from the one at `at`
    /// on (once stopped, a worker's log is still, so its last lines
    /// tell); if none does, the first it could stop stays stopped. Its
    /// process id; `None` if none could be stopped.
    async fn stop_a_holder(&self, at: usize) -> Option<Pid> {
        let count = self.running.len();
        let mut fallback = None;
        for i in 0..count {
            let (id, _, child) = &self.running[(at + i) % count];
            let Some(pid) = Workers::pid(child) else {
                continue;
            };
            if kill_process(pid, Signal::STOP).is_err() {
                continue;
            }
            // The signal is sent, not yet taken: a moment until the
            // process shows as stopped (bounded; read anyway after it).
            for _ in 0..50 {
                if is_stopped(pid) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if holds_now(&self.log(*id)) {
                if let Some(other) = fallback {
                    let _ = kill_process(other, Signal::CONT);
                }
                return Some(pid);
            }
            match fallback {
                None => fallback = Some(pid),
                Some(_) => {
                    let _ = kill_process(pid, Signal::CONT);
                }
            }
        }
        fallback
    }

    fn pid(child: &Child) -> Option<Pid> {
        child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw)
    }
}

/// What was injected.
#[derive(Debug, Default)]
struct Injected {
    pauses: u32,
    kills: u32,
    commands: u32,
}

pub(crate) async fn verify(args: VerifyArgs) -> ExitCode {
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    let mut rng = fastrand::Rng::with_seed(seed);
    let primitive_names: Vec<String> = args.primitive.0.iter().map(|p| p.name()).collect();
    eprintln!(
        "dlock verify: {} for {:?}, {} processes × {} tasks, faults {:?}{}, seed {seed}",
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
        eprintln!(
            "dlock verify: {} primitives need at least as many tasks in all (--processes × --tasks)",
            args.primitive.0.len()
        );
        return ExitCode::from(exit::USAGE);
    }
    let url = match args.server.url() {
        Ok(url) => url,
        Err(code) => return code,
    };
    if let Err(code) = args.server.connect_to(&url).await {
        return code;
    }
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("dlock verify: a temporary directory: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let until = tokio::time::Instant::now() + args.duration;
    let mut workers = Workers {
        args: &args,
        dir: dir.path(),
        seed,
        running: Vec::new(),
        next_id: 0,
        killed_at: HashMap::new(),
    };
    for slot in 0..args.processes {
        if let Err(e) = workers.spawn(until, &url, slot) {
            eprintln!("dlock verify: starting a worker: {e}");
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
    let pause_for = args.server.watchdog_lease.mul_f64(1.5);
    let faults: Vec<Fault> = args
        .faults
        .iter()
        .copied()
        .filter(|f| *f != Fault::Cancel)
        .collect();
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
                eprintln!("dlock verify: stopped by signal {}", signal.as_raw());
                return exit::for_signal(signal.as_raw());
            }
        }
        if last {
            break;
        }
        progress.set_position(started.elapsed().as_secs());
        let choices = faults.len() + usize::from(args.fault_cmd.is_some());
        if choices == 0 || workers.running.is_empty() {
            continue;
        }
        let pick = rng.usize(..choices);
        let at = rng.usize(..workers.running.len());
        match faults.get(pick) {
            Some(Fault::Pause) => {
                if let Some(pid) = workers.stop_a_holder(at).await {
                    tokio::time::sleep(pause_for).await;
                    let _ = kill_process(pid, Signal::CONT);
                    injected.pauses += 1;
                }
            }
            Some(Fault::Kill) => {
                let (id, slot, mut child) = workers.running.swap_remove(at);
                // Its open holds end when the signal is sent: the server
                // may free them the moment the process is gone, before
                // the wait below returns.
                workers.killed_at.insert(id, monotonic_ns());
                let _ = child.start_kill();
                let _ = child.wait().await;
                injected.kills += 1;
                if let Err(e) = workers.spawn(until, &url, slot) {
                    eprintln!("dlock verify: restarting a worker: {e}");
                }
            }
            _ => {
                if let Some(command) = &args.fault_cmd {
                    let ran = tokio::time::timeout(
                        Duration::from_secs(60),
                        Command::new("sh").args(["-c", command]).status(),
                    )
                    .await;
                    if !matches!(ran, Ok(Ok(status)) if status.success()) {
                        eprintln!("dlock verify: --fault-cmd: {ran:?}");
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
        eprintln!("dlock verify: {failure}");
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
    let (by_primitive, lost) = match read_logs(dir) {
        Ok(read) => read,
        Err(e) => {
            eprintln!("dlock verify: reading the logs: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let mut rows = Vec::new();
    let mut all_violations = Vec::new();
    let mut unchecked = Vec::new();
    println!("{:<14} {:>8} {:>11}", "primitive", "holds", "violations");
    for (at, primitive) in args.primitive.0.iter().enumerate() {
        let holds = by_primitive.get(&at).map(Vec::as_slice).unwrap_or_default();
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
        "faults: {} pauses, {} kills, {} commands{}; holds that saw their loss: {lost}; seed {seed}",
        injected.pauses,
        injected.kills,
        injected.commands,
        if args.faults.contains(&Fault::Cancel) {
            ", cancels"
        } else {
            ""
        }
    );
    for violation in all_violations.iter().take(20) {
        println!("VIOLATION {violation}");
    }
    if !killed_at.is_empty() {
        let mut kills: Vec<_> = killed_at.iter().collect();
        kills.sort();
        for (worker, at) in kills {
            println!("worker {worker} killed at {:.6} s", *at as f64 / 1e9);
        }
    }
    if all_violations.len() > 20 {
        println!("… and {} more", all_violations.len() - 20);
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "url": dlock::backend::redact_url(url),
            "seed": seed,
            "duration_ms": args.duration.as_millis(),
            "processes": args.processes,
            "tasks": args.tasks,
            "no_lock": args.no_lock,
            "faults": {
                "pauses": injected.pauses,
                "kills": injected.kills,
                "commands": injected.commands,
                "cancel": args.faults.contains(&Fault::Cancel),
            },
            "losses_seen": lost,
            "primitives": rows,
            "unchecked": unchecked,
            "ok": all_violations.is_empty() && unchecked.is_empty(),
        });
        if let Err(e) = std::fs::write(path, format!("{json:#}\n")) {
            eprintln!("dlock verify: {}: {e}", path.display());
            return ExitCode::from(exit::SOFTWARE);
        }
    }
    if !unchecked.is_empty() {
        println!("unchecked: {}", unchecked.join(", "));
        ExitCode::FAILURE
    } else if all_violations.is_empty() {
        println!("no violation");
        ExitCode::SUCCESS
    } else {
        println!("{} violations", all_violations.len());
        ExitCode::FAILURE
    }
}

type Holds = HashMap<usize, Vec<check::Hold>>;

/// Whether every thread of process `pid` is stopped (state `T` in
/// `/proc/PID/task/*/stat`): a log write in flight has ended then.
fn is_stopped(pid: Pid) -> bool {
    let stopped = |stat: String| {
        let state = stat.rfind(')').map(|end| stat[end + 1..].trim_start());
        state.is_some_and(|s| s.starts_with('T'))
    };
    std::fs::read_dir(format!("/proc/{}/task", pid.as_raw_nonzero())).is_ok_and(|tasks| {
        tasks
            .flatten()
            .all(|t| std::fs::read_to_string(t.path().join("stat")).is_ok_and(stopped))
    })
}

/// Whether the worker whose log is at `path` holds a lock now: a task's
/// last start or heartbeat in the log's tail has no end after it. A line not ended by
/// its newline is left out, as the checker leaves it out.
fn holds_now(path: &Path) -> bool {
    use std::io::{Read as _, Seek as _, SeekFrom};
    /// The last lines of every task of the worker: each writes about 200
    /// bytes a hold (up to 20 ms, a heartbeat every 5 ms), so this is the
    /// last hold of some 300 tasks.
    const TAIL: u64 = 64 * 1024;
    let Ok(mut file) = std::fs::File::open(path) else {
        return false;
    };
    let length = file.metadata().map_or(0, |m| m.len());
    let mut tail = Vec::new();
    if file
        .seek(SeekFrom::Start(length.saturating_sub(TAIL)))
        .is_err()
        || file.read_to_end(&mut tail).is_err()
    {
        return false;
    }
    let whole = tail
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |end| end + 1);
    let text = String::from_utf8_lossy(&tail[..whole]);
    // The tail's first line is whole only if the tail is the whole file.
    let skip = usize::from(length > TAIL);
    let mut open: HashMap<(&str, &str), bool> = HashMap::new();
    for line in text.lines().skip(skip) {
        let fields: Vec<&str> = line.split(' ').collect();
        // A heartbeat says held too (its start may be out of the tail).
        if let [kind @ ("S" | "H" | "E"), worker, task, ..] = fields[..] {
            open.insert((worker, task), kind != "E");
        }
    }
    open.values().any(|&held| held)
}

/// Every hold in the workers' logs, by primitive; and how many ended in a
/// loss their holder saw. A hold left open (its worker was killed) ends
/// at the last moment it was known held (its last heartbeat, else its
/// start): never later, so a kill makes no false overlap.
fn read_logs(dir: &Path) -> std::io::Result<(Holds, usize)> {
    let mut holds: Holds = HashMap::new();
    let mut lost = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)?;
        // Only the last line may be torn, by a kill mid-write.
        let whole = match text.rfind('\n') {
            Some(end) => &text[..end],
            None => "",
        };
        let mut open: HashMap<(u32, u32), (usize, check::Hold)> = HashMap::new();
        for line in whole.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let number = |at: usize| fields.get(at).and_then(|f| f.parse::<u64>().ok());
            let bad = || {
                std::io::Error::other(format!("{}: malformed log line `{line}`", path.display()))
            };
            let id = |at: usize| {
                number(at)
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(bad)
            };
            match fields.first() {
                Some(&"S") => {
                    let (worker, task) = (id(1)?, id(2)?);
                    let primitive = id(3)? as usize;
                    let start_ns = number(4).ok_or_else(bad)?;
                    let hold = check::Hold {
                        worker,
                        task,
                        start_ns,
                        end_ns: start_ns,
                        fence: number(5),
                        kind: fields
                            .get(6)
                            .and_then(|k| check::Kind::from_letter(k))
                            .ok_or_else(bad)?,
                    };
                    open.insert((worker, task), (primitive, hold));
                }
                Some(&"H") => {
                    if let Some((_, hold)) = open.get_mut(&(id(1)?, id(2)?)) {
                        hold.end_ns = number(3).ok_or_else(bad)?;
                    }
                }
                Some(&"E") => {
                    if let Some((primitive, mut hold)) = open.remove(&(id(1)?, id(2)?)) {
                        hold.end_ns = number(3).ok_or_else(bad)?;
                        lost += usize::from(number(4) == Some(1));
                        holds.entry(primitive).or_default().push(hold);
                    }
                }
                _ => return Err(bad()),
            }
        }
        for (primitive, hold) in open.into_values() {
            holds.entry(primitive).or_default().push(hold);
        }
    }
    Ok((holds, lost))
}

#[cfg(test)]
mod tests {
    use super::holds_now;

    #[test]
    fn a_worker_holds_while_a_task_has_a_start_with_no_end_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("worker-0.log");
        let case = |text: &str| {
            std::fs::write(&log, text).unwrap();
            holds_now(&log)
        };
        assert!(!case(""));
        assert!(case("S 0 1 0 100 5 X\nH 0 1 150\n"));
        // A hold whose start has scrolled out of the tail.
        assert!(case("H 0 1 150\n"));
        assert!(!case("S 0 1 0 100 5 X\nE 0 1 200 0\n"));
        // Another task's start; and an end not yet whole, left out.
        assert!(case("S 0 1 0 100 5 X\nS 0 2 1 120 - R\nE 0 1 200 0\n"));
        assert!(case("S 0 1 0 100 5 X\nE 0 1"));
        assert!(!case("S 0 1 0 100 5 X\nE 0 1 200 1\nE 0 2 210 0\n"));
        assert!(!holds_now(&dir.path().join("no-such.log")));
    }
}
