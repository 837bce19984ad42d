//! A lock client in a process of its own, for the fault tests: they start,
//! kill, pause and resume it, and read what it prints.
//!
//! ```text
//! dlock-fault-helper stock <url|--no-lock> <key> <stock-file> <requests> <tasks> <hold-log>
//!     sells from the stock in <stock-file>, one unit per request, each read,
//!     pause and write under the lock, and records each hold in the hold log
//!     at <hold-log>; prints `sold <n> failed-releases <n>`. With `--no-lock` in place of the
//!     URL it takes no lock (the detector's self-test).
//! dlock-fault-helper hold <url> <key> <watchdog-lease-ms> <store-dir> <hold-log>
//!     takes the lock, prints `acquired <fence|none>`, then every 10 ms
//!     checks the guard and, while it holds, writes its fence to the fenced
//!     store in <store-dir> (guarded work) and extends its hold in the hold
//!     log to the end of that write. Once it is lost, prints
//!     `lost <reason>`, then sends the write a careless holder would still
//!     send and prints `late-write <fence> accepted|rejected` (or
//!     `late-write none` without fences).
//! dlock-fault-helper waiters <url> <key> <tasks> <hold-ms> <hold-log>
//!     with every fallback timer long (a 30 s watchdog lease, so that a
//!     holder's TTL is 20 to 30 s; on Redis a 30 s poll for waiters that
//!     cannot subscribe), starts <tasks> tasks that each lock <key>, hold
//!     it <hold-ms>, record the hold in the hold log and release it; prints
//!     `waiting` once all have started, and `done` when all have released.
//! dlock-fault-helper permits <url|--no-lock> <key> <limit> <rounds> <tasks> <watchdog-lease-ms> <hold-log>
//!     starts <tasks> tasks that each take one of the <limit> permits of
//!     <key> <rounds> times, work 5 ms, and record the work in the hold log
//!     if the permit was not lost by its end; prints `done <lost>` with how
//!     many permits were lost. With `--no-lock` it takes no permit (the
//!     detector's self-test).
//! dlock-fault-helper lead <url> <name> <watchdog-lease-ms> <store-dir> <hold-log>
//!     campaigns in the election <name>; once it leads, prints
//!     `leader <term>`, then every 10 ms asks whether it still leads and,
//!     while it does, writes its term to the fenced store in <store-dir>
//!     and, if the store accepted it, extends its leadership in the hold
//!     log to the moment it asked. Once it is told it no longer leads,
//!     prints `deposed` and `late-write <term> accepted|rejected` for the
//!     write a careless leader would still send, and ends.
//! dlock-fault-helper wait-long <url> <key> <fixed-lease-ms>
//!     prints `waiting`, then waits for <key> as long as it takes, asking
//!     for a fixed lease of <fixed-lease-ms> (the fault tests ask for an
//!     hour, and kill it while it waits); prints `acquired` if it gets it.
//! dlock-fault-helper permit-hold <url> <key> <limit> <watchdog-lease-ms> <hold-log>
//!     takes one of the <limit> permits of <key>, prints `acquired`, then
//!     every 10 ms checks the permit and, while it holds, extends its hold
//!     in the hold log; once it is lost, prints `lost <reason>` and ends.
//! ```

use std::{path::Path, process::ExitCode, sync::Arc, time::Duration};

use dlock_core::{backend::Mode, LockOptions, Locker};
use dlock_redis::{RedisBackend, RedisConfig};
use dlock_testkit::{monotonic_ns, FencedStore, HoldLog};

/// Locks `key`, retrying a few times when the servers fail to answer
/// (busy machines), as a service would; any other error is the answer.
async fn lock(locker: &Locker, key: &str) -> Result<dlock_core::LockGuard, String> {
    lock_mode(locker, key, Mode::Exclusive).await
}

