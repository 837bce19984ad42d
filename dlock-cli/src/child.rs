//! The command `dlock` runs: started in a process group of its own, so
//! that a signal reaches it and everything it started, and stopped with
//! SIGTERM, then SIGKILL.
//!
//! The lock covers every process the command starts, not only its first:
//! `dlock` is their subreaper (Linux), so that a process whose parent
//! exits comes back to it, and it waits until none is left before it
//! releases. A [`Guard`] kills them all if `dlock` itself dies.

use std::{
    ffi::OsString,
    fmt::Display,
    future::Future,
    io,
    os::unix::process::{CommandExt as _, ExitStatusExt as _},
    process::{ExitCode, ExitStatus},
    time::Duration,
};

use rustix::process::{kill_process_group, Pid, Signal};
use tokio::{
    signal::unix::{signal, SignalKind},
    time::Instant,
};

use crate::{exit, guard::Guard, tree};

/// A running command: the leader of its own process group, unless it runs
/// in the terminal's foreground (see [`Child::spawn`]).
pub(crate) struct Child {
    process: tokio::process::Child,
    pid: Option<Pid>,
    /// Whether the command leads a process group of its own.
    own_group: bool,
    guard: Option<Guard>,
    /// Whether the command's own process has exited (and was reaped).
    exited: bool,
}

/// The variables dlock sets for the command: never inherited from dlock's
/// own environment (a `dlock run` inside another must not pass the outer
/// lock's fence on as its own).
const OURS: [&str; 3] = ["DLOCK_KEY", "DLOCK_FENCE", "DLOCK_TERM"];

/// How often `dlock` looks whether the processes a command left behind
/// have exited.
const POLL: Duration = Duration::from_millis(50);

/// How long `dlock` waits for processes it sent SIGKILL to before it
/// gives up on them (a process stuck in the kernel).
const KILL_GRACE: Duration = Duration::from_secs(5);

