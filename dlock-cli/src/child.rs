//! The command `dlock` runs, below a [guard](crate::guard): started in a
//! process group of its own, so that a signal reaches it and everything
//! it started, and stopped with SIGTERM, then SIGKILL.
//!
//! The lock covers every process the command starts, not only its first:
//! the guard is their subreaper (Linux), so no process leaves it, and it
//! says when the last has exited; dlock releases only then. If dlock
//! itself dies, the guard kills them all.

use std::{ffi::OsString, fmt::Display, future::Future, io, process::ExitCode, time::Duration};

use rustix::process::Signal;
use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines},
    net::unix::{OwnedReadHalf, OwnedWriteHalf},
    signal::unix::{signal, SignalKind},
    time::Instant,
};

use crate::{exit, guard, tree};

/// A running command, below its guard.
pub(crate) struct Child {
    /// The guard; the runtime reaps it.
    _guard: tokio::process::Child,
    events: Lines<BufReader<OwnedReadHalf>>,
    control: OwnedWriteHalf,
    /// Whether the command leads a process group of its own.
    own_group: bool,
}

/// How a command's own process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// It exited with this code.
    Code(i32),
    /// This signal killed it.
    Signal(i32),
}

/// What the guard said.
enum Event {
    Exited(Status),
    Left(String),
    Gone,
    /// The guard ended without saying `gone` (killed by someone).
    GuardLost,
}

/// The variables dlock sets for the command: never inherited from dlock's
/// own environment (a `dlock run` inside another must not pass the outer
/// lock's fence on as its own).
const OURS: [&str; 3] = ["DLOCK_KEY", "DLOCK_FENCE", "DLOCK_TERM"];

impl Child {
    /// Starts `command` (the program, then its arguments) below a guard,
    /// with `env` added to dlock's environment; or the exit code and
    /// message for why not (127 when the program is not found, 126 when it
    /// cannot be run).
    ///
    /// The command gets a process group of its own, so that a signal
    /// reaches everything it started; except when dlock runs in a
    /// terminal's foreground (an interactive `dlock run -- psql`): a
    /// command outside the foreground group would be stopped the moment
    /// it reads the terminal, so there it stays in dlock's group, the
    /// terminal's own signals reach it directly, and dlock passes on only
    /// what the terminal does not send (a SIGTERM sent to dlock by name,
    /// and anything to processes that left the group).
    pub(crate) async fn spawn(
        command: &[OsString],
        env: &[(&str, String)],
    ) -> Result<Child, ExitCode> {
        if command.is_empty() {
            say!("dlock: no command given");
            return Err(ExitCode::from(exit::USAGE));
        }
        // If the guard dies, what it had is given to dlock.
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            say!("dlock: cannot follow the processes the command starts: {e}");
            return Err(ExitCode::from(exit::SOFTWARE));
        }
        let own_group = !in_terminal_foreground();
        let (process, control) = guard::spawn(command, env, &OURS, own_group).map_err(|e| {
            say!("dlock: cannot start the command's guard: {e}");
            ExitCode::from(exit::SOFTWARE)
        })?;
        let (reader, writer) = control.into_split();
        let mut child = Child {
            _guard: process,
            events: BufReader::new(reader).lines(),
            control: writer,
            own_group,
        };
        match child.events.next_line().await {
            Ok(Some(line)) if line.starts_with("started ") => Ok(child),
            Ok(Some(line)) => {
                let code = line
                    .strip_prefix("failed ")
                    .and_then(|code| code.parse().ok())
                    .unwrap_or(exit::SOFTWARE);
                Err(ExitCode::from(code))
            }
            _ => {
                say!("dlock: the command's guard ended before the command started");
                Err(ExitCode::from(exit::SOFTWARE))
            }
        }
    }

    /// Sends `signal` to every process of the command.
    pub(crate) async fn signal(&mut self, signal: Signal) {
        self.tell(signal, true).await;
    }

    /// Passes on a signal dlock received. In the terminal's foreground
    /// the terminal's own signals (SIGINT, SIGHUP) reached the command's
    /// group already: they go only to processes that left it. One sent to
    /// dlock by name (SIGTERM) goes to all.
    pub(crate) async fn forward(&mut self, signal: Signal) {
        let all = self.own_group || signal == Signal::TERM;
        self.tell(signal, all).await;
    }

    async fn tell(&mut self, signal: Signal, all: bool) {
        let scope = if all { "all" } else { "outside" };
        let line = format!("signal {} {scope}\n", signal.as_raw());
        // A guard gone is seen as such by `event`.
        let _ = self.control.write_all(line.as_bytes()).await;
    }

    /// The guard's next word.
    async fn event(&mut self) -> Event {
        let Ok(Some(line)) = self.events.next_line().await else {
            return Event::GuardLost;
        };
        let mut words = line.splitn(3, ' ');
        match (words.next(), words.next(), words.next()) {
            (Some("exited"), Some("code"), Some(n)) => {
                Event::Exited(Status::Code(n.parse().unwrap_or(exit::SOFTWARE.into())))
            }
            (Some("exited"), Some("signal"), Some(n)) => {
                Event::Exited(Status::Signal(n.parse().unwrap_or(0)))
            }
            (Some("left"), Some(first), rest) => Event::Left(
                format!("{first} {}", rest.unwrap_or_default())
                    .trim()
                    .to_owned(),
            ),
            (Some("gone"), ..) => Event::Gone,
            _ => Event::GuardLost,
        }
    }
}

