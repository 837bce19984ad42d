//! The guard: `dlock` run again as `dlock guard`, the command's parent.
//!
//! ```text
//! dlock (holds the lock)
//!  └─ dlock guard (the subreaper of everything below it)
//!      └─ the command, and whatever it starts
//! ```
//!
//! Every process the command starts stays below the guard, whatever it
//! does (a background job, `setsid`, a double fork): a process whose
//! parent exits is given to the guard, its subreaper (Linux). So the guard
//! knows exactly when the last of them has exited (`wait` says it has no
//! children left), and whom to signal; and if `dlock` dies (`kill -9`, the
//! OOM killer) while any of them runs, the guard, told by the end of its
//! control socket, kills them all with SIGKILL before it exits, since the
//! lock ends with `dlock`.
//!
//! The control socket carries lines. From the guard: `started PID`,
//! `failed CODE` (the command could not be run), `exited code N` or
//! `exited signal N` (the command's own process), `left PID…` (what it
//! left running then), `gone` (nothing runs any more). From `dlock`:
//! `signal N all` (to every process below the guard) or `signal N
//! outside` (to those outside the guard's own process group, which a
//! terminal signals itself).

use std::{
    ffi::OsString,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::process::{CommandExt as _, ExitStatusExt as _},
    },
    process::ExitCode,
    time::Duration,
};

use rustix::process::{Pid, Signal};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::{unix::OwnedWriteHalf, UnixStream},
    signal::unix::{signal, SignalKind},
};

use crate::{child::Signals, exit, tree};

/// `dlock guard` (started by `dlock run` and `dlock elect`, not by hand).
#[derive(Debug, clap::Args)]
pub(crate) struct GuardArgs {
    /// The control socket's descriptor, inherited from dlock.
    #[arg(long)]
    control_fd: i32,
    /// Start the command in a process group of its own.
    #[arg(long)]
    own_group: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

/// How often the guard looks whether what the command left has exited.
const POLL: Duration = Duration::from_millis(20);

/// Runs the command below the guard until every process of it is gone,
/// or kills them all if dlock goes first.
pub(crate) async fn guard(args: GuardArgs) -> ExitCode {
    // SAFETY: dlock passes the descriptor of its socketpair's other end
    // for this alone, and nothing else in this process knows it; checked
    // to be open first, and owned from here on.
    if rustix::io::fcntl_getfd(unsafe { std::os::fd::BorrowedFd::borrow_raw(args.control_fd) })
        .is_err()
    {
        return ExitCode::from(exit::SOFTWARE);
    }
    let control = unsafe { OwnedFd::from_raw_fd(args.control_fd) };
    match run(args, control).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(exit::SOFTWARE),
    }
}

async fn run(args: GuardArgs, control: OwnedFd) -> io::Result<()> {
    // The command must not inherit it.
    rustix::io::fcntl_setfd(&control, rustix::io::FdFlags::CLOEXEC)?;
    let control = std::os::unix::net::UnixStream::from(control);
    control.set_nonblocking(true)?;
    let (reader, mut writer) = UnixStream::from_std(control)?.into_split();
    let mut lines = BufReader::new(reader).lines();
    // Signals sent to it by name or by group (systemd's stop, a terminal's
    // Ctrl-C) leave it running: dlock passes on what the command should
    // get, and the command gets its own from the same source.
    let mut ignored = Signals::listen().map_err(|_| io::Error::other("signals"))?;
    let mut children = signal(SignalKind::child())?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
    let me = i32::try_from(std::process::id()).ok();
    let Some((program, rest)) = args.command.split_first() else {
        return send(&mut writer, &format!("failed {}", exit::USAGE)).await;
    };
    let mut command = std::process::Command::new(program);
    command.args(rest);
    if args.own_group {
        command.process_group(0);
    }
    let mut child = match tokio::process::Command::from(command).spawn() {
        Ok(child) => child,
        Err(e) => {
            say!("dlock: cannot run {}: {e}", program.to_string_lossy());
            let code = match e.kind() {
                io::ErrorKind::NotFound => exit::NOT_FOUND,
                _ => exit::CANNOT_RUN,
            };
            return send(&mut writer, &format!("failed {code}")).await;
        }
    };
    let pid = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .unwrap_or_default();
    // Its group, while its id cannot be another's: until the command is
    // reaped (its pid, which is the group's id, is ours till then).
    let mut group = args.own_group.then_some(pid);
    send(&mut writer, &format!("started {pid}")).await?;
    let mut exited = false;
    loop {
        tokio::select! {
            line = lines.next_line() => match line {
                Ok(Some(line)) => {
                    if let Some((signal, all)) = parse_signal(&line) {
                        pass_on(me, group, signal, all);
                    }
                }
                // dlock is gone: so is the lock.
                Ok(None) | Err(_) => {
                    kill_all(me, group).await;
                    return Ok(());
                }
            },
            status = child.wait(), if !exited => {
                exited = true;
                group = None;
                let status = status?;
                let line = match (status.code(), status.signal()) {
                    (Some(code), _) => format!("exited code {code}"),
                    (None, Some(signal)) => format!("exited signal {signal}"),
                    (None, None) => format!("exited code {}", exit::SOFTWARE),
                };
                send(&mut writer, &line).await?;
                let left = tree::leftovers(me, None, &[]);
                if !left.is_empty() {
                    let pids: Vec<String> = left.iter().map(i32::to_string).collect();
                    send(&mut writer, &format!("left {}", pids.join(" "))).await?;
                }
            }
            _ = children.recv() => {}
            _ = ignored.recv() => {}
            () = tokio::time::sleep(POLL), if exited => {}
        }
        if exited {
            if reap_all() {
                return send(&mut writer, "gone").await;
            }
        } else {
            reap_others(me, pid);
        }
    }
}

