//! CPU time, read from `/proc` before and after a side's turn: the bench
//! process's own (its clients: dlock's, the peer's and the floor's alike)
//! and the servers' (each server process and every process it started,
//! such as PostgreSQL's backends). On a machine where the clients and the
//! servers share the cores, these say which of them a gap comes from.

use std::{collections::HashMap, fs, time::Duration};

/// CPU time taken so far by the bench process and by the servers.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuTimes {
    pub(crate) client: Duration,
    pub(crate) servers: Duration,
}

impl CpuTimes {
    /// Reads both now; `None` where `/proc` cannot be read (not Linux).
    pub(crate) fn now(server_pids: &[u32]) -> Option<CpuTimes> {
        let client = process_cpu(std::process::id())?;
        let servers = if server_pids.is_empty() {
            Duration::ZERO
        } else {
            tree_cpu(server_pids, &children()?)
        };
        Some(CpuTimes { client, servers })
    }

    /// What was taken since `earlier`.
    pub(crate) fn since(self, earlier: CpuTimes) -> CpuTimes {
        CpuTimes {
            client: self.client.saturating_sub(earlier.client),
            servers: self.servers.saturating_sub(earlier.servers),
        }
    }

    pub(crate) fn add(self, other: CpuTimes) -> CpuTimes {
        CpuTimes {
            client: self.client + other.client,
            servers: self.servers + other.servers,
        }
    }
}

/// Every live process's children, by parent, from `/proc/*/stat`.
fn children() -> Option<HashMap<u32, Vec<u32>>> {
    let mut by_parent: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // A process that ended meanwhile has no stat: skipped.
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some(parent) = parent_of(&stat) {
            by_parent.entry(parent).or_default().push(pid);
        }
    }
    Some(by_parent)
}

/// The parent's pid in a `/proc/PID/stat` line: the second field after
/// the command name (which may hold spaces and parentheses itself).
fn parent_of(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The CPU time of `roots` and of all their descendants: every thread's
/// time on a CPU (`/proc/PID/task/TID/schedstat`, in nanoseconds).
fn tree_cpu(roots: &[u32], children: &HashMap<u32, Vec<u32>>) -> Duration {
    let mut total = Duration::ZERO;
    let mut pending: Vec<u32> = roots.to_vec();
    // Bounded: each process is visited once (a pid has one parent).
    let mut seen = std::collections::HashSet::new();
    while let Some(pid) = pending.pop() {
        if !seen.insert(pid) {
            continue;
        }
        total += process_cpu(pid).unwrap_or(Duration::ZERO);
        if let Some(kids) = children.get(&pid) {
            pending.extend(kids);
        }
    }
    total
}

/// The CPU time of every live thread of `pid`.
fn process_cpu(pid: u32) -> Option<Duration> {
    let mut nanos: u64 = 0;
    for task in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let Ok(line) = fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        nanos += line
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(Duration::from_nanos(nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parent_is_read_past_a_command_name_with_spaces_and_parentheses() {
        assert_eq!(parent_of("42 (a) b) c) S 7 42 42 0"), Some(7));
        assert_eq!(parent_of("42 (postgres) S 1 42 42 0"), Some(1));
        assert_eq!(parent_of("garbage"), None);
    }

    #[test]
    fn work_in_this_process_shows_as_client_time() {
        let before = CpuTimes::now(&[]).expect("/proc");
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(50) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let taken = CpuTimes::now(&[]).expect("/proc").since(before);
        assert!(
            taken.client >= Duration::from_millis(30),
            "50 ms of spinning read as {:?}",
            taken.client
        );
        assert_eq!(taken.servers, Duration::ZERO);
    }
}
