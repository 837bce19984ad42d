//! `dlock list`: the held locks under a key prefix, as the server sees
//! them; and how a holder is shown, here and in `dlock status`.

use std::{process::ExitCode, time::Duration};

use comfy_table::{presets::NOTHING, Table};
use dlock::{
    backend::{HeldLock, Holder, Mode},
    LockError,
};

use crate::{exit, Server};

const LIST_HELP: &str = "\
Examples:
  dlock list --url redis://10.0.0.5:6379
  dlock list --url etcd://10.0.0.5:2379/locks --prefix jobs/ --json

Lists the locks held now whose key starts with --prefix: each holder with
its mode, note (HOSTNAME:PID of the process that took it, unless it set
another), fencing token, age and lease left, and the waiters, where the
backend records them (`-` where it does not). Where the server stores only
a hash of the key (SQL advisory locks), the key shows as `(key unknown: ID)`.
The locks are read a page at a time; --json prints one JSON object per
lock per line as each page comes, for any number of locks. If a page
fails, the locks read before it are printed, then the error.
Control characters in keys and notes show escaped (`\n`, `\u{1b}`).
Exit code 0 when listed (even none); 64 for bad options, 69 when the
server failed or the backend cannot list.";

/// List the held locks under a key prefix.
#[derive(Debug, clap::Args)]
#[command(after_help = LIST_HELP)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    server: Server,
    /// What the keys start with (default: every key).
    #[arg(long, default_value = "")]
    prefix: String,
    /// Print JSON lines (one object per lock) instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn list(args: ListArgs) -> ExitCode {
    let locker = match args.server.connect().await {
        Ok(locker) => locker,
        Err(code) => return code,
    };
    let mut listing = locker.list(args.prefix.as_str());
    let mut table = Table::new();
    table.load_style(NOTHING).set_header([
        "KEY",
        "MODE",
        "NOTE",
        "FENCE",
        "AGE",
        "LEASE LEFT",
        "WAITERS",
    ]);
    let failed = loop {
        let page = match listing.next_page().await {
            Ok(Some(page)) => page,
            Ok(None) => break None,
            Err(e) => break Some(e),
        };
        for lock in &page {
            if args.json {
                out!("{}", lock_json(lock));
            } else {
                rows(&mut table, lock);
            }
        }
    };
    // The pages read before a failure are shown all the same.
    if !args.json && (failed.is_none() || !table.is_empty()) {
        out!("{}", table.trim_fmt());
    }
    match failed {
        None => ExitCode::SUCCESS,
        Some(e @ LockError::Unsupported { .. }) => {
            say!("dlock: {e}");
            ExitCode::from(exit::UNAVAILABLE)
        }
        Some(e) => {
            say!("dlock: {e}");
            exit::for_error(&e)
        }
    }
}

/// One row per holder of `lock` (the waiters on the first).
fn rows(table: &mut Table, lock: &HeldLock) {
    let waiters = lock.waiters().map_or("-".to_owned(), |w| w.to_string());
    for (i, holder) in lock.holders().iter().enumerate() {
        let fields = Shown::of(holder);
        table.add_row([
            printable(&lock.key().to_string()),
            fields.mode,
            fields.note.unwrap_or_else(|| "-".to_owned()),
            fields.fence.map_or("-".to_owned(), |f| f.to_string()),
            fields.age.unwrap_or_else(|| "-".to_owned()),
            fields.lease_left.unwrap_or_else(|| "-".to_owned()),
            if i == 0 {
                waiters.clone()
            } else {
                String::new()
            },
        ]);
    }
}

fn lock_json(lock: &HeldLock) -> serde_json::Value {
    let holders: Vec<_> = lock.holders().iter().map(holder_json).collect();
    serde_json::json!({
        "key": lock.key().name(),
        "key_unknown_id": match lock.key() {
            dlock::backend::ListedKey::Hashed(id) => Some(id.as_str()),
            _ => None,
        },
        "holders": holders,
        "waiters": lock.waiters(),
    })
}

/// A holder as JSON: mode, note, fence, value, and the age and lease left
/// in milliseconds; `null` where the backend does not record it.
pub(crate) fn holder_json(holder: &Holder) -> serde_json::Value {
    let millis = |d: Option<Duration>| d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    serde_json::json!({
        "mode": holder.mode().map(mode_name),
        "note": holder.note(),
        "fence": holder.fence(),
        "value": holder.value().map(|v| String::from_utf8_lossy(v).into_owned()),
        "age_ms": millis(holder.age()),
        "lease_left_ms": millis(holder.lease_left()),
    })
}

/// A holder's fields as text, `None` where unknown.
pub(crate) struct Shown {
    pub(crate) mode: String,
    pub(crate) note: Option<String>,
    pub(crate) fence: Option<u64>,
    pub(crate) age: Option<String>,
    pub(crate) lease_left: Option<String>,
}

impl Shown {
    pub(crate) fn of(holder: &Holder) -> Shown {
        Shown {
            mode: holder.mode().map_or("-".to_owned(), mode_name),
            note: holder.note().map(printable),
            fence: holder.fence(),
            age: holder.age().map(short),
            lease_left: holder.lease_left().map(short),
        }
    }
}

/// Text from the server (a key, a note, a value) as shown on a terminal:
/// control and bidirectional-override characters escaped (`\n`,
/// `\u{1b}`), and so the backslash, so that nobody's text can move the
/// cursor, recolour the screen or pose as another row.
pub(crate) fn printable(text: &str) -> String {
    let mut shown = String::with_capacity(text.len());
    for c in text.chars() {
        let hidden = c.is_control()
            || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if hidden || c == '\\' {
            shown.extend(c.escape_default());
        } else {
            shown.push(c);
        }
    }
    shown
}

fn mode_name(mode: Mode) -> String {
    match mode {
        Mode::Exclusive => "exclusive".to_owned(),
        Mode::Read => "read".to_owned(),
        Mode::Write => "write".to_owned(),
        Mode::Permits { count, limit } => format!("{count}/{limit} permits"),
        other => format!("{other:?}"),
    }
}

/// A duration to a tenth of a second below a minute, in whole seconds
/// above: `0.4s`, `12.0s`, `3m05s`, `2h10m`.
fn short(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        0..60 => format!("{:.1}s", d.as_secs_f64()),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_short() {
        assert_eq!(short(Duration::from_millis(400)), "0.4s");
        assert_eq!(short(Duration::from_secs(185)), "3m05s");
        assert_eq!(short(Duration::from_secs(7800)), "2h10m");
    }

    #[test]
    fn text_from_the_server_cannot_drive_the_terminal() {
        assert_eq!(printable("jobs/a b"), "jobs/a b");
        assert_eq!(printable("ключ"), "ключ");
        assert_eq!(printable("a\x1b[31mb\nc"), "a\\u{1b}[31mb\\nc");
        assert_eq!(printable("a\u{202e}b\\n"), "a\\u{202e}b\\\\n");
    }
}