async fn send(writer: &mut OwnedWriteHalf, line: &str) -> io::Result<()> {
    writer.write_all(format!("{line}\n").as_bytes()).await
}

/// `signal N all` or `signal N outside`.
fn parse_signal(line: &str) -> Option<(Signal, bool)> {
    let mut words = line.split_whitespace();
    if words.next()? != "signal" {
        return None;
    }
    let signal = Signal::from_named_raw(words.next()?.parse().ok()?)?;
    let all = words.next()? == "all";
    Some((signal, all))
}

/// Sends `signal` to the command's group (while it has one) and to every
/// process below the guard outside it, once each; with `all` false, only
/// to those outside the guard's own group (the terminal's, which got it).
/// A stopped process gets SIGCONT after a SIGTERM or SIGHUP, so that it
/// can act on it.
fn pass_on(me: Option<i32>, group: Option<i32>, signal: Signal, all: bool) {
    let own = rustix::process::getpgrp().as_raw_nonzero().get();
    let mut targets: Vec<Pid> = Vec::new();
    if all {
        if let Some(group) = group.and_then(Pid::from_raw) {
            let _ = rustix::process::kill_process_group(group, signal);
        }
    }
    for (pid, pgrp) in tree::below(me) {
        let skip = (all && Some(pgrp) == group) || (!all && pgrp == own);
        if let (false, Some(pid)) = (skip, Pid::from_raw(pid)) {
            let _ = rustix::process::kill_process(pid, signal);
            targets.push(pid);
        }
    }
    if matches!(signal, Signal::TERM | Signal::HUP) {
        if all {
            if let Some(group) = group.and_then(Pid::from_raw) {
                let _ = rustix::process::kill_process_group(group, Signal::CONT);
            }
        }
        for pid in targets {
            let _ = rustix::process::kill_process(pid, Signal::CONT);
        }
    }
}

/// SIGKILL to every process below the guard, in sweeps (one forked while
/// a sweep ran is met by the next), reaping them, until none is left or
/// a bounded number of sweeps.
async fn kill_all(me: Option<i32>, group: Option<i32>) {
    say!("dlock: dlock ended while its command ran: killing the command (SIGKILL)");
    if let Some(group) = group.and_then(Pid::from_raw) {
        let _ = rustix::process::kill_process_group(group, Signal::KILL);
    }
    for _ in 0..500 {
        for (pid, _) in tree::below(me) {
            if let Some(pid) = Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
            }
        }
        if reap_all() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reaps every child that has exited; whether none is left.
fn reap_all() -> bool {
    for _ in 0..10_000 {
        match rustix::process::wait(rustix::process::WaitOptions::NOHANG) {
            Ok(Some(_)) => {}
            Ok(None) => return false,
            Err(_) => return true,
        }
    }
    false
}

/// Reaps the exited children other than the command (whose status the
/// runtime collects): processes given to the guard while the command runs.
fn reap_others(me: Option<i32>, command: i32) {
    for pid in tree::zombie_children(me) {
        if pid != command {
            let _ =
                rustix::process::waitpid(Pid::from_raw(pid), rustix::process::WaitOptions::NOHANG);
        }
    }
}

/// Starts the guard with the command, for [`crate::child::Child`]: the
/// guard process and dlock's end of the control socket.
pub(crate) fn spawn(
    command: &[OsString],
    env: &[(&str, String)],
    remove: &[&str],
    own_group: bool,
) -> io::Result<(tokio::process::Child, UnixStream)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let (ours, theirs) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // Inherited by the guard alone: nothing else is started meanwhile.
    rustix::io::fcntl_setfd(&theirs, rustix::io::FdFlags::empty())?;
    let mut builder = std::process::Command::new("/proc/self/exe");
    builder
        .arg("guard")
        .arg("--control-fd")
        .arg(theirs.as_raw_fd().to_string());
    if own_group {
        builder.arg("--own-group");
    }
    builder.arg("--").args(command);
    for name in remove {
        builder.env_remove(name);
    }
    for (name, value) in env {
        builder.env(name, value);
    }
    let spawned = tokio::process::Command::from(builder).spawn();
    drop(theirs);
    let process = spawned?;
    let ours = std::os::unix::net::UnixStream::from(ours);
    ours.set_nonblocking(true)?;
    Ok((process, UnixStream::from_std(ours)?))
}
