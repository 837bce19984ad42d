//! A run-once scheduled job: several instances run the same schedule, and on
//! each tick exactly one of them does the work.
//!
//! Each tick, every instance calls `try_lock` on the job's key with a fixed
//! lease (the longest the job may take); the others skip at once. The
//! winner checks the job's store for the tick (an instance that came late,
//! after the winner released, finds it done), does the work, and writes
//! its result **with its fencing token**: the store refuses a write whose
//! token is older than one it has seen. That is what makes the job safe
//! when a holder stalls past its lease (a GC pause, a frozen VM) and
//! another instance has taken over: the stale holder's late write is
//! rejected instead of overwriting newer work. Checking
//! `guard.is_lost()` before writing would not be enough: the lease can run
//! out between the check and the write.
//!
//! The lease is the job's time budget: a run that outlives it may be run
//! again by another instance (the fence then keeps the older write from
//! landing after the newer one; it cannot undo the work). Choose a lease
//! longer than any run, or use the watchdog (`try_lock` without a lease)
//! and accept that a frozen holder keeps the job until its session ends.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock::{LockError, LockOptions, Locker};
use tokio::time::Instant;

/// How the schedule runs.
#[derive(Debug, Clone)]
pub struct JobConfig {
    /// The lock key of the job.
    pub key: String,
    /// Time between ticks.
    pub period: Duration,
    /// Ticks to run.
    pub ticks: u64,
    /// The lock's fixed lease: the longest one run may take.
    pub lease: Duration,
    /// How long one run of the job takes.
    pub work: Duration,
}

impl Default for JobConfig {
    fn default() -> Self {
        JobConfig {
            key: "job:nightly-report".to_owned(),
            period: Duration::from_millis(500),
            ticks: 5,
            lease: Duration::from_millis(300),
            work: Duration::from_millis(50),
        }
    }
}

/// The job's result, as written to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The tick it is for.
    pub tick: u64,
    /// The instance that wrote it.
    pub instance: String,
    /// The fencing token it was written with.
    pub fence: u64,
}

/// The job's store (a database table, here in memory), with a fence: a
/// write is accepted only with a token at least as new as any seen, as in
/// `UPDATE ... WHERE last_fence <= $token`.
///
/// # Examples
///
/// ```
/// use dlock_examples::job::{FencedStore, Report, StaleFence};
///
/// let store = FencedStore::default();
/// let report = |tick, fence| Report { tick, instance: "a".into(), fence };
/// assert!(store.write(report(1, 8)).is_ok());
/// assert_eq!(store.write(report(0, 7)), Err(StaleFence { fence: 7, newest: 8 }));
/// assert!(store.has(1) && !store.has(0));
/// assert_eq!(store.reports().len(), 1);
/// ```
#[derive(Debug, Default)]
pub struct FencedStore {
    state: Mutex<StoreState>,
}

#[derive(Debug, Default)]
struct StoreState {
    highest_fence: u64,
    reports: Vec<Report>,
}

/// A write refused because a newer lock holder has written since.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stale fencing token {fence}: the store has seen {newest}")]
pub struct StaleFence {
    /// The writer's token.
    pub fence: u64,
    /// The newest token the store has seen.
    pub newest: u64,
}

impl FencedStore {
    /// Writes `report` if its fence is not older than any seen.
    ///
    /// # Errors
    ///
    /// [`StaleFence`] otherwise; nothing is written.
    pub fn write(&self, report: Report) -> Result<(), StaleFence> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if report.fence < state.highest_fence {
            return Err(StaleFence {
                fence: report.fence,
                newest: state.highest_fence,
            });
        }
        state.highest_fence = report.fence;
        state.reports.push(report);
        Ok(())
    }

    /// Whether the report for `tick` is written.
    pub fn has(&self, tick: u64) -> bool {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.reports.iter().any(|r| r.tick == tick)
    }

    /// Every report written, in order.
    pub fn reports(&self) -> Vec<Report> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.reports.clone()
    }
}

/// What an instance did on a tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It ran the job and wrote the report with this fencing token.
    Ran {
        /// The lock's fencing token.
        fence: u64,
    },
    /// Another instance held the job's lock.
    Skipped,
    /// A follower of the elected scheduler: the instance that leads, as
    /// the election's leader proclaimed it (`None`: nobody leads now).
    Following {
        /// The leading instance's name.
        leader: Option<String>,
    },
    /// It got the lock after the tick's report was written.
    AlreadyDone,
    /// It ran the job, but its write was refused: it had stalled past its
    /// lease and a newer holder had written.
    Rejected(StaleFence),
}

/// One instance's outcome on one tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The tick.
    pub tick: u64,
    /// The instance.
    pub instance: String,
    /// What it did.
    pub outcome: Outcome,
}

/// Why an instance stopped.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Taking the lock failed (not: the lock was held).
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The backend gives no fencing tokens (Redlock), so the job's writes
    /// could not be fenced.
    #[error("the backend gives no fencing tokens (Redlock does not); run this job on redis://, etcd://, zk:// or the in-process backend")]
    NoFencing,
}

