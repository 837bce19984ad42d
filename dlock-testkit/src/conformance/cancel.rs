//! Cancel safety: a `lock()`, `try_lock()`, `DistMutex::lock()` or
//! `release()` future dropped at any point leaves nothing behind on the
//! servers.

use std::{sync::Arc, time::Duration};

use dlock_core::{backend::Mode, DistMutex, LockError, LockGuard, LockOptions};
use tokio::time::Instant;

use super::{must, patient, Harness, PATIENCE};
use crate::Rng;

/// 240 futures (`lock`, `try_lock`, `DistMutex::lock`, `release`) dropped at
/// random points (timeouts of 0–25 ms) while the key is contended leave no
/// orphan: the key is free again at once.
pub async fn cancel_safety(h: &Harness) {
    cancel_storm(h, 240).await;
}

/// A client's locks are untouched by the futures it drops half-way on
/// other keys. In each of 12 rounds a new client (new connections: their
/// first statements are the ones a server prepares) holds a lock in every
/// mode the backend offers, and 32 acquisitions and releases on it (half
/// of fresh keys, half of keys another client holds, a quarter of them
/// from a third client) are aborted together at a random point (within
/// 200 yields, or 1–3 ms). Then the client still holds every lock, nobody
/// else can take them, and its next statements work. A client may put
/// many locks on one connection: a statement dropped half-way must leave
/// that connection neither broken nor in the middle of an answer.
pub async fn dropped_futures_cost_the_clients_other_locks_nothing(h: &Harness) {
    let mut rng = Rng::from_env();
    let seed = rng.seed();
    let capabilities = h.capabilities().await;
    let modes: Vec<Mode> = [
        Mode::Exclusive,
        Mode::Read,
        Mode::Write,
        Mode::Permits { count: 1, limit: 2 },
    ]
    .into_iter()
    .filter(|m| capabilities.supports(*m))
    .collect();
    let (other, rival) = (h.locker().await, h.locker().await);
    let mut contended = Vec::new();
    for (i, mode) in modes.iter().enumerate() {
        let key = h.key(&format!("contended-{i}"));
        let guard = must(
            h,
            "a contended key",
            other.lock_mode(&key, exclusive_for(*mode), patient()).await,
        );
        contended.push((key, guard));
    }
    for round in 0..12 {
        let client = h.locker().await;
        let mut held: Vec<(String, Mode, LockGuard)> = Vec::new();
        for (i, mode) in modes.iter().enumerate() {
            let key = h.key(&format!("bystander-{round}-{i}"));
            let guard = must(
                h,
                "a bystander lock",
                client.lock_mode(&key, *mode, patient()).await,
            );
            held.push((key, *mode, guard));
        }
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let m = (i / 2) % modes.len();
                let (key, locker) = if i % 2 == 0 {
                    (h.key(&format!("dropped-{round}-{i}")), client.clone())
                } else if i % 4 == 1 {
                    (contended[m].0.clone(), client.clone())
                } else {
                    (contended[m].0.clone(), rival.clone())
                };
                let mode = modes[m];
                tokio::spawn(async move {
                    if let Ok(guard) = locker.lock_mode(&key, mode, patient()).await {
                        let _ = guard.release().await;
                    }
                })
            })
            .collect();
        if round % 2 == 0 {
            for _ in 0..rng.below(200) {
                tokio::task::yield_now().await;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(1 + rng.below(3))).await;
        }
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
        // The client's next statements, after whatever the dropped ones
        // left on its connections.
        for (i, mode) in modes.iter().enumerate() {
            let key = h.key(&format!("after-{round}-{i}"));
            let guard = must(
                h,
                "a lock after the drops",
                client.lock_mode(&key, *mode, patient()).await,
            );
            must(h, "its release", guard.release().await);
        }
        for (key, mode, guard) in &held {
            assert!(
                !guard.is_lost(),
                "[{}] round {round}: the {mode:?} lock on {key} was lost to futures dropped \
                 beside it (seed {seed})",
                h.name
            );
            let taken = must(
                h,
                "another client's try",
                other
                    .try_lock_mode(key, exclusive_for(*mode), LockOptions::new())
                    .await,
            );
            assert!(
                taken.is_none(),
                "[{}] round {round}: another client took the {mode:?} lock on {key} while it \
                 was held (seed {seed})",
                h.name
            );
        }
        for (_, _, guard) in held {
            must(h, "a bystander's release", guard.release().await);
        }
    }
    drop(contended);
}

/// The mode of `mode`'s key that excludes every holder of it.
fn exclusive_for(mode: Mode) -> Mode {
    match mode {
        Mode::Read => Mode::Write,
        Mode::Permits { limit, .. } => Mode::Permits {
            count: limit,
            limit,
        },
        _ => mode,
    }
}

