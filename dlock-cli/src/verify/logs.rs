//! The workers' logs: one line per event, each written whole by one
//! `write` on a file opened for appending.
//!
//! - `S worker task primitive start fence kind`: a hold began (`-` for no
//!   fence; the kind's letter from [`Kind::letter`](super::check::Kind::letter));
//! - `H worker task now`: the hold was known held at `now`;
//! - `E worker task end lost`: it ended at `end`, lost (`1`) or given
//!   back (`0`);
//! - `C worker task`: an acquire or a release was dropped (a cancel fault).

use std::{collections::HashMap, path::Path};

use super::check;

/// The holds of a run, by primitive (its place in `--primitive`).
pub(crate) type Holds = HashMap<usize, Vec<check::Hold>>;

/// What the logs of a run hold.
#[derive(Debug, Default)]
pub(crate) struct Logs {
    pub(crate) holds: Holds,
    /// Holds that ended in a loss their holder saw.
    pub(crate) lost: usize,
    /// Acquires and releases dropped by the cancel fault.
    pub(crate) cancels: usize,
}

/// Whether the worker whose log is at `path` holds a lock now: a task's
/// last start or heartbeat in the log's tail has no end after it. A line not ended by
/// its newline is left out, as the checker leaves it out.
pub(crate) fn holds_now(path: &Path) -> bool {
    use std::io::{Read as _, Seek as _, SeekFrom};
    /// The last lines of every task of the worker: each writes about 200
    /// bytes a hold (up to 20 ms, a heartbeat every 5 ms), so this is the
    /// last hold of some 300 tasks.
    const TAIL: u64 = 64 * 1024;
    let Ok(mut file) = std::fs::File::open(path) else {
        return false;
    };
    let length = file.metadata().map_or(0, |m| m.len());
    let mut tail = Vec::new();
    if file
        .seek(SeekFrom::Start(length.saturating_sub(TAIL)))
        .is_err()
        || file.read_to_end(&mut tail).is_err()
    {
        return false;
    }
    let whole = tail
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |end| end + 1);
    let text = String::from_utf8_lossy(&tail[..whole]);
    // The tail's first line is whole only if the tail is the whole file.
    let skip = usize::from(length > TAIL);
    let mut open: HashMap<(&str, &str), bool> = HashMap::new();
    for line in text.lines().skip(skip) {
        let fields: Vec<&str> = line.split(' ').collect();
        // A heartbeat says held too (its start may be out of the tail).
        if let [kind @ ("S" | "H" | "E"), worker, task, ..] = fields[..] {
            open.insert((worker, task), kind != "E");
        }
    }
    open.values().any(|&held| held)
}

