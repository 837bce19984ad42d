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

/// A running command, the leader of its own process group.
pub(crate) struct Child {
    process: tokio::process::Child,
    group: Option<Pid>,
}

impl Child {
    /// Starts `command` (the program, then its arguments) with `env` added
    /// to dlock's environment; or the exit code and message for why not
    /// (127 when the program is not found, 126 when it cannot be run).
    pub(crate) fn spawn(command: &[OsString], env: &[(&str, String)]) -> Result<Child, ExitCode> {
        let Some((program, args)) = command.split_first() else {
            eprintln!("dlock: no command given");
            return Err(ExitCode::from(exit::USAGE));
        };
        let mut builder = std::process::Command::new(program);
        builder.args(args).process_group(0);
        for (name, value) in env {
            builder.env(name, value);
        }
        match tokio::process::Command::from(builder).spawn() {
            Ok(process) => {
                let group = process
                    .id()
                    .and_then(|id| i32::try_from(id).ok())
                    .and_then(Pid::from_raw);
                Ok(Child { process, group })
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

    /// Sends `signal` to the command's process group. A group already gone
    /// is not an error.
    pub(crate) fn signal(&self, signal: Signal) {
        if let Some(group) = self.group {
            let _ = kill_process_group(group, signal);
        }
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
    loop {
        tokio::select! {
            status = child.wait() => return Ended { status, lost: was_lost },
            signal = signals.recv() => child.signal(signal),
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
    }
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
    /// by their default action.
    pub(crate) fn listen() -> io::Result<Signals> {
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
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
