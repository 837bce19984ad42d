//! The command `dlock` runs: started in a process group of its own, so
//! that a signal reaches it and everything it started, and stopped with
//! SIGTERM, then SIGKILL.

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

use crate::exit;

/// A running command: the leader of its own process group, unless it runs
/// in the terminal's foreground (see [`Child::spawn`]).
pub(crate) struct Child {
    process: tokio::process::Child,
    pid: Option<Pid>,
    /// Whether the command leads a process group of its own.
    own_group: bool,
}

/// The variables dlock sets for the command: never inherited from dlock's
/// own environment (a `dlock run` inside another must not pass the outer
/// lock's fence on as its own).
const OURS: [&str; 3] = ["DLOCK_KEY", "DLOCK_FENCE", "DLOCK_TERM"];

impl Child {
    /// Starts `command` (the program, then its arguments) with `env` added
    /// to dlock's environment; or the exit code and message for why not
    /// (127 when the program is not found, 126 when it cannot be run).
    ///
    /// The command gets a process group of its own, so that a signal
    /// reaches everything it started; except when dlock runs in a
    /// terminal's foreground (an interactive `dlock run -- psql`): a
    /// command outside the foreground group would be stopped the moment
    /// it reads the terminal, so there it stays in dlock's group, the
    /// terminal's own signals reach it directly, and dlock signals it
    /// alone.
    pub(crate) fn spawn(command: &[OsString], env: &[(&str, String)]) -> Result<Child, ExitCode> {
        let Some((program, args)) = command.split_first() else {
            eprintln!("dlock: no command given");
            return Err(ExitCode::from(exit::USAGE));
        };
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
                Ok(Child {
                    process,
                    pid,
                    own_group,
                })
            }
            Err(e) => {
                eprintln!("dlock: cannot run {}: {e}", program.to_string_lossy());
                Err(ExitCode::from(match e.kind() {
                    io::ErrorKind::NotFound => exit::NOT_FOUND,
                    _ => exit::CANNOT_RUN,
                }))
            }
        }
    }

    /// Sends `signal` to the command's process group (to the command
    /// alone when it shares dlock's group). Gone already is not an error.
    pub(crate) fn signal(&self, signal: Signal) {
        match (self.pid, self.own_group) {
            (Some(group), true) => {
                let _ = kill_process_group(group, signal);
            }
            (Some(pid), false) => {
                let _ = rustix::process::kill_process(pid, signal);
            }
            (None, _) => {}
        }
    }

    /// Passes on a signal dlock received. In the terminal's foreground
    /// the terminal's own signals (SIGINT, SIGHUP) reached the command
    /// already; only one sent to dlock by name (SIGTERM) is passed on.
    pub(crate) fn forward(&self, signal: Signal) {
        if self.own_group || signal == Signal::TERM {
            self.signal(signal);
        }
    }

    /// Whether any process of the command's own group still runs. A
    /// zombie does not count: a container's init may never reap an
    /// orphan, and it runs nothing.
    fn group_lives(&self) -> bool {
        let (Some(group), true) = (self.pid, self.own_group) else {
            return false;
        };
        if rustix::process::test_kill_process_group(group).is_err() {
            return false;
        }
        // Linux tells each process's group and state in /proc; elsewhere,
        // whatever is in the group counts.
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return true;
        };
        entries.flatten().any(|entry| {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                return false;
            };
            // `pid (comm) state ppid pgrp …`: comm may hold anything but `)`
            // ends it.
            let mut fields = stat
                .rsplit_once(')')
                .map_or("", |(_, rest)| rest)
                .split_whitespace();
            let state = fields.next();
            let pgrp = fields.nth(1).and_then(|g| g.parse::<i32>().ok());
            pgrp == Some(group.as_raw_nonzero().get()) && state != Some("Z")
        })
    }

    /// Waits for the command to exit.
    pub(crate) async fn wait(&mut self) -> io::Result<ExitStatus> {
        self.process.wait().await
    }
}

/// How a supervised command ended.
pub(crate) struct Ended {
    /// Its exit status.
    pub(crate) status: io::Result<ExitStatus>,
    /// Whether what it ran under (the lock, the leadership) was lost, which
    /// stopped it.
    pub(crate) lost: bool,
}

/// Waits for `child` to exit, passing `signals` on to it. If `lost`
/// completes first (the lock or the leadership ended; it says why), the
/// child's group gets SIGTERM at once and SIGKILL after `kill_after`.
pub(crate) async fn supervise<R: Display>(
    child: &mut Child,
    signals: &mut Signals,
    lost: impl Future<Output = R>,
    what: &str,
    kill_after: Duration,
) -> Ended {
    let mut lost = std::pin::pin!(lost);
    let mut was_lost = false;
    let mut kill_at: Option<Instant> = None;
    let status = loop {
        tokio::select! {
            // The command's exit first: a loss seen after it ended is
            // not a loss of its run.
            biased;
            status = child.wait() => break status,
            signal = signals.recv() => child.forward(signal),
            reason = &mut lost, if !was_lost => {
                eprintln!("dlock: {what} was lost ({reason}) while the command ran: stopping it");
                child.signal(Signal::TERM);
                was_lost = true;
                kill_at = Some(Instant::now() + kill_after);
            }
            () = sleep_until(kill_at), if kill_at.is_some() => {
                eprintln!("dlock: the command outlived --kill-after: killing it");
                child.signal(Signal::KILL);
                kill_at = None;
            }
        }
    };
    // Stopped for a loss: what the command started and left behind (a
    // child that ignores SIGTERM) still gets SIGKILL at the deadline.
    if let Some(at) = kill_at {
        while child.group_lives() {
            if tokio::time::Instant::now() >= at {
                child.signal(Signal::KILL);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    Ended {
        status,
        lost: was_lost,
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