/// Every hold in the workers' logs in `dir`. A hold left open ends when
/// its worker was killed, if it was (`killed_at`: worker number to the
/// moment the signal was sent), since it may have held until then; else
/// at the last moment it was known held (its last heartbeat, else its
/// start).
pub(crate) fn read_logs(dir: &Path, killed_at: &HashMap<u32, u64>) -> std::io::Result<Logs> {
    let mut logs = Logs::default();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)?;
        // Only the last line may be torn, by a kill mid-write.
        let whole = match text.rfind('\n') {
            Some(end) => &text[..end],
            None => "",
        };
        let mut open: HashMap<(u32, u32), (usize, check::Hold)> = HashMap::new();
        for line in whole.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let number = |at: usize| fields.get(at).and_then(|f| f.parse::<u64>().ok());
            let bad = || {
                std::io::Error::other(format!("{}: malformed log line `{line}`", path.display()))
            };
            let id = |at: usize| {
                number(at)
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(bad)
            };
            match fields.first() {
                Some(&"S") => {
                    let (worker, task) = (id(1)?, id(2)?);
                    let primitive = id(3)? as usize;
                    let start_ns = number(4).ok_or_else(bad)?;
                    let hold = check::Hold {
                        worker,
                        task,
                        start_ns,
                        end_ns: start_ns,
                        fence: number(5),
                        kind: fields
                            .get(6)
                            .and_then(|k| check::Kind::from_letter(k))
                            .ok_or_else(bad)?,
                    };
                    open.insert((worker, task), (primitive, hold));
                }
                Some(&"H") => {
                    if let Some((_, hold)) = open.get_mut(&(id(1)?, id(2)?)) {
                        hold.end_ns = number(3).ok_or_else(bad)?;
                    }
                }
                Some(&"E") => {
                    if let Some((primitive, mut hold)) = open.remove(&(id(1)?, id(2)?)) {
                        hold.end_ns = number(3).ok_or_else(bad)?;
                        logs.lost += usize::from(number(4) == Some(1));
                        logs.holds.entry(primitive).or_default().push(hold);
                    }
                }
                Some(&"C") => {
                    id(2)?;
                    logs.cancels += 1;
                }
                _ => return Err(bad()),
            }
        }
        for (primitive, mut hold) in open.into_values() {
            if let Some(&killed) = killed_at.get(&hold.worker) {
                hold.end_ns = hold.end_ns.max(killed);
            }
            logs.holds.entry(primitive).or_default().push(hold);
        }
    }
    Ok(logs)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{holds_now, read_logs};
    use crate::verify::check::{check, Violation};

    #[test]
    fn a_worker_holds_while_a_task_has_a_start_with_no_end_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("worker-0.log");
        let case = |text: &str| {
            std::fs::write(&log, text).unwrap();
            holds_now(&log)
        };
        assert!(!case(""));
        assert!(case("S 0 1 0 100 5 X\nH 0 1 150\n"));
        // A hold whose start has scrolled out of the tail.
        assert!(case("H 0 1 150\n"));
        assert!(!case("S 0 1 0 100 5 X\nE 0 1 200 0\n"));
        // Another task's start; and an end not yet whole, left out.
        assert!(case("S 0 1 0 100 5 X\nS 0 2 1 120 - R\nE 0 1 200 0\n"));
        assert!(case("S 0 1 0 100 5 X\nE 0 1"));
        assert!(!case("S 0 1 0 100 5 X\nE 0 1 200 1\nE 0 2 210 0\n"));
        assert!(!holds_now(&dir.path().join("no-such.log")));
    }

    /// The violations in the logs `(worker, text)` of one mutex, with
    /// the workers killed at `killed`.
    fn violations(logs: &[(u32, &str)], killed: &[(u32, u64)]) -> Vec<Violation> {
        let dir = tempfile::tempdir().unwrap();
        for (worker, text) in logs {
            std::fs::write(dir.path().join(format!("worker-{worker}.log")), text).unwrap();
        }
        let killed_at: HashMap<u32, u64> = killed.iter().copied().collect();
        let logs = read_logs(dir.path(), &killed_at).unwrap();
        check(logs.holds.get(&0).map(Vec::as_slice).unwrap_or_default(), 1)
    }

    #[test]
    fn a_killed_workers_open_hold_lasts_until_the_kill() {
        // Worker 0 was granted at 1 ms and killed at 4 ms, before its
        // first heartbeat; worker 1 was granted at 2 ms, inside that hold.
        let young = [
            (0, "S 0 0 0 1000000 5 x\n"),
            (1, "S 1 0 0 2000000 6 x\nE 1 0 9000000 0\n"),
        ];
        assert!(
            matches!(
                violations(&young, &[(0, 4_000_000)])[..],
                [Violation::Overlap(..)]
            ),
            "a grant inside a hold killed before its first heartbeat"
        );
        // Worker 0's last heartbeat was at 6 ms, the kill at 12 ms; worker
        // 1 was granted at 8 ms.
        let older = [
            (0, "S 0 0 0 1000000 5 x\nH 0 0 6000000\n"),
            (1, "S 1 0 0 8000000 6 x\nE 1 0 9000000 0\n"),
        ];
        assert!(
            matches!(
                violations(&older, &[(0, 12_000_000)])[..],
                [Violation::Overlap(..)]
            ),
            "a grant between the last heartbeat and the kill"
        );
        // A worker that was not killed (it failed): its open hold ends at
        // its last heartbeat, and a grant after it is no overlap.
        assert_eq!(violations(&older, &[]), []);
    }
}