impl Child {
    /// Starts `command` (the program, then its arguments) with `env` added
    /// to dlock's environment, and a guard that kills it if dlock dies;
    /// or the exit code and message for why not (127 when the program is
    /// not found, 126 when it cannot be run).
    ///
    /// The command gets a process group of its own, so that a signal
    /// reaches everything it started; except when dlock runs in a
    /// terminal's foreground (an interactive `dlock run -- psql`): a
    /// command outside the foreground group would be stopped the moment
    /// it reads the terminal, so there it stays in dlock's group, the
    /// terminal's own signals reach it directly, and dlock signals it
    /// alone (and what it started).
    pub(crate) fn spawn(command: &[OsString], env: &[(&str, String)]) -> Result<Child, ExitCode> {
        let Some((program, args)) = command.split_first() else {
            eprintln!("dlock: no command given");
            return Err(ExitCode::from(exit::USAGE));
        };
        // What the command leaves behind when its parent exits comes back
        // to dlock, which waits for it (see `supervise`).
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            eprintln!("dlock: cannot follow the processes the command starts: {e}");
            return Err(ExitCode::from(exit::SOFTWARE));
        }
        let mut guard = Guard::start()?;
        let own_group = !in_terminal_foreground();
        let mut builder = std::process::Command::new(program);
        builder.args(args);
        if own_group {
            builder.process_group(0);
        }
        for name in OURS {
            builder.env_remove(name);
        }
        for (name, value) in env {
            builder.env(name, value);
        }
        match tokio::process::Command::from(builder).spawn() {
            Ok(process) => {
                let pid = process
                    .id()
                    .and_then(|id| i32::try_from(id).ok())
                    .and_then(Pid::from_raw);
                if let Some(pid) = pid {
                    guard.watch(
                        pid.as_raw_nonzero().get(),
                        own_group.then(|| pid.as_raw_nonzero().get()),
                    );
                }
                Ok(Child {
                    process,
                    pid,
                    own_group,
                    guard: Some(guard),
                    exited: false,
                })
            }
            Err(e) => {
                guard.done();
                eprintln!("dlock: cannot run {}: {e}", program.to_string_lossy());
                Err(ExitCode::from(match e.kind() {
                    io::ErrorKind::NotFound => exit::NOT_FOUND,
                    _ => exit::CANNOT_RUN,
                }))
            }
        }
    }

    /// The command's process group, if it leads one.
    fn group(&self) -> Option<i32> {
        self.pid
            .filter(|_| self.own_group)
            .map(|pid| pid.as_raw_nonzero().get())
    }

    /// Every live process of the command but its own first one: those
    /// that descend from dlock (the guard left out) or are in the
    /// command's group.
    fn leftovers(&self) -> Vec<i32> {
        let me = i32::try_from(std::process::id()).ok();
        let mut skip: Vec<i32> = self.guard.iter().filter_map(Guard::pid).collect();
        if !self.exited {
            skip.extend(self.pid.map(|pid| pid.as_raw_nonzero().get()));
        }
        tree::leftovers(me, self.group(), &skip)
    }

    /// Sends `signal` to the command's process group (to the command
    /// alone when it shares dlock's group), and to every other process it
    /// started. Gone already is not an error.
    pub(crate) fn signal(&self, signal: Signal) {
        match (self.pid, self.own_group, self.exited) {
            (Some(group), true, _) => {
                let _ = kill_process_group(group, signal);
            }
            (Some(pid), false, false) => {
                let _ = rustix::process::kill_process(pid, signal);
            }
            _ => {}
        }
        tree::signal_each(&self.leftovers(), signal);
    }

    /// Passes on a signal dlock received. In the terminal's foreground
    /// the terminal's own signals (SIGINT, SIGHUP) reached the command
    /// already; only one sent to dlock by name (SIGTERM) is passed on.
    pub(crate) fn forward(&self, signal: Signal) {
        if self.own_group || signal == Signal::TERM {
            self.signal(signal);
        }
    }

    /// Waits for the command's own process to exit.
    async fn wait(&mut self) -> io::Result<ExitStatus> {
        let status = self.process.wait().await;
        self.exited = true;
        if let Some(guard) = &mut self.guard {
            guard.exited();
        }
        status
    }

    /// Reaps the processes that came back to dlock and have exited (the
    /// command's own was reaped by [`Child::wait`]).
    fn reap(&self) {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        for _ in 0..1_000 {
            match rustix::process::wait(rustix::process::WaitOptions::NOHANG) {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
    }

    /// Every process is gone: the guard stops.
    fn finish(&mut self) {
        if let Some(guard) = self.guard.take() {
            guard.done();
        }
    }
}

/// How a supervised command ended.
pub(crate) struct Ended {
    /// Its exit status.
    pub(crate) status: io::Result<ExitStatus>,
    /// Whether what it ran under (the lock, the leadership) was lost, which
    /// stopped it.
    pub(crate) lost: bool,
    /// Whether processes it left behind outlived `--leftovers-timeout`
    /// and were stopped.
    pub(crate) stragglers: bool,
}

/// How long a command's processes may run on and take to stop: the
/// options `run` and `elect` share.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Limits {
    /// How long the command has to exit after SIGTERM (sent when the lock
    /// is lost) before it gets SIGKILL.
    #[arg(long, value_parser = crate::run::duration, default_value = "10s")]
    /// After SIGTERM, before SIGKILL.
    pub(crate) kill_after: Duration,
    /// When the command exits, dlock keeps the lock until every process it
    /// started has exited too (those in the background, and those that
    /// left its process group). With this, those still running this long
    /// after the command exited get SIGTERM, then SIGKILL after
    /// --kill-after, and dlock exits with --leftovers-exit-code. Without
    /// it, dlock waits as long as they run.
    #[arg(long = "leftovers-timeout", value_name = "DURATION", value_parser = crate::run::duration)]
    pub(crate) leftovers: Option<Duration>,
    /// The exit code when processes the command left outlived
    /// --leftovers-timeout.
    #[arg(long, value_name = "CODE", default_value_t = exit::STRAGGLERS)]
    pub(crate) leftovers_exit_code: u8,
}

