//! `dlock status`: who holds a key, as the server sees it.

use std::process::ExitCode;

use dlock::{LockError, LockKey};

use crate::{exit, Server};

const STATUS_HELP: &str = "\
Examples:
  dlock status --url redis://10.0.0.5:6379 --key nightly-report
  dlock status --url etcd://10.0.0.5:2379/locks --key scheduler --election --json

Shows whether the key's exclusive lock is held, or with --election who leads
the election `dlock elect --key` runs, with the holder's mode, note
(HOSTNAME:PID unless it set another), fencing token (the leader's term),
proclaimed value, age and lease left where the backend records them.
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
    // An election is its lock's holder, under `election:{name}` (see
    // `Locker::elect`): read whole, with its note, mode and age.
    let key = if args.election {
        match LockKey::new(format!("election:{}", args.key)) {
            Ok(key) => key,
            Err(e) => {
                say!("dlock: {e}");
                return exit::for_error(&e);
            }
        }
    } else {
        key
    };
    let holder = locker.backend().holder(&key).await;
    let holder = match holder {
        // A holder without a term leads nobody (as `Locker::leader`).
        Ok(holder) => holder.filter(|h| !args.election || h.fence().is_some()),
        Err(e @ LockError::Unsupported { .. }) => {
            say!("dlock: {e}: this backend cannot tell who holds a key");
            return ExitCode::from(exit::UNAVAILABLE);
        }
        Err(e) => {
            say!("dlock: {e}");
            return exit::for_error(&e);
        }
    };
    if args.json {
        let mut report = serde_json::json!({
            "key": args.key,
            "held": holder.is_some(),
        });
        // Every field of a holder, `null` when the key is free.
        let none = dlock::backend::Holder::new(None, None);
        let shown = crate::list::holder_json(holder.as_ref().unwrap_or(&none));
        if let (Some(fields), serde_json::Value::Object(shown)) = (report.as_object_mut(), shown) {
            fields.extend(shown);
        }
        out!("{report}");
    } else if let Some(holder) = &holder {
        out!("{}: held", args.key);
        let shown = crate::list::Shown::of(holder);
        if holder.mode().is_some() {
            out!("  mode: {}", shown.mode);
        }
        if let Some(note) = shown.note {
            out!("  note: {note}");
        }
        if let Some(fence) = shown.fence {
            out!("  fence: {fence}");
        }
        if let Some(value) = holder.value() {
            out!(
                "  value: {}",
                crate::list::printable(&String::from_utf8_lossy(value))
            );
        }
        if let Some(age) = shown.age {
            out!("  age: {age}");
        }
        if let Some(left) = shown.lease_left {
            out!("  lease left: {left}");
        }
    } else {
        out!("{}: free", args.key);
    }
    ExitCode::from(if holder.is_some() { 0 } else { 1 })
}
