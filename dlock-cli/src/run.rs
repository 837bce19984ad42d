//! `dlock run`: the command runs only while the lock is held.

use std::{ffi::OsString, process::ExitCode, time::Duration};

use dlock::{backend::Mode, LockError, LockOptions};
use tokio::time::Instant;

use crate::{
    child::{code_of, supervise, Child, Ended, Limits, Signals},
    exit, Server,
};

const RUN_HELP: &str = "\
Examples:
  # One nightly report at a time, across every machine of the fleet:
  dlock run --url redis://10.0.0.5:6379 --key nightly-report -- ./report.sh

  # Skip this run if another is still going (exit 75):
  DLOCK_URL=etcd://10.0.0.5:2379/locks dlock run --key backup --no-wait -- ./backup.sh

  # A cron job on three machines, run once per 5-minute tick (the first to
  # fire runs it; the lock outlives a quick run until the tick is over):
  dlock run --url redis://10.0.0.5:6379 --key report --no-wait --hold-at-least 4m -- ./report.sh

  # At most 4 encoders at once:
  dlock run --url zk://10.0.0.5:2181/locks --key encoders --permits 4 -- ffmpeg -i in.mp4 out.webm

The command gets DLOCK_KEY and DLOCK_FENCE (the lock's fencing token, where
the backend gives one) in its environment. It runs in a process group of its
own: SIGINT, SIGTERM and SIGHUP sent to dlock are passed on to it; if the lock
is lost, it gets SIGTERM at once and SIGKILL after --kill-after. The lock is
released when the command and every process it started have exited (see
--leftovers-timeout). If dlock itself is killed, the command's processes are
killed with it (SIGKILL).