/// Waits for `child` and every process it started to exit, passing
/// `signals` on to them. If `lost` completes first (the lock or the
/// leadership ended; it says why), they get SIGTERM at once and SIGKILL
/// after `kill_after`. Processes left behind when the command's own
/// process exits keep what it runs under until they exit, or until
/// `limits.leftovers`, when they are stopped the same way.
pub(crate) async fn supervise<R: Display>(
    child: &mut Child,
    signals: &mut Signals,
    lost: impl Future<Output = R>,
    what: &str,
    limits: Limits,
) -> Ended {
    let mut lost = std::pin::pin!(lost);
    let mut was_lost = false;
    let mut stragglers = false;
    let mut kill_at: Option<Instant> = None;
    let mut give_up_at: Option<Instant> = None;
    let mut leftovers_until: Option<Instant> = None;
    let mut status: Option<io::Result<ExitStatus>> = None;
    loop {
        if status.is_some() {
            child.reap();
            if child.leftovers().is_empty() {
                break;
            }
            if give_up_at.is_some_and(|at| Instant::now() >= at) {
                eprintln!("dlock: processes of the command outlived SIGKILL: giving up on them");
                break;
            }
        }
        tokio::select! {
            // The command's exit first: a loss seen after it ended is
            // not a loss of its run.
            biased;
            exited = child.wait(), if status.is_none() => {
                let left = child.leftovers();
                if !left.is_empty() && !was_lost {
                    eprintln!(
                        "dlock: the command exited; {} process(es) it started still run \
                         ({left:?}): keeping {what} until they exit",
                        left.len()
                    );
                    leftovers_until = limits.leftovers.map(|limit| Instant::now() + limit);
                }
                status = Some(exited);
            }
            signal = signals.recv() => child.forward(signal),
            reason = &mut lost, if !was_lost => {
                eprintln!("dlock: {what} was lost ({reason}) while the command ran: stopping it");
                child.signal(Signal::TERM);
                was_lost = true;
                kill_at = Some(Instant::now() + limits.kill_after);
            }
            () = sleep_until(leftovers_until), if leftovers_until.is_some() && kill_at.is_none() => {
                eprintln!("dlock: processes the command left outlived --leftovers-timeout: stopping them");
                child.signal(Signal::TERM);
                stragglers = true;
                leftovers_until = None;
                kill_at = Some(Instant::now() + limits.kill_after);
            }
            () = sleep_until(kill_at), if kill_at.is_some() => {
                eprintln!("dlock: the command outlived --kill-after: killing it");
                child.signal(Signal::KILL);
                kill_at = None;
                give_up_at = Some(Instant::now() + KILL_GRACE);
            }
            () = tokio::time::sleep(POLL), if status.is_some() => {}
        }
    }
    child.finish();
    Ended {
        status: status.unwrap_or_else(|| Err(io::Error::other("no exit status"))),
        lost: was_lost,
        stragglers,
    }
}

/// Whether dlock runs in its terminal's foreground process group.
fn in_terminal_foreground() -> bool {
    let stdin = std::io::stdin();
    rustix::termios::isatty(&stdin)
        && rustix::termios::tcgetpgrp(&stdin).is_ok_and(|group| group == rustix::process::getpgrp())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The code a shell reports for `status`: the exit code, or 128 plus the
/// signal that killed the process.
pub(crate) fn code_of(status: ExitStatus) -> ExitCode {
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX)),
        (None, Some(signal)) => exit::for_signal(signal),
        (None, None) => ExitCode::from(exit::SOFTWARE),
    }
}

/// The signals `dlock` acts on: while it waits they end the wait, and
/// while the command runs they are passed on to it.
pub(crate) struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    /// Starts listening: from now on these signals no longer end `dlock`
    /// by their default action. If it cannot, the exit code, said why.
    pub(crate) fn listen() -> Result<Signals, ExitCode> {
        let listen = || -> io::Result<Signals> {
            Ok(Signals {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
                hangup: signal(SignalKind::hangup())?,
            })
        };
        listen().map_err(|e| {
            eprintln!("dlock: cannot listen for signals: {e}");
            ExitCode::from(exit::SOFTWARE)
        })
    }

    /// The next signal received.
    pub(crate) async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::INT,
            _ = self.terminate.recv() => Signal::TERM,
            _ = self.hangup.recv() => Signal::HUP,
        }
    }
}