/// Runs instance `name`'s schedule: ticks start at `epoch` + n × period.
/// With `stall_on_tick`, the instance that runs the job on that tick stalls
/// for twice the lease after taking the lock, as a paused process would.
///
/// # Errors
///
/// [`JobError`] if the lock service failed or gives no fencing tokens.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use dlock::{BackendExt, MemoryBackend};
/// use dlock_examples::job::{run_instance, FencedStore, JobConfig};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), dlock_examples::job::JobError> {
/// let locker = MemoryBackend::new().into_locker();
/// let store = Arc::new(FencedStore::default());
/// let config = JobConfig { ticks: 2, ..JobConfig::default() };
/// let epoch = tokio::time::Instant::now();
/// let events = run_instance(&locker, "a", &store, &config, epoch, None).await?;
/// assert_eq!(store.reports().len(), 2);
/// # Ok(())
/// # }
/// ```
pub async fn run_instance(
    locker: &Locker,
    name: &str,
    store: &Arc<FencedStore>,
    config: &JobConfig,
    epoch: Instant,
    stall_on_tick: Option<u64>,
) -> Result<Vec<Event>, JobError> {
    let mut events = Vec::new();
    for tick in 0..config.ticks {
        tokio::time::sleep_until(epoch + config.period * tick as u32).await;
        let options = LockOptions::new().lease(config.lease);
        let outcome = match locker.try_lock_with(&config.key, options).await? {
            None => Outcome::Skipped,
            Some(guard) => {
                let fence = guard.fencing_token().ok_or(JobError::NoFencing)?;
                let outcome = if store.has(tick) {
                    Outcome::AlreadyDone
                } else {
                    tokio::time::sleep(config.work).await;
                    if stall_on_tick == Some(tick) {
                        tokio::time::sleep(config.lease * 2).await;
                    }
                    let report = Report {
                        tick,
                        instance: name.to_owned(),
                        fence,
                    };
                    match store.write(report) {
                        Ok(()) => Outcome::Ran { fence },
                        Err(stale) => Outcome::Rejected(stale),
                    }
                };
                // A lease that ran out is no error here: the fence kept the
                // store safe.
                match guard.release().await {
                    Ok(()) | Err(LockError::Lost { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                outcome
            }
        };
        events.push(Event {
            tick,
            instance: name.to_owned(),
            outcome,
        });
    }
    Ok(events)
}

/// The same schedule under an elected leader: each instance campaigns
/// once ([`Locker::elect`] on the job's key), and on each tick only the
/// leader runs the job, writing its report **with its term** as the fence
/// (terms strictly increase across leaders, so a deposed leader's late
/// write is refused). No lock is taken per tick: a follower that becomes
/// leader (the old one resigned, crashed, or stalled past its lease) runs
/// the next tick. With `resign_after_tick`, the instance that leads on
/// that tick resigns after it, as an instance shut down for a deploy
/// would. Each instance proclaims its name, and a follower's tick says who
/// leads ([`Outcome::Following`]).
///
/// # Errors
///
/// [`JobError::Lock`] if the election cannot start (the backend gives no
/// fencing tokens, or there is no runtime) or the name cannot be
/// proclaimed.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use dlock::{BackendExt, MemoryBackend};
/// use dlock_examples::job::{run_scheduler, FencedStore, JobConfig};
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), dlock_examples::job::JobError> {
/// let locker = MemoryBackend::new().into_locker();
/// let store = Arc::new(FencedStore::default());
/// let config = JobConfig { ticks: 2, ..JobConfig::default() };
/// let epoch = tokio::time::Instant::now() + config.period;
/// run_scheduler(&locker, "a", &store, &config, epoch, None).await?;
/// assert_eq!(store.reports().len(), 2);
/// # Ok(())
/// # }
/// ```
pub async fn run_scheduler(
    locker: &Locker,
    name: &str,
    store: &Arc<FencedStore>,
    config: &JobConfig,
    epoch: Instant,
    resign_after_tick: Option<u64>,
) -> Result<Vec<Event>, JobError> {
    let election = locker.elect(&config.key)?;
    election.proclaim(name).await?;
    let mut events = Vec::new();
    for tick in 0..config.ticks {
        tokio::time::sleep_until(epoch + config.period * tick as u32).await;
        // Asked at the tick: a leader whose lease ran out says no.
        let outcome = match election.term() {
            // A read that fails names nobody: it must not end the schedule.
            None => Outcome::Following {
                leader: election.leader().await.ok().flatten().and_then(|leader| {
                    leader
                        .value
                        .map(|name| String::from_utf8_lossy(&name).into_owned())
                }),
            },
            Some(_) if store.has(tick) => Outcome::AlreadyDone,
            Some(term) => {
                tokio::time::sleep(config.work).await;
                let report = Report {
                    tick,
                    instance: name.to_owned(),
                    fence: term,
                };
                match store.write(report) {
                    Ok(()) => Outcome::Ran { fence: term },
                    Err(stale) => Outcome::Rejected(stale),
                }
            }
        };
        let ran = matches!(outcome, Outcome::Ran { .. });
        events.push(Event {
            tick,
            instance: name.to_owned(),
            outcome,
        });
        if ran && resign_after_tick == Some(tick) {
            election.resign().await?;
            return Ok(events);
        }
    }
    election.resign().await?;
    Ok(events)
}