/// `attempts` futures from 4 clients, dropped at random points (timeouts of
/// 0–25 ms) while another client keeps taking the key, leave no orphan:
/// afterwards the key is free at once, for `lock` and `try_lock`. The
/// futures are, in turn, `lock`, `try_lock`, `DistMutex::lock`, and the
/// `release` of a lock taken by a `lock` with the same cut-off.
pub async fn cancel_storm(h: &Harness, attempts: usize) {
    let key = h.key("cancel");
    let mut rng = Rng::from_env();
    let seed = rng.seed();
    let holder = h.locker().await;
    let stop = Arc::new(tokio::sync::Notify::new());
    let cycling = tokio::spawn({
        let (holder, key, stop) = (holder.clone(), key.clone(), stop.clone());
        async move {
            let mut cycles = 0u32;
            loop {
                let guard = tokio::select! {
                    g = holder.lock_with(&key, LockOptions::new().wait(Duration::from_secs(5))) => g,
                    _ = stop.notified() => return cycles,
                };
                if let Ok(g) = guard {
                    cycles += 1;
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    drop(g);
                }
                if cycles > 10_000 {
                    return cycles;
                }
            }
        }
    });
    let mut clients = Vec::new();
    for _ in 0..4 {
        let locker = h.locker().await;
        let mutex = Arc::new(DistMutex::new(&locker, key.clone(), ()));
        clients.push((locker, mutex));
    }
    let mut tasks = Vec::new();
    for i in 0..attempts {
        let (locker, mutex) = clients[i % clients.len()].clone();
        let key = key.clone();
        let after = Duration::from_millis(rng.below(26));
        let hold = Duration::from_millis(rng.below(3));
        // Each kind of future a caller may drop half-way, in turn.
        let kind = (i / clients.len()) % 4;
        tasks.push(tokio::spawn(async move {
            let cut_off = |what: &str, e: LockError| -> bool {
                panic!("{what} failed instead of being cancelled: {e}")
            };
            match kind {
                0 => match tokio::time::timeout(after, locker.lock(&key)).await {
                    Ok(Ok(guard)) => {
                        tokio::time::sleep(hold).await;
                        drop(guard);
                        true
                    }
                    Ok(Err(e)) => cut_off("lock", e),
                    Err(_) => false,
                },
                1 => match tokio::time::timeout(after, locker.try_lock(&key)).await {
                    Ok(Ok(Some(guard))) => {
                        tokio::time::sleep(hold).await;
                        drop(guard);
                        true
                    }
                    Ok(Ok(None)) | Err(_) => false,
                    Ok(Err(e)) => cut_off("try_lock", e),
                },
                2 => match tokio::time::timeout(after, mutex.lock()).await {
                    Ok(Ok(guard)) => {
                        tokio::time::sleep(hold).await;
                        drop(guard);
                        true
                    }
                    Ok(Err(e)) => cut_off("DistMutex::lock", e),
                    Err(_) => false,
                },
                // A release dropped half-way still runs to its end.
                _ => match tokio::time::timeout(after, locker.lock(&key)).await {
                    Ok(Ok(guard)) => {
                        tokio::time::sleep(hold).await;
                        // Cut off after 0 to 2.5 ms: before, during or after
                        // the server's answer.
                        let _ = tokio::time::timeout(after / 10, guard.release()).await;
                        true
                    }
                    Ok(Err(e)) => cut_off("lock before a release", e),
                    Err(_) => false,
                },
            }
        }));
        if i % 8 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let mut acquired = 0;
    for a in tasks {
        acquired += usize::from(a.await.expect("attempt task panicked"));
    }
    stop.notify_one();
    let cycles = cycling.await.expect("holder task panicked");
    assert!(
        cycles > 0,
        "[{}] the holder never got the lock (seed {seed})",
        h.name
    );

    // Drop-releases are scheduled, so allow them a moment; an orphan would
    // hold the key for the whole lease (30 s) or forever.
    let probe = h.locker().await;
    let start = Instant::now();
    let free = probe.lock_with(&key, patient()).await;
    assert!(
        free.is_ok(),
        "[{}] key still blocked after the cancel storm ({acquired} acquired, seed {seed}): {free:?}",
        h.name
    );
    assert!(start.elapsed() < PATIENCE);
    drop(free);
    let start = Instant::now();
    let mut again = None;
    while again.is_none() && start.elapsed() < PATIENCE {
        again = must(
            h,
            "try_lock after the storm",
            h.locker().await.try_lock(&key).await,
        );
        if again.is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(
        again.is_some(),
        "[{}] an orphan queue entry blocks try_lock (seed {seed})",
        h.name
    );
}
