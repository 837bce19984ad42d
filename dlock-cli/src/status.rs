//! `dlock status`: who holds a key, as the server sees it.

use std::process::ExitCode;

use dlock::{LockError, LockKey};

use crate::{exit, Server};

const STATUS_HELP: &str = "\
Examples:
  dlock status --url redis://10.0.0.5:6379 --key nightly-report
  dlock status --url etcd://10.0.0.5:2379/locks --key scheduler --election --json

Shows whether the key's exclusive lock is held, or with --election who leads
the election `dlock elect --key` runs, with the holder's fencing token (the
leader's term) and proclaimed value where the backend records them.
Exit code 0 when held, 1 when free; 64 for bad options, 69 when the server
failed or the backend cannot tell.";

/// Show whether a key is held, by whom.
#[derive(Debug, clap::Args)]
#[command(after_help = STATUS_HELP)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    server: Server,
    /// The lock's key.
    #[arg(long)]
    key: String,
    /// The key names an election (`dlock elect --key`), not a lock.
    #[arg(long)]
    election: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn status(args: StatusArgs) -> ExitCode {
    let key = match LockKey::new(&args.key) {
        Ok(key) => key,
        Err(e) => {
            say!("dlock: {e}");
            return exit::for_error(&e);
        }
    };
    let locker = match args.server.connect().await {
        Ok(locker) => locker,
        Err(code) => return code,
    };
    let holder = if args.election {
        locker.leader(&args.key).await.map(|leader| {
            leader.map(|leader| dlock::backend::Holder::new(Some(leader.term), leader.value))
        })
    } else {
        locker.backend().holder(&key).await
    };
    let holder = match holder {
        Ok(holder) => holder,
        Err(e @ LockError::Unsupported { .. }) => {
            say!("dlock: {e}: this backend cannot tell who holds a key");
            return ExitCode::from(exit::UNAVAILABLE);
        }
        Err(e) => {
            say!("dlock: {e}");
            return exit::for_error(&e);
        }
    };
    let value = holder
        .as_ref()
        .and_then(|h| h.value())
        .map(|v| String::from_utf8_lossy(v).into_owned());
    let fence = holder.as_ref().and_then(|h| h.fence());
    if args.json {
        let report = serde_json::json!({
            "key": args.key,
            "held": holder.is_some(),
            "fence": fence,
            "value": value,
        });
        out!("{report}");
    } else if holder.is_some() {
        out!("{}: held", args.key);
        if let Some(fence) = fence {
            out!("  fence: {fence}");
        }
        if let Some(value) = &value {
            out!("  value: {value}");
        }
    } else {
        out!("{}: free", args.key);
    }
    ExitCode::from(if holder.is_some() { 0 } else { 1 })
}