/// The guard died with processes of the command perhaps still running:
/// they were given to dlock (their subreaper too); kill them.
fn kill_orphans() {
    let me = i32::try_from(std::process::id()).ok();
    for _ in 0..100 {
        let left = tree::leftovers(me, None, &[]);
        if left.is_empty() {
            return;
        }
        tree::signal_each(&left, Signal::KILL);
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How a supervised command ended.
pub(crate) struct Ended {
    /// How its own process ended.
    pub(crate) status: io::Result<Status>,
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
    /// The signal the command gets when someone asks this holder (or
    /// leader) to let go (`dlock release --ask`, a deploy tool): TERM,
    /// INT, HUP, QUIT, USR1, USR2, or `none` to ignore requests. The
    /// command decides; the lock is released when it has exited, and dlock
    /// exits with its code (`dlock elect` too, rather than campaign again;
    /// a command that does not trap TERM exits 143). On PostgreSQL, MySQL
    /// and files, listening reads the request key twice a second; `none`
    /// spares that.
    #[arg(long, value_name = "SIGNAL", value_parser = on_request, default_value = "TERM")]
    pub(crate) on_release_request: OnRequest,
}

/// What `--on-release-request` sends: a signal, or nothing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OnRequest(Option<Signal>);

fn on_request(text: &str) -> Result<OnRequest, String> {
    let name = text.to_ascii_uppercase();
    Ok(OnRequest(Some(
        match name.strip_prefix("SIG").unwrap_or(&name) {
            "NONE" => return Ok(OnRequest(None)),
            "TERM" => Signal::TERM,
            "INT" => Signal::INT,
            "HUP" => Signal::HUP,
            "QUIT" => Signal::QUIT,
            "USR1" => Signal::USR1,
            "USR2" => Signal::USR2,
            _ => return Err("expected TERM, INT, HUP, QUIT, USR1, USR2 or none".to_owned()),
        },
    )))
}

/// Waits until the command and every process it started have exited,
/// passing `signals` on to them. If `lost` completes first (the lock or
/// the leadership ended; it says why), they get SIGTERM at once and
/// SIGKILL after `kill_after`. Processes left behind when the command's
/// own process exits keep what it runs under until they exit, or until
/// `limits.leftovers`, when they are stopped the same way. A process that
/// SIGKILL does not end (stuck in the kernel) is waited for still: the
/// lock outlives no process of the command. When `asked` completes (a
/// request to let go), the command gets `--on-release-request`'s signal.
pub(crate) async fn supervise<'a, R: Display, F>(
    child: &mut Child,
    signals: &mut Signals,
    lost: impl Future<Output = R>,
    asked: impl Fn() -> F,
    what: &str,
    limits: Limits,
) -> Ended
where
    F: Future<Output = dlock::Result<()>> + 'a,
{
    let mut lost = std::pin::pin!(lost);
    // Listening for a request to let go, unless told not to; after an
    // error, again a second later.
    let listen = || Some(Box::pin(asked()));
    let mut listening = limits.on_release_request.0.and_then(|_| listen());
    let mut listen_again: Option<Instant> = None;
    let mut was_lost = false;
    let mut stragglers = false;
    let mut kill_at: Option<Instant> = None;
    let mut leftovers_until: Option<Instant> = None;
    let mut status: Option<Status> = None;
    let ended = loop {
        tokio::select! {
            // The command's exit first: a loss seen after it ended is
            // not a loss of its run.
            biased;
            event = child.event() => match event {
                Event::Exited(exited) => status = Some(exited),
                Event::Left(pids) => {
                    if !was_lost {
                        say!(
                            "dlock: the command exited; processes it started still run \
                             ({pids}): keeping {what} until they exit"
                        );
                        leftovers_until = limits.leftovers.map(|limit| Instant::now() + limit);
                    }
                }
                Event::Gone => break Ok(()),
                Event::GuardLost => {
                    say!("dlock: the command's guard ended: killing what it ran");
                    kill_orphans();
                    break Err(io::Error::other("the command's guard ended"));
                }
            },
            signal = signals.recv() => child.forward(signal).await,
            heard = async { listening.as_mut().expect("listening").await }, if listening.is_some() => {
                listening = None;
                match (heard, limits.on_release_request.0) {
                    (Ok(()), Some(signal)) => {
                        say!("dlock: asked to let go of {what}: passing it on to the command");
                        child.signal(signal).await;
                    }
                    (Ok(()), None)
                    | (Err(dlock::LockError::Unsupported { .. } | dlock::LockError::InvalidKey { .. }), _) => {}
                    (Err(e), _) => {
                        say!("dlock: listening for release requests: {e}; again in a second");
                        listen_again = Some(Instant::now() + Duration::from_secs(1));
                    }
                }
            }
            () = sleep_until(listen_again), if listen_again.is_some() => {
                listen_again = None;
                listening = listen();
            }
            reason = &mut lost, if !was_lost => {
                say!("dlock: {what} was lost ({reason}) while the command ran: stopping it");
                child.signal(Signal::TERM).await;
                was_lost = true;
                kill_at = Some(Instant::now() + limits.kill_after);
            }
            () = sleep_until(leftovers_until), if leftovers_until.is_some() && kill_at.is_none() => {
                say!("dlock: processes the command left outlived --leftovers-timeout: stopping them");
                child.signal(Signal::TERM).await;
                stragglers = true;
                leftovers_until = None;
                kill_at = Some(Instant::now() + limits.kill_after);
            }
            () = sleep_until(kill_at), if kill_at.is_some() => {
                say!("dlock: the command outlived --kill-after: killing it");
                child.signal(Signal::KILL).await;
                kill_at = None;
            }
        }
    };
    Ended {
        status: ended.and_then(|()| status.ok_or_else(|| io::Error::other("no exit status"))),
        lost: was_lost,
        stragglers,
    }
}

/// Whether dlock runs in its terminal's foreground process group.
/// Its controlling terminal, not only stdin: a command whose stdin is a
/// pipe may still read the terminal (a password prompt), and outside the
/// foreground group it would be stopped there for good.
fn in_terminal_foreground() -> bool {
    let foreground = |fd: std::os::fd::BorrowedFd<'_>| {
        rustix::termios::isatty(fd)
            && rustix::termios::tcgetpgrp(fd).is_ok_and(|group| group == rustix::process::getpgrp())
    };
    use std::os::fd::AsFd as _;
    foreground(std::io::stdin().as_fd())
        || std::fs::File::open("/dev/tty").is_ok_and(|tty| foreground(tty.as_fd()))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The code a shell reports for `status`: the exit code, or 128 plus the
/// signal that killed the process.
pub(crate) fn code_of(status: Status) -> ExitCode {
    match status {
        Status::Code(code) => ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX)),
        Status::Signal(signal) => exit::for_signal(signal),
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
            say!("dlock: cannot listen for signals: {e}");
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