Without --url, the lock is a file in /run/lock (flock(1)'s place), which every
user of this machine shares.

Exit codes: the command's own (128 + N if signal N killed it); 75 when the
lock was not obtained (--conflict-exit-code); 76 when the lock was lost while
the command ran (--lost-exit-code); 79 when processes the command left
outlived --leftovers-timeout (--leftovers-exit-code); 64 for bad options; 69 when the lock
server failed; 126/127 when the command could not be run/was not found;
128 + N when signal N stopped dlock while it waited.";

/// Run a command while holding a lock.
#[derive(Debug, clap::Args)]
#[command(after_help = RUN_HELP)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    server: Server,
    /// The lock's key.
    #[arg(long)]
    key: String,
    /// Wait this long for the lock (500ms, 10s, 1m30s; the server's answer
    /// at the limit may come a round trip later); without it, wait as
    /// long as it takes.
    #[arg(long, value_parser = duration, conflicts_with = "no_wait")]
    wait: Option<Duration>,
    /// Do not wait: exit with the conflict code at once if the lock is held.
    #[arg(long)]
    no_wait: bool,
    /// A fixed lease: the lock ends this long after it is granted, even if
    /// the command still runs. Without it, dlock keeps the lock alive for
    /// as long as the command runs.
    #[arg(long, value_parser = duration)]
    lease: Option<Duration>,
    /// Keep the lock at least this long after it is granted, even if the
    /// command ends sooner (by the server's lease: dlock exits at once), so
    /// that a job fired on several machines runs once per period. Only
    /// where locks end by the server's lease alone (Redis, in every mode);
    /// elsewhere exit 64.
    #[arg(long, value_parser = duration, value_name = "DURATION")]
    hold_at_least: Option<Duration>,
    /// If dlock dies or loses the lock without releasing it, keep the key
    /// from everyone this long after its lease (at most 1m), so that a
    /// store the command writes to sees its last writes land or fail
    /// first. A normal exit frees the key at once. Only where locks end by
    /// the server's lease alone (Redis, in every mode); elsewhere exit 64.
    #[arg(long, value_parser = duration, value_name = "DURATION")]
    lock_delay: Option<Duration>,
    /// Take a read share of a read-write lock: readers run together.
    #[arg(long, group = "mode")]
    read: bool,
    /// Take the write side of a read-write lock: alone, without readers.
    #[arg(long, group = "mode")]
    write: bool,
    /// Take one of N permits: at most N commands run at once.
    #[arg(long, group = "mode", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    permits: Option<u32>,
    /// The exit code when the lock is not obtained.
    #[arg(long, value_name = "CODE", default_value_t = exit::CONFLICT)]
    conflict_exit_code: u8,
    /// The exit code when the lock is lost while the command runs.
    #[arg(long, value_name = "CODE", default_value_t = exit::LOST)]
    lost_exit_code: u8,
    #[command(flatten)]
    limits: Limits,
    /// Say on stderr when dlock starts waiting, gets the lock (with its
    /// fence and how long it took) and releases it.
    #[arg(short, long)]
    verbose: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// A duration in dlock's grammar, for clap.
pub(crate) fn duration(text: &str) -> Result<Duration, String> {
    dlock::parse_duration(text).map_err(|e| e.to_string())
}

pub(crate) async fn run(args: RunArgs) -> ExitCode {
    // Listening first: a signal while connecting or waiting ends the wait
    // (the acquire is dropped, which leaves nothing held).
    let mut signals = match Signals::listen() {
        Ok(signals) => signals,
        Err(code) => return code,
    };
    let key = args.key.as_str();
    let mode = match (args.read, args.write, args.permits) {
        (true, _, _) => Mode::Read,
        (_, true, _) => Mode::Write,
        (_, _, Some(limit)) => match Mode::permits(1, limit) {
            Ok(mode) => mode,
            Err(e) => {
                say!("dlock: {e}");
                return exit::for_error(&e);
            }
        },
        _ => Mode::Exclusive,
    };
    let mut options = LockOptions::new();
    if let Some(lease) = args.lease {
        options = options.lease(lease);
    }
    if let Some(at_least) = args.hold_at_least {
        options = options.hold_at_least(at_least);
    }
    if let Some(delay) = args.lock_delay {
        options = options.lock_delay(delay);
    }
    let acquired = tokio::select! {
        acquired = async {
            let locker = args.server.connect().await?;
            let started = Instant::now();
            // One attempt first: a wait is announced (with --verbose) only
            // when there is one.
            let mut guard = locker.try_lock_mode(key, mode, options).await;
            if matches!(guard, Ok(None)) && !args.no_wait {
                if args.verbose {
                    say!("dlock: waiting for lock `{key}`");
                }
                let options = match args.wait {
                    Some(wait) => options.wait(wait),
                    None => options.wait_forever(),
                };
                guard = locker.lock_mode(key, mode, options).await.map(Some);
            }
            if let (Ok(Some(guard)), true) = (&guard, args.verbose) {
                let fence = guard.fencing_token().map(|f| format!(" (fence {f})")).unwrap_or_default();
                say!("dlock: got lock `{key}`{fence} after {:.3?}", started.elapsed());
            }
            match guard {
                // The locker lives as long as the guard: its watchdog keeps
                // the lock alive.
                Ok(Some(guard)) => Ok((locker, guard)),
                Ok(None) | Err(LockError::WouldBlock { .. } | LockError::Timeout { .. }) => {
                    say!("dlock: lock `{key}` is held by another owner");
                    Err(ExitCode::from(args.conflict_exit_code))
                }
                Err(e) => {
                    say!("dlock: {e}");
                    Err(exit::for_error(&e))
                }
            }
        } => acquired,
        signal = signals.recv() => {
            say!("dlock: stopped by signal {} while waiting for lock `{key}`", signal.as_raw());
            return exit::for_signal(signal.as_raw());
        }
    };
    let (_locker, guard) = match acquired {
        Ok(held) => held,
        Err(code) => return code,
    };
    // Lost between the grant and now (a fixed lease shorter than the
    // connect, say): the command never starts.
    if guard.is_lost() {
        say!("dlock: lock `{key}` was lost before the command started");
        return ExitCode::from(args.lost_exit_code);
    }
    let mut env = vec![("DLOCK_KEY", key.to_owned())];
    if let Some(fence) = guard.fencing_token() {
        env.push(("DLOCK_FENCE", fence.to_string()));
    }
    let mut child = match Child::spawn(&args.command, &env).await {
        Ok(child) => child,
        Err(code) => {
            let _ = release(guard, key).await;
            return code;
        }
    };
    let ended = supervise(
        &mut child,
        &mut signals,
        guard.lost(),
        || guard.release_requested(),
        &format!("lock `{key}`"),
        args.limits,
    )
    .await;
    // Released on every path once the command is gone (a lost lock needs
    // no release).
    if !ended.lost && release(guard, key).await && args.verbose {
        say!("dlock: released lock `{key}`");
    }
    match ended {
        Ended { lost: true, .. } => ExitCode::from(args.lost_exit_code),
        Ended {
            stragglers: true, ..
        } => ExitCode::from(args.limits.leftovers_exit_code),
        Ended {
            status: Ok(status), ..
        } => code_of(status),
        Ended { status: Err(e), .. } => {
            say!("dlock: lost track of the command: {e}");
            ExitCode::from(exit::SOFTWARE)
        }
    }
}

/// Releases `guard`, saying so if the release failed or took longer than
/// [`RELEASE_WITHIN`] (the server's lease then ends the lock): whether it
/// was released.
pub(crate) async fn release(guard: dlock::LockGuard, key: &str) -> bool {
    match tokio::time::timeout(RELEASE_WITHIN, guard.release()).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            say!("dlock: releasing lock `{key}`: {e}");
            false
        }
        Err(_) => {
            say!(
                "dlock: releasing lock `{key}` took over {RELEASE_WITHIN:?}: its lease will end it"
            );
            false
        }
    }
}

/// How long dlock waits for a release (or a resignation) before it exits.
pub(crate) const RELEASE_WITHIN: Duration = Duration::from_secs(10);
