//! The workers of a run, and the faults injected into them: pauses
//! (SIGSTOP, then SIGCONT) and kills (SIGKILL, then a new worker).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use rustix::process::{kill_process, Pid, Signal};
use tokio::process::{Child, Command};

use super::{logs::holds_now, Fault, VerifyArgs};

/// The running workers.
pub(super) struct Workers<'a> {
    pub(super) args: &'a VerifyArgs,
    pub(super) dir: &'a Path,
    pub(super) seed: u64,
    /// The workers' watchdog lease.
    pub(super) lease: Duration,
    /// Each worker's number, slot and process.
    pub(super) running: Vec<(u32, u32, Child)>,
    pub(super) next_id: u32,
    /// When each killed worker died: its open holds end there.
    pub(super) killed_at: HashMap<u32, u64>,
}

impl Workers<'_> {
    pub(super) fn spawn(
        &mut self,
        until: tokio::time::Instant,
        url: &str,
        slot: u32,
    ) -> std::io::Result<()> {
        let id = self.next_id;
        self.next_id += 1;
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let exe = std::env::current_exe()?;
        let primitives: Vec<String> = self.args.primitive.0.iter().map(|p| p.name()).collect();
        let mut command = Command::new(exe);
        command
            .arg("verify-worker")
            // In the environment, not the arguments: any local user can
            // read a process's arguments (ps), and the URL may hold a
            // password.
            .env("DLOCK_URL", url)
            .arg("--watchdog-lease")
            .arg(format!("{}ms", self.lease.as_millis()))
            .args(["--key", &self.args.key])
            .args(["--primitives", &primitives.join(",")])
            .args(["--worker", &id.to_string()])
            .args(["--slot", &slot.to_string()])
            .args(["--tasks", &self.args.tasks.to_string()])
            .arg("--log")
            .arg(self.log(id))
            .args(["--seed", &self.seed.to_string()])
            .arg("--duration")
            .arg(format!("{}ms", left.as_millis().max(1)))
            .kill_on_drop(true);
        if self.args.faults.contains(&Fault::Cancel) {
            command.arg("--cancel");
        }
        if self.args.no_lock {
            command.arg("--no-lock");
        }
        self.running.push((id, slot, command.spawn()?));
        Ok(())
    }

    fn log(&self, id: u32) -> PathBuf {
        self.dir.join(format!("worker-{id}.log"))
    }

    /// Stops a worker that holds a lock now, looking from the one at `at`
    /// on: one whose log says it holds, and still says so once it is
    /// stopped (a stopped worker's log is still). Locks change hands, and
    /// a killed holder's lock stays taken until its lease ends, so it
    /// looks again every few milliseconds for up to `patience`; then it
    /// stops any worker. Its process id; `None` if none could be stopped.
    pub(super) async fn stop_a_holder(&self, at: usize, patience: Duration) -> Option<Pid> {
        let deadline = tokio::time::Instant::now() + patience;
        let count = self.running.len();
        // Bounded by the deadline, and by count too.
        for round in 0..100_000 {
            for i in 0..count {
                let (id, _, child) = &self.running[(at + round + i) % count];
                if !holds_now(&self.log(*id)) {
                    continue;
                }
                let Some(pid) = Workers::pid(child) else {
                    continue;
                };
                if stop(pid).await {
                    if holds_now(&self.log(*id)) {
                        return Some(pid);
                    }
                    let _ = kill_process(pid, Signal::CONT);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for i in 0..count {
            let (_, _, child) = &self.running[(at + i) % count];
            if let Some(pid) = Workers::pid(child) {
                if stop(pid).await {
                    return Some(pid);
                }
            }
        }
        None
    }

    pub(super) fn pid(child: &Child) -> Option<Pid> {
        child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw)
    }
}

/// What was injected.
#[derive(Debug, Default)]
pub(super) struct Injected {
    pub(super) pauses: u32,
    pub(super) kills: u32,
    pub(super) commands: u32,
}

/// Sends SIGSTOP to `pid` and waits, briefly, until it shows as stopped.
/// Whether the signal was sent.
async fn stop(pid: Pid) -> bool {
    if kill_process(pid, Signal::STOP).is_err() {
        return false;
    }
    // The signal is sent, not yet taken: a moment until the process
    // shows as stopped (bounded; read anyway after it).
    for _ in 0..50 {
        if is_stopped(pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

/// Whether every thread of process `pid` is stopped (state `T` in
/// `/proc/PID/task/*/stat`): a log write in flight has ended then.
fn is_stopped(pid: Pid) -> bool {
    let stopped = |stat: String| {
        let state = stat.rfind(')').map(|end| stat[end + 1..].trim_start());
        state.is_some_and(|s| s.starts_with('T'))
    };
    std::fs::read_dir(format!("/proc/{}/task", pid.as_raw_nonzero())).is_ok_and(|tasks| {
        tasks
            .flatten()
            .all(|t| std::fs::read_to_string(t.path().join("stat")).is_ok_and(stopped))
    })
}

/// A fault the run injects itself (cancels are the workers').
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Injection {
    Pause,
    Kill,
    Command,
}

impl Injected {
    /// How many of `injection` were injected.
    pub(super) fn count(&self, injection: Injection) -> u32 {
        match injection {
            Injection::Pause => self.pauses,
            Injection::Kill => self.kills,
            Injection::Command => self.commands,
        }
    }
}
