//! The processes a command started, found in Linux's `/proc` by parent
//! and by process group: what `dlock` waits for before it releases, and
//! what it signals.

use rustix::process::{Pid, Signal};

/// One line of the process table.
struct Proc {
    pid: i32,
    ppid: i32,
    pgrp: i32,
    /// Exited, all threads included: a zombie runs nothing. (A process
    /// whose first thread exited while others run shows `Z` too, with
    /// more than one thread: it still runs.)
    zombie: bool,
    /// Shows `Z` (reapable once every thread is gone).
    defunct: bool,
}

/// Every process `/proc` lists now (none where there is no `/proc`).
fn table() -> Vec<Proc> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // `pid (comm) state ppid pgrp …`: comm may hold anything but
            // `)` ends it.
            let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
            let state = fields.next()?;
            let ppid = fields.next()?.parse().ok()?;
            let pgrp = fields.next()?.parse().ok()?;
            // After ppid and pgrp: session, tty, tpgid, flags, 4 fault
            // counts, 4 times, priority, nice, then the thread count.
            let threads: u32 = fields.nth(14)?.parse().ok()?;
            let defunct = state == "Z" || state == "X";
            Some(Proc {
                pid,
                ppid,
                pgrp,
                zombie: defunct && threads <= 1,
                defunct,
            })
        })
        .collect()
}

/// The live processes that descend from `root` (not `root` itself) or
/// are in the process group `group`, leaving out `skip`. A zombie runs
/// nothing and does not count.
pub(crate) fn leftovers(root: Option<i32>, group: Option<i32>, skip: &[i32]) -> Vec<i32> {
    leftovers_in(&table(), root, group, skip)
}

fn leftovers_in(table: &[Proc], root: Option<i32>, group: Option<i32>, skip: &[i32]) -> Vec<i32> {
    let group = group.filter(|group| *group > 1);
    let mut found: Vec<i32> = Vec::new();
    let mut parents: Vec<i32> = root.filter(|root| *root > 0).into_iter().collect();
    // Bounded by the table: each process is added once.
    while let Some(parent) = parents.pop() {
        for p in table.iter().filter(|p| p.ppid == parent) {
            if !found.contains(&p.pid) && Some(p.pid) != root {
                found.push(p.pid);
                parents.push(p.pid);
            }
        }
    }
    for p in table.iter().filter(|p| Some(p.pgrp) == group) {
        if !found.contains(&p.pid) {
            found.push(p.pid);
        }
    }
    found.retain(|pid| !skip.contains(pid) && table.iter().any(|p| p.pid == *pid && !p.zombie));
    found.sort_unstable();
    found
}

/// Every live process below `root` (its descendants), with its process
/// group.
pub(crate) fn below(root: Option<i32>) -> Vec<(i32, i32)> {
    let table = table();
    leftovers_in(&table, root, None, &[])
        .into_iter()
        .filter_map(|pid| table.iter().find(|p| p.pid == pid).map(|p| (pid, p.pgrp)))
        .collect()
}

/// `root`'s children that have exited and wait to be reaped.
pub(crate) fn zombie_children(root: Option<i32>) -> Vec<i32> {
    let Some(root) = root else {
        return Vec::new();
    };
    table()
        .iter()
        .filter(|p| p.ppid == root && p.defunct)
        .map(|p| p.pid)
        .collect()
}

/// Sends `signal` to each of `pids`; gone already is not an error.
pub(crate) fn signal_each(pids: &[i32], signal: Signal) {
    for pid in pids.iter().filter_map(|pid| Pid::from_raw(*pid)) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::leftovers;

    #[test]
    fn a_grandchild_is_found_after_its_parent_exits_and_a_zombie_is_not() {
        let me = i32::try_from(std::process::id()).unwrap();
        rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
        // `sh` starts a sleeper in a session of its own and exits: the
        // sleeper comes back to this process (a subreaper).
        let mut sh = Command::new("sh")
            .args(["-c", "setsid sleep 5 >/dev/null 2>&1 & echo $!"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = String::new();
        std::io::Read::read_to_string(sh.stdout.as_mut().unwrap(), &mut out).unwrap();
        sh.wait().unwrap();
        let sleeper: i32 = out.trim().parse().unwrap();
        assert!(leftovers(Some(me), None, &[]).contains(&sleeper));
        assert!(!leftovers(Some(me), None, &[sleeper]).contains(&sleeper));
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(sleeper).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        // Dead but not reaped: a zombie, which does not count.
        for _ in 0..100 {
            if !leftovers(Some(me), None, &[]).contains(&sleeper) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!leftovers(Some(me), None, &[]).contains(&sleeper));
        let _ = rustix::process::waitpid(
            rustix::process::Pid::from_raw(sleeper),
            rustix::process::WaitOptions::empty(),
        );
    }
}
