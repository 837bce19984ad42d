//! Acquiring: one attempt on the blocking pool, then a wait in `flock` on
//! a thread of its own, woken by the kernel, that unlocks at once what it
//! obtains after its caller left.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, LazyLock, Mutex,
    },
    time::Duration,
};

use dlock_core::{
    backend::{AcquireRequest, Acquired, Backoff, Mode, Wait},
    LockError, LockKey, Result, MAX_LEASE,
};
use tokio::{sync::oneshot, time::Instant};

use super::{
    lock,
    locks::{self, Gate, Held, Plan, Stop},
    FileBackend, Owned,
};
use crate::NAME;

/// The most permits a semaphore may have: a slot file each.
pub(crate) const MAX_PERMITS: u32 = 1_024;

/// The most waits blocked on threads of their own at once, in this
/// process; further waits poll instead.
const MAX_WAIT_THREADS: usize = 256;

static WAIT_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Per object (its main file), how many waits of this process were left by
/// their callers and are still blocked in `flock`: each will take the
/// lock for a moment when it is freed, and unlock it at once.
static ABANDONED: LazyLock<Mutex<HashMap<PathBuf, usize>>> = LazyLock::new(Default::default);

fn abandoned_waits(path: &Path) -> usize {
    lock(&ABANDONED).get(path).copied().unwrap_or(0)
}

fn count_abandoned(path: &Path, up: bool) {
    let mut counts = lock(&ABANDONED);
    if up {
        *counts.entry(path.to_path_buf()).or_default() += 1;
    } else if let Some(n) = counts.get_mut(path) {
        *n -= 1;
        if *n == 0 {
            counts.remove(path);
        }
    }
}

impl FileBackend {
    fn plan(&self, key: &LockKey, mode: Mode) -> Result<Plan> {
        let names = self.names(key, mode);
        Ok(match mode {
            Mode::Read => Plan::Read(names),
            Mode::Write => Plan::Write(names),
            Mode::Permits { count, limit } => {
                if limit > MAX_PERMITS {
                    return Err(LockError::Unsupported {
                        backend: NAME,
                        what: "semaphores of more than 1024 permits (an open file each)",
                    });
                }
                Plan::Permits {
                    names,
                    count,
                    limit,
                }
            }
            Mode::Exclusive => Plan::Exclusive(names),
            _ => {
                return Err(LockError::Unsupported {
                    backend: NAME,
                    what: "this lock mode",
                })
            }
        })
    }

    pub(super) async fn acquire_inner(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        let plan = self.plan(req.key, req.mode)?;
        let waits = !matches!(req.wait, Wait::No);
        let (held, queued) = {
            let (plan, key) = (plan.clone(), req.key.clone());
            // Dropped before it answers, its grant (or a writer's gate) is
            // dropped with its output: unlocked.
            tokio::task::spawn_blocking(move || {
                let mut queued = None;
                settled_attempt(&plan, &key, waits.then_some(&mut queued))
                    .map(|held| (held, queued))
            })
            .await
            .map_err(|e| LockError::backend(NAME, e))??
        };
        if let Some(held) = held {
            return Ok(Some(self.granted(&req, held)));
        }
        let held = match req.wait {
            Wait::No => None,
            Wait::Until(_) | Wait::Forever => wait(plan, req.key.clone(), req.wait, queued).await?,
        };
        Ok(held.map(|held| self.granted(&req, held)))
    }

    /// Records a grant, its lease ending `req.lease` after it (renewed by
    /// the watchdog, unless fixed).
    fn granted(&self, req: &AcquireRequest<'_>, held: Held) -> Acquired {
        let lease = req.lease.min(MAX_LEASE);
        let ends = held.granted.checked_add(lease).unwrap_or(held.granted);
        let acquired = Acquired::new(Instant::from_std(held.granted)).with_fence(held.fence);
        lock(&self.inner.owned).insert(
            *req.token,
            Owned {
                key: req.key.clone(),
                mode: req.mode,
                held,
                loss: req.loss.clone(),
                ends,
                fixed: req.lease_kind == dlock_core::backend::LeaseKind::Fixed,
            },
        );
        self.inner.reaper.unpark();
        acquired
    }
}

