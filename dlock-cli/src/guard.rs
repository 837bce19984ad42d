//! The guard: a small process beside `dlock` that kills the command if
//! `dlock` dies while it runs (`kill -9`, the OOM killer, a panic), since
//! a lock ends with its holder (a file lock at once, a server lock after
//! its lease) and the command must not run on unlocked.
//!
//! `dlock` keeps the write end of a pipe whose read end is the guard's
//! stdin, and tells it what to watch, line by line:
//!
//! - `watch PID GROUP`: the command's process and its process group (0
//!   when it has none of its own);
//! - `exited`: the command's own process has exited (its PID may be
//!   reused): from now on only its group is killed;
//! - `done`: every process of the command has gone: exit.
//!
//! When the pipe closes without `done` (only the kernel closes it, when
//! `dlock` dies), the guard sends SIGKILL to the group, and to the
//! command's process and every process that descends from it, and exits.

use std::{
    io::Write as _,
    os::{fd::OwnedFd, unix::process::CommandExt as _},
    process::{ExitCode, Stdio},
};

use rustix::process::{kill_process_group, Pid, Signal};
use tokio::io::AsyncBufReadExt as _;

use crate::{child::Signals, exit, tree};

/// `dlock`'s end of a guard.
pub(crate) struct Guard {
    pipe: std::fs::File,
    /// Dropped without waiting: the runtime reaps it.
    process: tokio::process::Child,
}

impl Guard {
    /// Starts a guard (`dlock` itself, run again as `dlock guard`), or
    /// says why it could not.
    pub(crate) fn start() -> Result<Guard, ExitCode> {
        let started = || -> std::io::Result<Guard> {
            let (read, write): (OwnedFd, OwnedFd) =
                rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
            let mut command = std::process::Command::new("/proc/self/exe");
            command
                .arg("guard")
                .stdin(Stdio::from(read))
                .stdout(Stdio::null())
                // A group of its own: a terminal's Ctrl-C, or a signal to
                // dlock's group, does not end it.
                .process_group(0);
            let process = tokio::process::Command::from(command).spawn()?;
            Ok(Guard {
                pipe: write.into(),
                process,
            })
        };
        started().map_err(|e| {
            eprintln!("dlock: cannot start the process that stops the command if dlock dies: {e}");
            ExitCode::from(exit::SOFTWARE)
        })
    }

    /// The guard's process id, which is not the command's.
    pub(crate) fn pid(&self) -> Option<i32> {
        self.process.id().and_then(|id| i32::try_from(id).ok())
    }

    fn say(&mut self, line: &str) {
        // The guard gone (killed by someone) is not the command's fault:
        // dlock still supervises it.
        let _ = self.pipe.write_all(format!("{line}\n").as_bytes());
    }

    /// Watch the command `pid`, and its process `group` if it has one.
    pub(crate) fn watch(&mut self, pid: i32, group: Option<i32>) {
        self.say(&format!("watch {pid} {}", group.unwrap_or(0)));
    }

    /// The command's own process has exited and been reaped.
    pub(crate) fn exited(&mut self) {
        self.say("exited");
    }

    /// Every process of the command is gone: the guard exits.
    pub(crate) fn done(mut self) {
        self.say("done");
    }
}

/// What the guard watches.
#[derive(Debug, Default)]
struct Watched {
    pid: Option<i32>,
    group: Option<i32>,
}

/// `dlock guard`: the guard's side, until `done` or the pipe closes.
pub(crate) async fn guard() -> ExitCode {
    // Signals sent to it by name (systemd's stop, to every process of a
    // unit) leave it running: dlock stops the command itself.
    let mut signals = match Signals::listen() {
        Ok(signals) => signals,
        Err(code) => return code,
    };
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut watched = Watched::default();
    loop {
        let line = tokio::select! {
            line = lines.next_line() => line,
            _ = signals.recv() => continue,
        };
        let Ok(Some(line)) = line else { break };
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("watch"), Some(pid), Some(group)) => {
                watched.pid = pid.parse().ok().filter(|pid| *pid > 0);
                watched.group = group.parse().ok().filter(|group| *group > 0);
            }
            (Some("exited"), ..) => watched.pid = None,
            (Some("done"), ..) => return ExitCode::SUCCESS,
            _ => {}
        }
    }
    if watched.pid.is_none() && watched.group.is_none() {
        return ExitCode::SUCCESS;
    }
    eprintln!("dlock: dlock ended while its command ran: killing the command (SIGKILL)");
    // A few sweeps: a process forked while the last one ran is met by the
    // next.
    for _ in 0..20 {
        if let Some(group) = watched.group.and_then(Pid::from_raw) {
            let _ = kill_process_group(group, Signal::KILL);
        }
        let mut left = Vec::new();
        if let Some(pid) = watched.pid {
            left = tree::leftovers(Some(pid), watched.group, &[]);
            tree::signal_each(&[pid], Signal::KILL);
        } else if let Some(group) = watched.group {
            left = tree::leftovers(None, Some(group), &[]);
        }
        if left.is_empty() {
            break;
        }
        tree::signal_each(&left, Signal::KILL);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    ExitCode::SUCCESS
}
