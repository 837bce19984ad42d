//! `dlock release --force | --ask`: frees a key's lock whoever holds it,
//! or asks its holder to let go.

use std::process::ExitCode;

use dlock::LockError;

use crate::{exit, Server};

const RELEASE_HELP: &str = "\
Examples:
  # The report's holder hangs; free its lock:
  dlock release --url redis://10.0.0.5:6379 --force nightly-report

  # A rolling deploy: ask the scheduler's leader to hand over (its dlock elect
  # passes SIGTERM on to the command, which exits when it is ready; another
  # candidate then leads):
  dlock release --url etcd://10.0.0.5:2379/locks --ask --election scheduler

--ask asks the holder to let go (Locker::request_release) and waits until it
has (at most --wait, 30 s): a `dlock run` or `dlock elect` that holds it sends
its command --on-release-request's signal (TERM by default); the holder
decides, and keeps the lock until then. The request stands while this waits.

--force takes the key's exclusive lock from whoever holds it (Locker::force_release),
for an operator clearing a lock whose holder is stuck or gone. The holder
learns at its next renewal: `dlock run` then stops its command as for a lost
lock (exit 76). Its fencing token is still the last one given, so a store
that checks fences still refuses its writes once the next holder has written.

Exit code 0 when the lock was freed (--force) or its holder let go (--ask), 1
when the key was free, 75 when the holder did not let go within --wait; 64 for
bad options, 69 when the server failed or the backend cannot do it, 77 when the
server refused for want of a right.";

/// Free a key's lock whoever holds it, or ask its holder to let go.
#[derive(Debug, clap::Args)]
#[command(after_help = RELEASE_HELP)]
#[command(group(clap::ArgGroup::new("how").required(true).args(["force", "ask"])))]
pub(crate) struct ReleaseArgs {
    #[command(flatten)]
    server: Server,
    /// Take the lock from its holder.
    #[arg(long)]
    force: bool,
    /// Ask its holder to let go, and leave it the lock until it does.
    #[arg(long)]
    ask: bool,
    /// With --ask, KEY names an election (`dlock elect --key`): ask its
    /// leader to step down.
    #[arg(long, requires = "ask")]
    election: bool,
    /// With --ask, how long to wait for the holder to let go (at most
    /// 30 s, as long as a request stands).
    #[arg(long, requires = "ask", value_parser = crate::run::duration, default_value = "30s")]
    wait: std::time::Duration,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// The lock's key.
    #[arg(value_name = "KEY")]
    key: String,
}

pub(crate) async fn release(args: ReleaseArgs) -> ExitCode {
    let locker = match args.server.connect().await {
        Ok(locker) => locker,
        Err(code) => return code,
    };
    if args.force {
        return match locker.force_release(&args.key).await {
            Ok(freed) => said(&args, "freed", freed),
            Err(e) => failed(&e),
        };
    }
    let request = if args.election {
        locker.request_step_down(&args.key).await
    } else {
        locker.request_release(&args.key).await
    };
    let request = match request {
        Ok(Some(request)) => request,
        Ok(None) => return said(&args, "let go", false),
        Err(e) => return failed(&e),
    };
    let wait = args.wait.min(dlock::RELEASE_REQUEST_LIFE);
    let answered = tokio::time::timeout(wait, request.answered()).await;
    // Withdrawn here, not left to a release at exit that the runtime's
    // shutdown may cut short: a standing request would reach the next
    // holder too where it names no grant.
    if let Err(e) = request.withdraw().await {
        say!(
            "dlock: `{}`: the request could not be withdrawn: {e}",
            args.key
        );
    }
    match answered {
        Ok(Ok(())) => said(&args, "let go", true),
        Ok(Err(e)) => failed(&e),
        Err(_) => {
            say!(
                "dlock: `{}`: the holder did not let go within {wait:?}",
                args.key
            );
            ExitCode::from(exit::CONFLICT)
        }
    }
}

/// Says what became of the key (`done`, or that it was free), and exits.
fn said(args: &ReleaseArgs, done: &str, yes: bool) -> ExitCode {
    if args.json {
        out!("{}", serde_json::json!({ "key": args.key, done: yes }));
    } else if yes {
        out!("{}: {done}", args.key);
    } else {
        out!("{}: was free", args.key);
    }
    ExitCode::from(if yes { 0 } else { 1 })
}

fn failed(error: &LockError) -> ExitCode {
    say!("dlock: {error}");
    match error {
        LockError::Unsupported { .. } => ExitCode::from(exit::UNAVAILABLE),
        e => exit::for_error(e),
    }
}