/// One attempt; refused while a wait this process abandoned may hold the
/// object for a moment, tried again for up to about 25 ms, so that a lock
/// freed just now is not refused because of a waiter that left. With
/// `queued`, the caller waits if refused: a writer keeps its gate there.
fn settled_attempt(
    plan: &Plan,
    key: &LockKey,
    mut queued: Option<&mut Option<Gate>>,
) -> Result<Option<Held>> {
    for _ in 0..25 {
        let held = match queued.as_deref_mut() {
            Some(queued) => locks::attempt_queued(plan, key, queued)?,
            None => locks::attempt(plan, key)?,
        };
        if let Some(held) = held {
            return Ok(Some(held));
        }
        if abandoned_waits(&plan.names().main) == 0 {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(None)
}

/// A wait's state, shared by its thread and its caller.
#[derive(Debug, Default)]
struct Cell {
    abandoned: AtomicBool,
    /// Whether the thread finished (it counts its abandonment down itself).
    finished: Mutex<bool>,
}

/// The caller's side of a wait: dropped before the answer came, it tells
/// the thread to give up, and counts an abandoned wait on the object.
struct Waiting {
    cell: Arc<Cell>,
    path: PathBuf,
    answered: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let finished = lock(&self.cell.finished);
        if !*finished {
            self.cell.abandoned.store(true, Ordering::SeqCst);
            count_abandoned(&self.path, true);
        }
    }
}

/// Waits for `plan` until `wait`'s deadline, on a thread of its own (or,
/// past [`MAX_WAIT_THREADS`], by polling), holding a writer's gate its
/// attempt kept (`queued`) throughout.
async fn wait(plan: Plan, key: LockKey, wait: Wait, queued: Option<Gate>) -> Result<Option<Held>> {
    let deadline = wait.deadline();
    if WAIT_THREADS.fetch_add(1, Ordering::SeqCst) >= MAX_WAIT_THREADS {
        WAIT_THREADS.fetch_sub(1, Ordering::SeqCst);
        return poll(plan, key, deadline, queued).await;
    }
    // Moved into the thread; if none can be made, handed back to poll.
    let queued = Arc::new(Mutex::new(queued));
    let cell = Arc::new(Cell::default());
    let path = plan.names().main.clone();
    let (tx, rx) = oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("dlock-file-wait".to_owned())
        .spawn({
            let (cell, plan, path, key) = (cell.clone(), plan.clone(), path.clone(), key.clone());
            let deadline = deadline.map(Instant::into_std);
            let queued = queued.clone();
            move || {
                let stop = Stop {
                    abandoned: &cell.abandoned,
                    deadline,
                };
                let queued = lock(&queued).take();
                let outcome = locks::wait(&plan, &key, &stop, queued);
                // Sent to nobody, a grant is dropped here: unlocked.
                drop(tx.send(outcome));
                let mut finished = lock(&cell.finished);
                *finished = true;
                if cell.abandoned.load(Ordering::SeqCst) {
                    count_abandoned(&path, false);
                }
                WAIT_THREADS.fetch_sub(1, Ordering::SeqCst);
            }
        });
    if spawned.is_err() {
        WAIT_THREADS.fetch_sub(1, Ordering::SeqCst);
        let queued = lock(&queued).take();
        return poll(plan, key, deadline, queued).await;
    }
    let mut waiting = Waiting {
        cell,
        path,
        answered: false,
    };
    let answer = match deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline, rx).await {
            Ok(answer) => answer,
            // `waiting` drops: the thread gives up.
            Err(_) => return Ok(None),
        },
        None => rx.await,
    };
    waiting.answered = true;
    answer.map_err(|_| LockError::backend(NAME, std::io::Error::other("a wait thread panicked")))?
}

/// Polls `plan` with one attempt per backoff step (2 ms up to 100 ms)
/// until `deadline`: when no thread could be had for the wait. A writer
/// holds its gate (`queued`) from the first attempt that gets it to its
/// last.
async fn poll(
    plan: Plan,
    key: LockKey,
    deadline: Option<Instant>,
    mut queued: Option<Gate>,
) -> Result<Option<Held>> {
    let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(100));
    loop {
        let held = {
            let (plan, key) = (plan.clone(), key.clone());
            let (held, kept) = tokio::task::spawn_blocking(move || {
                locks::attempt_queued(&plan, &key, &mut queued).map(|held| (held, queued))
            })
            .await
            .map_err(|e| LockError::backend(NAME, e))??;
            queued = kept;
            held
        };
        if held.is_some() {
            return Ok(held);
        }
        let next = Instant::now() + backoff.next_delay();
        match deadline {
            Some(deadline) if deadline <= Instant::now() => return Ok(None),
            Some(deadline) => tokio::time::sleep_until(next.min(deadline)).await,
            None => tokio::time::sleep_until(next).await,
        }
    }
}
