//! CPU time, read before and after a side's turn: the bench process's own
//! (its clients: dlock's, the peer's and the floor's alike) and the
//! servers' (each server process and every process it started, such as
//! PostgreSQL's backends). On a machine where the clients and the servers
//! share the cores, these say which of them a gap comes from.
//!
//! Each process is read through its CPU-time clock
//! (`clock_getcpuclockid(3)`): nanoseconds, threads that exited included,
//! the running slice brought up to date. Whatever a process does in the
//! background (a server's housekeeping, a client's idle keep-alives)
//! counts too; `idle` measures that rate.

use std::{collections::HashMap, fs, time::Duration};

/// CPU time taken so far by the bench process and by the servers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CpuTimes {
    pub(crate) client: Duration,
    pub(crate) servers: Duration,
    /// The bench process's `write(2)`-family calls (`syscw` in
    /// `/proc/self/io`: `write` and `writev`, as an HTTP/2 or RESP
    /// connection sends; not `send`), where read.
    pub(crate) client_writes: Option<u64>,
}

impl CpuTimes {
    /// Opens a window on what the bench and `server_pids` take: the
    /// servers read first and the bench last, so that the bench's own
    /// reading of `/proc` falls outside the window. Open it after
    /// anything else the bench does before the measured work.
    pub(crate) fn open(server_pids: &[u32]) -> Option<CpuTimes> {
        let servers = CpuTimes::servers_now(server_pids)?;
        let client_writes = write_calls();
        let client = CpuTimes::client_now()?;
        Some(CpuTimes {
            client,
            servers,
            client_writes,
        })
    }

    /// Closes the window `self` opened, the bench read first: what was
    /// taken in it; `None` if a reading went back (a server process that
    /// ended took its time with it). Close it before anything else the
    /// bench does after the measured work.
    pub(crate) fn close(self, server_pids: &[u32]) -> Option<CpuTimes> {
        let client = CpuTimes::client_now()?;
        let client_writes = write_calls();
        let servers = CpuTimes::servers_now(server_pids)?;
        Some(CpuTimes {
            client: client.checked_sub(self.client)?,
            servers: servers.checked_sub(self.servers)?,
            client_writes: self
                .client_writes
                .zip(client_writes)
                .and_then(|(before, after)| after.checked_sub(before)),
        })
    }

    /// Nothing taken: the start of a sum of windows.
    pub(crate) fn zero() -> CpuTimes {
        CpuTimes {
            client_writes: Some(0),
            ..CpuTimes::default()
        }
    }

    /// The bench process's CPU time now; `None` if it cannot be read.
    fn client_now() -> Option<Duration> {
        process_cpu(0)
    }

    /// The CPU time of the processes `server_pids` and all their
    /// descendants now; `None` without `/proc` (not Linux).
    fn servers_now(server_pids: &[u32]) -> Option<Duration> {
        if server_pids.is_empty() {
            return Some(Duration::ZERO);
        }
        Some(tree_cpu(server_pids, &children()?))
    }

    pub(crate) fn add(self, other: CpuTimes) -> CpuTimes {
        CpuTimes {
            client: self.client + other.client,
            servers: self.servers + other.servers,
            client_writes: self
                .client_writes
                .zip(other.client_writes)
                .map(|(a, b)| a + b),
        }
    }

    /// Microseconds per operation of the clients and of the servers.
    pub(crate) fn per_op(self, ops: u64) -> (f64, f64) {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / ops.max(1) as f64;
        (per(self.client), per(self.servers))
    }
}

/// The bench process's write calls so far (`syscw`).
fn write_calls() -> Option<u64> {
    let io = fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("syscw:"))
        .and_then(|n| n.trim().parse().ok())
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

/// The CPU time of `roots` and of all their descendants.
fn tree_cpu(roots: &[u32], children: &HashMap<u32, Vec<u32>>) -> Duration {
    let mut total = Duration::ZERO;
    let mut pending: Vec<u32> = roots.to_vec();
    // Each process once, however the map came out.
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

/// The CPU time of process `pid` (0: this one), all its threads, from its
/// CPU-time clock; `None` if it has ended.
fn process_cpu(pid: u32) -> Option<Duration> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `clock` is a valid place for the answer; the call reads
    // nothing else.
    if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
        return None;
    }
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid place for the answer.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        return None;
    }
    Some(Duration::new(
        u64::try_from(now.tv_sec).ok()?,
        u32::try_from(now.tv_nsec).ok()?,
    ))
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

    fn spin(for_: Duration) {
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < for_ {
            x = std::hint::black_box(x.wrapping_add(1));
        }
    }

    #[test]
    fn work_in_this_process_shows_as_client_time() {
        // Spins until the clock says 30 ms, or 5 s pass: on a loaded
        // machine the spinning gets less than its wall time.
        let before = CpuTimes::client_now().expect("a CPU clock");
        let start = std::time::Instant::now();
        let mut taken = Duration::ZERO;
        while taken < Duration::from_millis(30) && start.elapsed() < Duration::from_secs(5) {
            spin(Duration::from_millis(5));
            taken = CpuTimes::client_now().expect("a CPU clock") - before;
        }
        assert!(
            taken >= Duration::from_millis(30),
            "5 s of spinning read as {taken:?}"
        );
    }

    #[test]
    fn a_child_process_counts_as_its_parents_server_time() {
        // A shell whose grandchild spins for 1 s and ends by itself: the
        // tree is walked.
        let mut parent = std::process::Command::new("sh")
            .args(["-c", "timeout 1 sh -c 'while :; do :; done'; :"])
            .spawn()
            .expect("sh");
        std::thread::sleep(Duration::from_millis(100));
        let before = CpuTimes::servers_now(&[parent.id()]);
        std::thread::sleep(Duration::from_millis(300));
        let after = CpuTimes::servers_now(&[parent.id()]);
        parent.wait().ok();
        let (before, after) = (before.expect("/proc"), after.expect("/proc"));
        assert!(
            after >= before + Duration::from_millis(20),
            "the child's spinning was not counted: {before:?} -> {after:?}"
        );
    }
}
