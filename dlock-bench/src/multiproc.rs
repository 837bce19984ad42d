//! Scenario 4: one key contended by several OS processes of this binary, each
//! with its own client and tasks. The children share a directory: an
//! `inside` marker created exclusively in the critical section (a second
//! holder finds it there: an overlap), and `order.log`, appended to under
//! the lock, whose order of lines is the order of owners.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{ExitCode, Stdio},
    time::Duration,
};

use dlock_core::LockOptions;
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    process::Command,
    time::Instant,
};

use crate::{contention::Contention, Row, Target};

/// The hidden first argument that runs a child.
pub(crate) const CHILD: &str = "--child-contended";

/// Lock + release pairs each child runs before it says it is ready.
const WARM_UP: usize = 50;

/// How long a whole multi-process run may take before it is abandoned.
const RUN_LIMIT: Duration = Duration::from_secs(300);

/// Runs `processes` children with `tasks` tasks each, `per_task` acquisitions
/// per task; `None` for a target without a server (the in-process backend).
pub(crate) async fn contended(
    target: &Target,
    processes: usize,
    tasks: usize,
    per_task: usize,
) -> Option<Result<Row, String>> {
    let url = target.url.as_ref()?;
    Some(
        tokio::time::timeout(RUN_LIMIT, run(target, url, processes, tasks, per_task))
            .await
            .unwrap_or_else(|_| Err(format!("not done within {RUN_LIMIT:?}"))),
    )
}

async fn run(
    target: &Target,
    url: &str,
    processes: usize,
    tasks: usize,
    per_task: usize,
) -> Result<Row, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::new();
    for _ in 0..processes {
        let mut child = Command::new(&exe)
            .arg(CHILD)
            .arg(url)
            .arg(dir.path())
            .arg(tasks.to_string())
            .arg(per_task.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("{}: {e}", exe.display()))?;
        let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        // Connected and ready: the start is the same for every child.
        match lines.next_line().await {
            Ok(Some(line)) if line == "ready" => {}
            other => return Err(format!("child did not get ready: {other:?}")),
        }
        children.push((child, lines));
    }
    let requests = target.count_requests();
    let start = Instant::now();
    for (child, _) in &mut children {
        let stdin = child.stdin.as_mut().ok_or("no stdin")?;
        stdin.write_all(b"go\n").await.map_err(|e| e.to_string())?;
    }
    fn parse(values: &str) -> impl Iterator<Item = u64> + '_ {
        values.split(',').filter_map(|n| n.parse::<u64>().ok())
    }
    let mut contention = Contention::default();
    for (mut child, mut lines) in children {
        while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
            let (what, values) = line.split_once(' ').unwrap_or((&line, ""));
            match what {
                "waits" => contention
                    .waits
                    .extend(parse(values).map(Duration::from_micros)),
                "holds" => contention
                    .holds
                    .extend(parse(values).map(Duration::from_micros)),
                "overlaps" => contention.overlaps += parse(values).sum::<u64>() as usize,
                _ => return Err(format!("unexpected child output `{line}`")),
            }
        }
        let status = child.wait().await.map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("a child failed: {status}"));
        }
    }
    let elapsed = start.elapsed();
    let ops = (processes * tasks * per_task) as u64;
    let order = std::fs::read_to_string(dir.path().join("order.log")).map_err(|e| e.to_string())?;
    let owners: Vec<&str> = order.lines().collect();
    if owners.len() as u64 != ops {
        return Err(format!(
            "{} critical sections logged, {ops} expected",
            owners.len()
        ));
    }
    contention.owner_changes = 1 + owners.windows(2).filter(|w| w[0] != w[1]).count();
    Ok(contention.row(
        format!("contended-{processes}x{tasks}"),
        target,
        ops,
        elapsed,
        requests.per_op(ops),
        processes * tasks,
    ))
}

