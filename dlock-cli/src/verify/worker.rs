//! A worker of `dlock verify`: tasks that take and hold the lock again and
//! again, recording every hold in a log the checker reads.

use std::{
    fs::File,
    future::Future,
    io::Write as _,
    path::PathBuf,
    process::ExitCode,
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock::{backend::Mode, LockError, LockGuard, LockOptions, Locker};

use super::{check::Kind, monotonic_ns, Primitive};
use crate::{exit, run, Server};

/// One worker process (started by `dlock verify`, not by hand).
#[derive(Debug, clap::Args)]
pub(crate) struct WorkerArgs {
    #[command(flatten)]
    server: Server,
    /// The keys' common prefix.
    #[arg(long)]
    key: String,
    /// The primitives, one key each.
    #[arg(long, value_parser = super::primitives)]
    primitives: super::Primitives,
    /// This worker's number (a respawn gets a new one).
    #[arg(long)]
    worker: u32,
    /// Its place among the workers (a respawn takes its predecessor's):
    /// which primitive each task runs.
    #[arg(long)]
    slot: u32,
    #[arg(long)]
    tasks: u32,
    #[arg(long)]
    log: PathBuf,
    #[arg(long)]
    seed: u64,
    /// How long to run.
    #[arg(long, value_parser = run::duration)]
    duration: Duration,
    /// Drop acquisitions and releases at random points.
    #[arg(long)]
    cancel: bool,
    /// Hold without taking the lock (to see the checker fail).
    #[arg(long)]
    no_lock: bool,
}

/// The log: one line per event, each written whole.
#[derive(Clone)]
struct Log(Arc<Mutex<File>>);

impl Log {
    fn write(&self, line: &str) {
        let mut file = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // One write per line, on a file opened for appending: lines of
        // every process interleave whole. A failed write ends the run
        // loudly: a hole in the log would hide a violation.
        if let Err(e) = file.write_all(line.as_bytes()) {
            say!("dlock verify worker: writing the log: {e}");
            std::process::exit(i32::from(exit::SOFTWARE));
        }
    }
}

pub(crate) async fn worker(args: WorkerArgs) -> ExitCode {
    let file = match File::options().create(true).append(true).open(&args.log) {
        Ok(file) => file,
        Err(e) => {
            say!("dlock verify worker: {}: {e}", args.log.display());
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let log = Log(Arc::new(Mutex::new(file)));
    let locker = match args.server.connect().await {
        Ok(locker) => locker,
        Err(code) => return code,
    };
    let until = tokio::time::Instant::now() + args.duration;
    let args = Arc::new(args);
    let mut tasks = Vec::new();
    for task in 0..args.tasks {
        // Spread over every worker's tasks, so that each primitive runs
        // even when a worker has fewer tasks than there are primitives.
        let slot = args.slot as usize * args.tasks as usize + task as usize;
        let primitive_at = slot % args.primitives.0.len();
        let (args, locker, log) = (args.clone(), locker.clone(), log.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(
                args.seed ^ (u64::from(args.worker) << 32) ^ u64::from(task),
            );
            let mut task = Task {
                args: &args,
                locker: &locker,
                log: &log,
                task,
                primitive_at,
                rng: &mut rng,
            };
            while tokio::time::Instant::now() < until {
                if let Err(e) = task.once().await {
                    say!("dlock verify worker {}: {e}", args.worker);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    ExitCode::SUCCESS
}

struct Task<'a> {
    args: &'a WorkerArgs,
    locker: &'a Locker,
    log: &'a Log,
    task: u32,
    primitive_at: usize,
    rng: &'a mut fastrand::Rng,
}

/// The longest a task waits for the lock before it tries again.
const WAIT: Duration = Duration::from_secs(5);
/// The longest a task holds the lock.
const HOLD_MAX_MS: u64 = 20;
/// How often a hold writes the last moment it was known held.
const HEARTBEAT_NS: u64 = 5_000_000;

impl Task<'_> {
    fn key(&self) -> String {
        format!("{}/{}", self.args.key, self.primitive_at)
    }

    /// One round: take, hold (checking the hold all along), give back.
    async fn once(&mut self) -> Result<(), LockError> {
        let primitive = self.args.primitives.0[self.primitive_at];
        if primitive == Primitive::Election && !self.args.no_lock {
            return self.lead_once().await;
        }
        let kind = match primitive {
            Primitive::Mutex => Kind::Exclusive,
            Primitive::Rw if self.rng.u8(..10) < 7 => Kind::Read,
            Primitive::Rw => Kind::Write,
            Primitive::Semaphore(_) => Kind::Permit,
            Primitive::Election => Kind::Leader,
        };
        if self.args.no_lock {
            let start = monotonic_ns();
            self.started(start, None, kind);
            let hold = self.rng.u64(..=HOLD_MAX_MS);
            tokio::time::sleep(Duration::from_millis(hold)).await;
            self.ended(monotonic_ns(), false);
            return Ok(());
        }
        let mode = match (primitive, kind) {
            (Primitive::Semaphore(limit), _) => Mode::permits(1, limit)?,
            (_, Kind::Read) => Mode::Read,
            (_, Kind::Write) => Mode::Write,
            _ => Mode::Exclusive,
        };
        let key = self.key();
        let acquire = self
            .locker
            .lock_mode(&key, mode, LockOptions::new().wait(WAIT));
        // A cancel fault: the acquire dropped at a random point.
        if self.args.cancel && self.rng.u8(..5) == 0 {
            let cut = Duration::from_micros(self.rng.u64(..3_000));
            self.drop_acquire(acquire, cut, kind).await;
            return Ok(());
        }
        let guard = match acquire.await {
            Ok(guard) => guard,
            Err(LockError::Timeout { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let start = monotonic_ns();
        if guard.is_lost() {
            return Ok(());
        }
        self.started(start, guard.fencing_token(), kind);
        let (last_ok, lost) = self.hold(start, || !guard.is_lost()).await;
        self.ended(last_ok, lost);
        if self.args.cancel && self.rng.u8(..5) == 0 {
            let cut = Duration::from_micros(self.rng.u64(..2_000));
            self.cancelled();
            let _ = tokio::time::timeout(cut, guard.release()).await;
        } else {
            let _ = guard.release().await;
        }
        Ok(())
    }

    /// A cancel fault: `acquire` dropped after `cut`. One that completed
    /// by then is a hold, from its grant until its guard is dropped here
    /// (which releases it in the background).
    async fn drop_acquire(
        &self,
        acquire: impl Future<Output = Result<LockGuard, LockError>>,
        cut: Duration,
        kind: Kind,
    ) {
        self.cancelled();
        let Ok(Ok(guard)) = tokio::time::timeout(cut, acquire).await else {
            return;
        };
        let start = monotonic_ns();
        if guard.is_lost() {
            return;
        }
        self.started(start, guard.fencing_token(), kind);
        // The time first: held after it means held at it.
        let end = monotonic_ns();
        let lost = guard.is_lost();
        self.ended(if lost { start } else { end }, lost);
        drop(guard);
    }

    /// One leadership: campaign, lead a while, resign.
    async fn lead_once(&mut self) -> Result<(), LockError> {
        let election = self.locker.elect(self.key())?;
        let Ok(leadership) = tokio::time::timeout(WAIT, election.lead()).await else {
            return Ok(());
        };
        let leadership = leadership?;
        let start = monotonic_ns();
        if !leadership.is_current() {
            return Ok(());
        }
        self.started(start, Some(leadership.term()), Kind::Leader);
        let (last_ok, lost) = self.hold(start, || leadership.is_current()).await;
        self.ended(last_ok, lost);
        election.resign().await
    }

    /// Holds for a random time up to [`HOLD_MAX_MS`], checking `held`
    /// every millisecond or two: the last moment it still held, and
    /// whether it was lost.
    async fn hold(&mut self, start: u64, held: impl Fn() -> bool) -> (u64, bool) {
        let until = start + self.rng.u64(..=HOLD_MAX_MS) * 1_000_000;
        let mut last_ok = start;
        let mut beat = start;
        loop {
            // The time first: held after it means held at it.
            let now = monotonic_ns();
            if !held() {
                return (last_ok, true);
            }
            last_ok = now;
            if now >= until {
                return (last_ok, false);
            }
            // Now and then, the last moment known held, for a worker that
            // is killed before it writes the end: its hold ends there.
            if now - beat >= HEARTBEAT_NS {
                beat = now;
                self.log
                    .write(&format!("H {} {} {now}\n", self.args.worker, self.task));
            }
            tokio::time::sleep(Duration::from_micros(self.rng.u64(500..2_000))).await;
        }
    }

    fn started(&self, start: u64, fence: Option<u64>, kind: Kind) {
        let fence = fence.map_or("-".to_owned(), |f| f.to_string());
        self.log.write(&format!(
            "S {} {} {} {start} {fence} {}\n",
            self.args.worker,
            self.task,
            self.primitive_at,
            kind.letter()
        ));
    }

    /// A cancel fault was injected.
    fn cancelled(&self) {
        self.log
            .write(&format!("C {} {}\n", self.args.worker, self.task));
    }

    fn ended(&self, end: u64, lost: bool) {
        self.log.write(&format!(
            "E {} {} {end} {}\n",
            self.args.worker,
            self.task,
            u8::from(lost)
        ));
    }
}

#[cfg(test)]
mod tests {
    use std::{path::Path, sync::Arc, time::Duration};

    use clap::Parser as _;
    use dlock::{backend::Mode, LockOptions};

    use super::{Log, Task, WorkerArgs};
    use crate::verify::check::Kind;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: WorkerArgs,
    }

    /// A worker of one task on a mutex, on a file lock directory in `dir`.
    fn worker_args(dir: &Path) -> WorkerArgs {
        let url = format!("file://{}", dir.join("locks").display());
        let log = dir.join("worker-0.log");
        let argv = [
            "worker",
            "--url",
            &url,
            "--key",
            "k",
            "--primitives",
            "mutex",
            "--worker",
            "0",
            "--slot",
            "0",
            "--tasks",
            "1",
            "--seed",
            "1",
            "--duration",
            "1s",
            "--cancel",
            "--log",
        ];
        let mut argv: Vec<&str> = argv.to_vec();
        let log = log.display().to_string();
        argv.push(&log);
        Cli::try_parse_from(argv).expect("arguments").args
    }

    #[tokio::test]
    async fn an_acquire_that_completed_before_its_drop_is_a_hold() {
        let dir = tempfile::tempdir().unwrap();
        let args = worker_args(dir.path());
        std::fs::create_dir(dir.path().join("locks")).unwrap();
        let locker = args.server.connect().await.expect("a file locker");
        let file = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&args.log)
            .unwrap();
        let log = Log(Arc::new(std::sync::Mutex::new(file)));
        let mut rng = fastrand::Rng::with_seed(1);
        let task = Task {
            args: &args,
            locker: &locker,
            log: &log,
            task: 0,
            primitive_at: 0,
            rng: &mut rng,
        };
        // Free, and a cut long enough: the acquire completes, and its
        // guard is dropped at once.
        let acquire = locker.lock_mode(
            "k/0",
            Mode::Exclusive,
            LockOptions::new().wait(Duration::from_secs(5)),
        );
        task.drop_acquire(acquire, Duration::from_secs(5), Kind::Exclusive)
            .await;
        let text = std::fs::read_to_string(&args.log).unwrap();
        let holds: Vec<&str> = text.lines().filter(|l| l.starts_with("S ")).collect();
        assert_eq!(
            holds.len(),
            1,
            "the granted, dropped acquire is no hold in its log:\n{text}"
        );
        assert!(text.lines().any(|l| l.starts_with("E 0 0 ")), "{text}");
    }
}
