//! `dlock elect`: campaign, run the command while leader, and campaign
//! again when the leadership is lost (hot standby).

use std::{ffi::OsString, process::ExitCode};

use crate::{
    child::{code_of, supervise, Child, Ended, Limits, Signals},
    exit, run, Server,
};

const ELECT_HELP: &str = "\
Examples:
  # Two machines, one active scheduler; the other takes over within the
  # watchdog lease if the first dies:
  dlock elect --url redis://10.0.0.5:6379 --key scheduler -- ./scheduler
  dlock elect --url etcd://10.0.0.5:2379/locks --key scheduler --watchdog-lease 6s -- ./scheduler

  # Lead once, and exit 76 if the leadership is lost:
  dlock elect --url zk://10.0.0.5:2181/locks --key migrator --once -- ./migrate.sh

The command runs while this candidate leads, with DLOCK_KEY, DLOCK_TERM and
DLOCK_FENCE (the term, a fencing token that grows with every leadership) in
its environment. If the leadership is lost, the command's process group gets
SIGTERM at once and SIGKILL after --kill-after, and dlock campaigns again
(unless --once). When the command exits by itself, dlock resigns and exits
with its code. `dlock status --election --key KEY` shows the leader's --value.

Exit codes: as `dlock run` (the command's own, 76 when the leadership was
lost with --once, 64, 69, 126, 127, 128 + N).";

/// Run a command while elected leader; campaign again after a loss.
#[derive(Debug, clap::Args)]
#[command(after_help = ELECT_HELP)]
pub(crate) struct ElectArgs {
    #[command(flatten)]
    server: Server,
    /// The election's key.
    #[arg(long)]
    key: String,
    /// What this candidate proclaims while it leads (`dlock status` shows
    /// it); by default, HOSTNAME:PID.
    #[arg(long)]
    value: Option<String>,
    /// Lead once: after a lost leadership, exit instead of campaigning
    /// again.
    #[arg(long)]
    once: bool,
    /// The exit code when the leadership is lost with --once.
    #[arg(long, value_name = "CODE", default_value_t = exit::LOST)]
    lost_exit_code: u8,
    #[command(flatten)]
    limits: Limits,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

pub(crate) async fn elect(args: ElectArgs) -> ExitCode {
    let mut signals = match Signals::listen() {
        Ok(signals) => signals,
        Err(code) => return code,
    };
    let key = args.key.as_str();
    let election = tokio::select! {
        election = async {
            let locker = args.server.connect().await?;
            let election = locker.elect(key).map_err(|e| {
                say!("dlock: {e}");
                exit::for_error(&e)
            })?;
            Ok::<_, ExitCode>((locker, election))
        } => election,
        signal = signals.recv() => return exit::for_signal(signal.as_raw()),
    };
    let (_locker, election) = match election {
        Ok(election) => election,
        Err(code) => return code,
    };
    let value = args.value.clone().unwrap_or_else(|| {
        let host = rustix::system::uname();
        format!(
            "{}:{}",
            host.nodename().to_string_lossy(),
            std::process::id()
        )
    });
    loop {
        let leadership = tokio::select! {
            leadership = election.lead() => leadership,
            signal = signals.recv() => {
                let _ = tokio::time::timeout(run::RELEASE_WITHIN, election.resign()).await;
                return exit::for_signal(signal.as_raw());
            }
        };
        let leadership = match leadership {
            Ok(leadership) => leadership,
            Err(e) => {
                say!("dlock: {e}");
                return exit::for_error(&e);
            }
        };
        // Published for `dlock status`; a leadership lost meanwhile
        // (`Ok(false)`) shows in `lost()` below.
        if let Err(e) = election.proclaim(value.as_bytes()).await {
            say!("dlock: proclaiming `{value}`: {e}");
        }
        if !leadership.is_current() {
            // Lost before the command started: campaign again.
            continue;
        }
        let term = leadership.term().to_string();
        let env = [
            ("DLOCK_KEY", key.to_owned()),
            ("DLOCK_TERM", term.clone()),
            ("DLOCK_FENCE", term),
        ];
        let mut child = match Child::spawn(&args.command, &env).await {
            Ok(child) => child,
            Err(code) => {
                let _ = tokio::time::timeout(run::RELEASE_WITHIN, election.resign()).await;
                return code;
            }
        };
        let lost = async {
            leadership
                .lost()
                .await
                .map_or_else(|| "resigned".to_owned(), |reason| reason.to_string())
        };
        let what = format!("the leadership of `{key}`");
        let asked = || leadership.release_requested();
        match supervise(&mut child, &mut signals, lost, asked, &what, args.limits).await {
            Ended { lost: true, .. } if args.once => return ExitCode::from(args.lost_exit_code),
            Ended { lost: true, .. } => {
                say!("dlock: campaigning again for `{key}`");
            }
            Ended {
                stragglers: true, ..
            } => {
                let _ = tokio::time::timeout(run::RELEASE_WITHIN, election.resign()).await;
                return ExitCode::from(args.limits.leftovers_exit_code);
            }
            Ended { status, .. } => {
                let _ = tokio::time::timeout(run::RELEASE_WITHIN, election.resign()).await;
                return match status {
                    Ok(status) => code_of(status),
                    Err(e) => {
                        say!("dlock: lost track of the command: {e}");
                        ExitCode::from(exit::SOFTWARE)
                    }
                };
            }
        }
    }
}