/// The child: `CHILD url dir tasks per_task`. Prints `ready`, waits for a
/// line on stdin, runs, and prints its waits, hold times and overlaps.
pub(crate) async fn child(args: &[String]) -> ExitCode {
    let [url, dir, tasks, per_task] = args else {
        eprintln!("usage: {CHILD} URL DIR TASKS PER_TASK");
        return ExitCode::from(2);
    };
    let (Ok(tasks), Ok(per_task)) = (tasks.parse::<usize>(), per_task.parse::<usize>()) else {
        eprintln!("TASKS and PER_TASK are numbers");
        return ExitCode::from(2);
    };
    let locker = match locker_for(url, None).await {
        Ok(locker) => locker,
        Err(e) => {
            eprintln!("child: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Warmed as the single-process sides are: connections, sessions and
    // caches set up before the start, on a key of this process's own.
    let me = std::process::id();
    for _ in 0..WARM_UP {
        let warmed = match locker.lock(format!("bench:warm:{me}")).await {
            Ok(guard) => guard.release().await,
            Err(e) => Err(e),
        };
        if let Err(e) = warmed {
            eprintln!("child {me}: warming up: {e}");
            return ExitCode::FAILURE;
        }
    }
    locker.wait_for_releases().await;
    let dir = PathBuf::from(dir);
    println!("ready");
    let mut go = String::new();
    if std::io::stdin().read_line(&mut go).is_err() || go.trim() != "go" {
        return ExitCode::FAILURE;
    }
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (locker, dir) = (locker.clone(), dir.clone());
            tokio::spawn(async move {
                let (mut waits, mut holds, mut overlaps) = (Vec::new(), Vec::new(), 0);
                for _ in 0..per_task {
                    let t = Instant::now();
                    let guard = locker
                        .lock_with(
                            "bench:processes",
                            LockOptions::new().wait(Duration::from_secs(120)),
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                    let held = Instant::now();
                    waits.push(held - t);
                    overlaps += critical_section(&dir, &format!("{me}:{task}"))
                        .await
                        .map_err(|e| e.to_string())?;
                    holds.push(held.elapsed());
                    guard.release().await.map_err(|e| e.to_string())?;
                }
                Ok::<_, String>((waits, holds, overlaps))
            })
        })
        .collect();
    let (mut waits, mut holds, mut overlaps) = (Vec::new(), Vec::new(), 0);
    for handle in handles {
        match handle.await {
            Ok(Ok((w, h, o))) => {
                waits.extend(w);
                holds.extend(h);
                overlaps += o;
            }
            Ok(Err(e)) => {
                eprintln!("child {me}: {e}");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("child {me}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let list = |v: &[Duration]| {
        v.iter()
            .map(|d| d.as_micros().to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    println!("waits {}", list(&waits));
    println!("holds {}", list(&holds));
    println!("overlaps {overlaps}");
    ExitCode::SUCCESS
}

/// The shared critical section: 1 if another process was inside.
async fn critical_section(dir: &Path, owner: &str) -> std::io::Result<usize> {
    let marker = dir.join("inside");
    let overlap = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&marker)
    {
        Ok(_) => 0,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => 1,
        Err(e) => return Err(e),
    };
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("order.log"))?
        .write_all(format!("{owner}\n").as_bytes())?;
    tokio::time::sleep(Duration::from_micros(100)).await;
    if overlap == 0 {
        std::fs::remove_file(&marker)?;
    }
    Ok(overlap)
}

/// A locker on the backend at `url`.
pub(crate) async fn locker_for(
    url: &str,
    watchdog: Option<Duration>,
) -> Result<dlock_core::Locker, String> {
    let backend = dlock_testkit::connect(url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    Ok(build_locker(backend, watchdog))
}

/// A locker on `backend`, with the watchdog lease if one is given.
pub(crate) fn build_locker(
    backend: std::sync::Arc<dyn dlock_core::backend::DynBackend>,
    watchdog: Option<Duration>,
) -> dlock_core::Locker {
    let mut builder = dlock_core::LockerBuilder::from_arc(backend);
    if let Some(lease) = watchdog {
        builder = builder.watchdog_lease(lease);
    }
    builder.build().expect("valid options")
}