/// [`lock`], for any mode.
async fn lock_mode(
    locker: &Locker,
    key: &str,
    mode: Mode,
) -> Result<dlock_core::LockGuard, String> {
    let mut tries = 0;
    loop {
        match locker
            .lock_mode(key, mode, LockOptions::new().wait(Duration::from_secs(120)))
            .await
        {
            Ok(guard) => return Ok(guard),
            Err(dlock_core::LockError::Backend { .. }) if tries < 5 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn fence_text(fence: Option<u64>) -> String {
    fence.map_or_else(|| "none".to_owned(), |f| f.to_string())
}

/// The backend's fallback timers: as configured by default, or all set to
/// [`LONG`].
#[derive(PartialEq)]
enum Fallbacks {
    Default,
    Long,
}

async fn locker(
    url: &str,
    watchdog: Option<Duration>,
    fallbacks: Fallbacks,
) -> Result<Locker, String> {
    let redis = url.starts_with("redis://") || url.starts_with("redis+redlock://");
    let client: Arc<dyn dlock_core::backend::DynBackend> = if redis && fallbacks == Fallbacks::Long
    {
        let config = RedisConfig::from_url(url)
            .map_err(|e| e.to_string())?
            .with_unwatched_poll(LONG);
        Arc::new(
            RedisBackend::connect_with(config)
                .await
                .map_err(|e| e.to_string())?,
        )
    } else {
        // etcd and ZooKeeper waiters have no timer to set: they wait on a
        // watch of the key ahead of them.
        dlock_testkit::connect(url)
            .await
            .map_err(|e| e.to_string())?
    };
    let mut builder = dlock_core::LockerBuilder::from_arc(client);
    if let Some(lease) = watchdog {
        builder = builder.watchdog_lease(lease);
    }
    builder.build().map_err(|e| e.to_string())
}

/// A name for one hold, unique across processes.
fn holder_name(task: usize, hold: usize) -> String {
    format!("{}-{task}-{hold}", std::process::id())
}

async fn stock(args: &[String]) -> Result<(), String> {
    let [url, key, file, requests, tasks, holds] = args else {
        return Err(
            "stock <url|--no-lock> <key> <stock-file> <requests> <tasks> <hold-log>".into(),
        );
    };
    let requests: usize = requests.parse().map_err(|_| "requests: a number")?;
    let tasks: usize = tasks.parse().map_err(|_| "tasks: a number")?;
    let locker = match url.as_str() {
        "--no-lock" => None,
        url => Some(locker(url, None, Fallbacks::Default).await?),
    };
    let file = Arc::new(file.clone());
    let holds = HoldLog::new(Path::new(holds));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (locker, key, file, holds) = (locker.clone(), key.clone(), file.clone(), holds.clone());
        let mine = requests / tasks + usize::from(t < requests % tasks);
        handles.push(tokio::spawn(async move {
            let (mut sold, mut failed_releases) = (0_u64, 0_u64);
            for n in 0..mine {
                let guard = match &locker {
                    Some(locker) => Some(lock(locker, &key).await?),
                    None => None,
                };
                let start = monotonic_ns();
                // A read-modify-write the lock must make exclusive.
                let left: i64 = std::fs::read_to_string(&*file)
                    .map_err(|e| e.to_string())?
                    .trim()
                    .parse()
                    .map_err(|_| "the stock file is not a number".to_owned())?;
                tokio::time::sleep(Duration::from_millis(1)).await;
                if left > 0 {
                    // Replaced whole (write, then rename), so that a reader
                    // never sees a half-written file, even without the lock.
                    let next = format!("{file}.{}", holder_name(t, n));
                    std::fs::write(&next, (left - 1).to_string()).map_err(|e| e.to_string())?;
                    std::fs::rename(&next, &*file).map_err(|e| e.to_string())?;
                    sold += 1;
                }
                holds
                    .record(&holder_name(t, n), start, monotonic_ns())
                    .map_err(|e| e.to_string())?;
                if let Some(guard) = guard {
                    // A release that finds the lock gone is counted, not
                    // fatal: the test reads the hold log first.
                    if let Err(e) = guard.release().await {
                        eprintln!("dlock-fault-helper: release: {e}");
                        failed_releases += 1;
                    }
                }
            }
            Ok::<_, String>((sold, failed_releases))
        }));
    }
    let (mut sold, mut failed_releases) = (0, 0);
    for h in handles {
        let (s, f) = h.await.map_err(|e| e.to_string())??;
        sold += s;
        failed_releases += f;
    }
    println!("sold {sold} failed-releases {failed_releases}");
    Ok(())
}

async fn hold(args: &[String]) -> Result<(), String> {
    let [url, key, lease, store, holds] = args else {
        return Err("hold <url> <key> <watchdog-lease-ms> <store-dir> <hold-log>".into());
    };
    let lease = Duration::from_millis(lease.parse().map_err(|_| "lease: a number of ms")?);
    let store = FencedStore::new(Path::new(store));
    let holds = HoldLog::new(Path::new(holds));
    let locker = locker(url, Some(lease), Fallbacks::Default).await?;
    let guard = lock(&locker, key).await?;
    let start = monotonic_ns();
    let fence = guard.fencing_token();
    println!("acquired {}", fence_text(fence));
    let write = |fence| store.write("holder", fence).map_err(|e| e.to_string());
    loop {
        // Before any guarded work, the careful holder asks.
        if guard.is_lost() {
            let reason = guard.lost().await;
            println!("lost {reason}");
            match fence {
                Some(fence) => {
                    let verdict = if write(fence)? {
                        "accepted"
                    } else {
                        "rejected"
                    };
                    println!("late-write {fence} {verdict}");
                }
                None => println!("late-write none"),
            }
            return Ok(());
        }
        if let Some(fence) = fence {
            write(fence)?;
        }
        holds
            .record(&holder_name(0, 0), start, monotonic_ns())
            .map_err(|e| e.to_string())?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn lead(args: &[String]) -> Result<(), String> {
    let [url, name, lease, store, holds] = args else {
        return Err("lead <url> <name> <watchdog-lease-ms> <store-dir> <hold-log>".into());
    };
    let lease = Duration::from_millis(lease.parse().map_err(|_| "lease: a number of ms")?);
    let store = FencedStore::new(Path::new(store));
    let holds = HoldLog::new(Path::new(holds));
    let locker = locker(url, Some(lease), Fallbacks::Default).await?;
    let election = locker.elect(name).map_err(|e| e.to_string())?;
    // What followers read of this leader: its process.
    election
        .proclaim(format!("pid {}", std::process::id()))
        .await
        .map_err(|e| e.to_string())?;
    let term = election.leading().await.map_err(|e| e.to_string())?;
    let start = monotonic_ns();
    println!("leader {term}");
    let write = |term| store.write("leader", term).map_err(|e| e.to_string());
    loop {
        // Before any fenced work, the careful leader asks. The hold log
        // records when it asked (read first: a stop after the reading
        // and before the answer gets a "no" on resuming), so an overlap
        // there is a leader told it leads after another began to; its
        // write is judged by the fenced store, which refuses a write from
        // a leader stopped between the answer and the write.
        let asked = monotonic_ns();
        let still = election.term() == Some(term);
        let accepted = write(term)?;
        if still {
            // A refused write here was stopped between the answer and the
            // write: the next question tells.
            if accepted {
                holds
                    .record(&format!("leader-{term}"), start, asked)
                    .map_err(|e| e.to_string())?;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        println!("deposed");
        let verdict = if accepted { "accepted" } else { "rejected" };
        println!("late-write {term} {verdict}");
        return Ok(());
    }
}

/// Every fallback timer of the waiters test, set long: a waiter that is
/// granted promptly was woken by the release.
const LONG: Duration = dlock_testkit::HANDOFF_FALLBACKS;

async fn wait_long(args: &[String]) -> Result<(), String> {
    let [url, key, lease] = args else {
        return Err("wait-long <url> <key> <fixed-lease-ms>".into());
    };
    let lease = Duration::from_millis(lease.parse().map_err(|_| "lease: a number of ms")?);
    let locker = locker(url, None, Fallbacks::Default).await?;
    println!("waiting");
    let options = LockOptions::new().lease(lease).wait_forever();
    let guard = locker
        .lock_with(key, options)
        .await
        .map_err(|e| e.to_string())?;
    println!("acquired");
    guard.release().await.map_err(|e| e.to_string())
}

async fn waiters(args: &[String]) -> Result<(), String> {
    let [url, key, tasks, hold, holds] = args else {
        return Err("waiters <url> <key> <tasks> <hold-ms> <hold-log>".into());
    };
    let tasks: usize = tasks.parse().map_err(|_| "tasks: a number")?;
    let hold = Duration::from_millis(hold.parse().map_err(|_| "hold: a number of ms")?);
    let locker = locker(url, Some(LONG), Fallbacks::Long).await?;
    let holds = HoldLog::new(Path::new(holds));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (locker, key, holds) = (locker.clone(), key.clone(), holds.clone());
        handles.push(tokio::spawn(async move {
            let guard = lock(&locker, &key).await?;
            let start = monotonic_ns();
            tokio::time::sleep(hold).await;
            holds
                .record(&holder_name(t, 0), start, monotonic_ns())
                .map_err(|e| e.to_string())?;
            guard.release().await.map_err(|e| e.to_string())
        }));
    }
    println!("waiting");
    for h in handles {
        h.await.map_err(|e| e.to_string())??;
    }
    println!("done");
    Ok(())
}

fn one_permit_of(limit: &str) -> Result<Mode, String> {
    let limit = limit.parse().map_err(|_| "limit: a number")?;
    Mode::permits(1, limit).map_err(|e| e.to_string())
}

async fn permits(args: &[String]) -> Result<(), String> {
    let [url, key, limit, rounds, tasks, lease, holds] = args else {
        return Err(
            "permits <url|--no-lock> <key> <limit> <rounds> <tasks> <watchdog-lease-ms> <hold-log>"
                .into(),
        );
    };
    let mode = one_permit_of(limit)?;
    let rounds: usize = rounds.parse().map_err(|_| "rounds: a number")?;
    let tasks: usize = tasks.parse().map_err(|_| "tasks: a number")?;
    let lease = Duration::from_millis(lease.parse().map_err(|_| "lease: a number of ms")?);
    let locker = match url.as_str() {
        "--no-lock" => None,
        url => Some(locker(url, Some(lease), Fallbacks::Default).await?),
    };
    let holds = HoldLog::new(Path::new(holds));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (locker, key, holds) = (locker.clone(), key.clone(), holds.clone());
        handles.push(tokio::spawn(async move {
            let mut lost = 0_u64;
            for n in 0..rounds {
                let permit = match &locker {
                    Some(locker) => Some(lock_mode(locker, &key, mode).await?),
                    None => None,
                };
                let start = monotonic_ns();
                tokio::time::sleep(Duration::from_millis(5)).await;
                let end = monotonic_ns();
                // Work counts only if the permit was still held at its end
                // (a paused process's permit may have gone meanwhile).
                if permit.as_ref().is_some_and(dlock_core::LockGuard::is_lost) {
                    lost += 1;
                } else {
                    holds
                        .record(&holder_name(t, n), start, end)
                        .map_err(|e| e.to_string())?;
                }
                drop(permit);
            }
            Ok::<_, String>(lost)
        }));
    }
    let mut lost = 0;
    for h in handles {
        lost += h.await.map_err(|e| e.to_string())??;
    }
    if let Some(locker) = locker {
        locker.wait_for_releases().await;
    }
    println!("done {lost}");
    Ok(())
}

async fn permit_hold(args: &[String]) -> Result<(), String> {
    let [url, key, limit, lease, holds] = args else {
        return Err("permit-hold <url> <key> <limit> <watchdog-lease-ms> <hold-log>".into());
    };
    let mode = one_permit_of(limit)?;
    let lease = Duration::from_millis(lease.parse().map_err(|_| "lease: a number of ms")?);
    let holds = HoldLog::new(Path::new(holds));
    let locker = locker(url, Some(lease), Fallbacks::Default).await?;
    let permit = lock_mode(&locker, key, mode).await?;
    let start = monotonic_ns();
    println!("acquired");
    loop {
        // The work up to now counts only if the permit is still held after
        // it (read first: a pause between the check and the record must
        // not stretch the hold past the check).
        let now = monotonic_ns();
        if permit.is_lost() {
            println!("lost {}", permit.lost().await);
            return Ok(());
        }
        holds
            .record(&holder_name(0, 0), start, now)
            .map_err(|e| e.to_string())?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("stock") => stock(&args[1..]).await,
        Some("hold") => hold(&args[1..]).await,
        Some("waiters") => waiters(&args[1..]).await,
        Some("permits") => permits(&args[1..]).await,
        Some("permit-hold") => permit_hold(&args[1..]).await,
        Some("lead") => lead(&args[1..]).await,
        Some("wait-long") => wait_long(&args[1..]).await,
        _ => Err(
            "usage: dlock-fault-helper stock|hold|waiters|permits|permit-hold|lead|wait-long ..."
                .into(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dlock-fault-helper: {e}");
            ExitCode::FAILURE
        }
    }
}
