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

--ask asks the holder to let go (Locker::request_release): a `dlock run` or
`dlock elect` that holds it sends its command --on-release-request's signal
(TERM by default); the holder decides, and keeps the lock until then. The
request stands for 30 s.

--force takes the key's exclusive lock from whoever holds it (Locker::force_release),
for an operator clearing a lock whose holder is stuck or gone. The holder
learns at its next renewal: `dlock run` then stops its command as for a lost
lock (exit 76). Its fencing token is still the last one given, so a store
that checks fences still refuses its writes once the next holder has written.

Exit code 0 when a lock was freed (or its holder asked), 1 when the key was
free; 64 for bad options, 69 when the server failed or the backend cannot do
it, 77 when the server refused for want of a right.";

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
    let done = if args.force {
        locker.force_release(&args.key).await
    } else if args.election {
        locker.request_step_down(&args.key).await
    } else {
        locker.request_release(&args.key).await
    };
    let freed = match done {
        Ok(freed) => freed,
        Err(e @ LockError::Unsupported { .. }) => {
            say!("dlock: {e}");
            return ExitCode::from(exit::UNAVAILABLE);
        }
        Err(e) => {
            say!("dlock: {e}");
            return exit::for_error(&e);
        }
    };
    let done = if args.force { "freed" } else { "asked" };
    if args.json {
        out!("{}", serde_json::json!({ "key": args.key, done: freed }));
    } else if freed {
        out!("{}: {done}", args.key);
    } else {
        out!("{}: was free", args.key);
    }
    ExitCode::from(if freed { 0 } else { 1 })
}
