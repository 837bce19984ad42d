//! This process's turn at a key: the one place a backend's tasks line up
//! before they talk to the server.

use std::{
    collections::HashMap,
    fmt,
    hash::Hash,
    sync::{Arc, Mutex, MutexGuard},
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Wait;

/// How many shares a key's turn has: a [`Share::Shared`] turn takes one,
/// a [`Share::Alone`] turn takes them all.
const SHARES: u32 = 1 << 16;

/// What a turn shares with the other tasks of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// The key's turn alone (a plain lock, a writer, permits).
    Alone,
    /// The key's turn beside other shared turns (readers of one process,
    /// whose server session holds the key shared once per reader).
    Shared,
}

impl Share {
    fn weight(self) -> u32 {
        match self {
            Share::Alone => SHARES,
            Share::Shared => 1,
        }
    }
}

/// Per key, this process's line of tasks that want to wait for it on the
/// server, first come, first served: a release wakes one contender per
/// process, not every task of it (a herd of one process's tasks would
/// split Redlock's votes, or hold a SQL session each while they wait).
///
/// A key's line is forgotten once nobody holds or waits for its turn.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::{LocalTurns, Share, Wait};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let turns = LocalTurns::new();
/// let first = turns.take(&"k", Share::Alone, Wait::No).await.expect("free");
/// assert!(!turns.others(&"k"));
/// assert!(turns.take(&"k", Share::Alone, Wait::No).await.is_none());
/// drop(first);
/// assert!(turns.take(&"k", Share::Alone, Wait::No).await.is_some());
/// assert!(turns.is_empty());
/// # }
/// ```
pub struct LocalTurns<K: Hash + Eq + Clone + Send + Sync + 'static> {
    lines: Arc<Mutex<HashMap<K, Arc<Semaphore>>>>,
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Default for LocalTurns<K> {
    fn default() -> Self {
        LocalTurns {
            lines: Arc::default(),
        }
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> fmt::Debug for LocalTurns<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalTurns")
            .field("keys", &lock(&self.lines).len())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> LocalTurns<K> {
    /// No key's line yet.
    pub fn new() -> Self {
        LocalTurns::default()
    }

    /// This process's turn at `key`, taken as `share`, when every task
    /// before it in the key's line has given its turn back; `None` if
    /// `wait` ran out first (`Wait::No`: at once unless the turn is free).
    /// Dropping the future leaves the line.
    pub async fn take(&self, key: &K, share: Share, wait: Wait) -> Option<LocalTurn<K>> {
        // Dropped last, also when this future is: a line nobody holds or
        // waits for any more is forgotten.
        let _forget = Forget(&self.lines, key);
        let line = lock(&self.lines)
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(SHARES as usize)))
            .clone();
        let weight = share.weight();
        let permit = match wait {
            Wait::No => line.clone().try_acquire_many_owned(weight).ok(),
            Wait::Until(deadline) => {
                tokio::time::timeout_at(deadline, line.clone().acquire_many_owned(weight))
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
            // The semaphore is never closed.
            Wait::Forever => line.clone().acquire_many_owned(weight).await.ok(),
        };
        drop(line);
        permit.map(|permit| LocalTurn {
            permit: Some(permit),
            key: key.clone(),
            lines: self.lines.clone(),
        })
    }

    /// Whether a task of this process other than the caller (which holds
    /// a turn at `key`) holds or waits for a turn at it.
    pub fn others(&self, key: &K) -> bool {
        lock(&self.lines)
            .get(key)
            // The map's, the caller's permit's, and anyone else's.
            .is_some_and(|line| Arc::strong_count(line) > 2)
    }

    /// Whether a task of this process holds or waits for a turn at `key`
    /// (the caller holds none).
    pub fn busy(&self, key: &K) -> bool {
        let mut lines = lock(&self.lines);
        match lines.get(key) {
            // Only the map has it: its last task left while it was being
            // handed the turn. Forgotten here.
            Some(line) if Arc::strong_count(line) == 1 => {
                lines.remove(key);
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Whether no key has a line (every turn was given back).
    pub fn is_empty(&self) -> bool {
        lock(&self.lines).is_empty()
    }
}

/// Sweeps its key's line when dropped.
struct Forget<'a, K: Hash + Eq>(&'a Mutex<HashMap<K, Arc<Semaphore>>>, &'a K);

impl<K: Hash + Eq> Drop for Forget<'_, K> {
    fn drop(&mut self) {
        sweep(self.0, self.1);
    }
}

/// Forgets `key`'s line if nobody holds or waits for its turn: only the
/// map has it.
fn sweep<K: Hash + Eq>(lines: &Mutex<HashMap<K, Arc<Semaphore>>>, key: &K) {
    let mut lines = lock(lines);
    if lines
        .get(key)
        .is_some_and(|line| Arc::strong_count(line) == 1)
    {
        lines.remove(key);
    }
}

/// A task's turn at a key (see [`LocalTurns::take`]); dropping it gives
/// the turn to the next task in the key's line.
pub struct LocalTurn<K: Hash + Eq + Clone + Send + Sync + 'static> {
    permit: Option<OwnedSemaphorePermit>,
    key: K,
    lines: Arc<Mutex<HashMap<K, Arc<Semaphore>>>>,
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> fmt::Debug for LocalTurn<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalTurn").finish_non_exhaustive()
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Drop for LocalTurn<K> {
    fn drop(&mut self) {
        // The permit holds the line: give it back first, then the line
        // may be only the map's.
        drop(self.permit.take());
        sweep(&self.lines, &self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn turns_are_first_come_first_served() {
        let turns = Arc::new(LocalTurns::new());
        let first = turns.take(&1, Share::Alone, Wait::Forever).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for i in 0..5 {
            let (turns, order) = (turns.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let turn = turns.take(&1, Share::Alone, Wait::Forever).await.unwrap();
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(1)).await;
                drop(turn);
            }));
            // Each in line before the next.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(first);
        for waiter in waiters {
            waiter.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
        assert!(turns.is_empty(), "a line outlived its last turn");
    }

    #[tokio::test(start_paused = true)]
    async fn shared_turns_go_together_and_an_alone_turn_waits_for_them() {
        let turns = LocalTurns::new();
        let r1 = turns.take(&"k", Share::Shared, Wait::No).await.unwrap();
        let r2 = turns.take(&"k", Share::Shared, Wait::No).await.unwrap();
        assert!(turns.others(&"k"));
        assert!(turns.take(&"k", Share::Alone, Wait::No).await.is_none());
        let deadline = Instant::now() + Duration::from_millis(50);
        assert!(turns
            .take(&"k", Share::Alone, Wait::Until(deadline))
            .await
            .is_none());
        assert_eq!(Instant::now(), deadline);
        assert!(turns.busy(&"k"));
        drop((r1, r2));
        assert!(!turns.busy(&"k"));
        let alone = turns.take(&"k", Share::Alone, Wait::No).await.unwrap();
        assert!(!turns.others(&"k"));
        drop(alone);
        assert!(turns.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_wait_leaves_the_line() {
        let turns = Arc::new(LocalTurns::new());
        let held = turns.take(&"k", Share::Alone, Wait::No).await.unwrap();
        let waiting = tokio::spawn({
            let turns = turns.clone();
            async move {
                turns
                    .take(&"k", Share::Alone, Wait::Forever)
                    .await
                    .map(drop)
            }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(turns.others(&"k"));
        waiting.abort();
        let _ = waiting.await;
        assert!(!turns.others(&"k"), "the dropped wait is still in line");
        drop(held);
        assert!(turns.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_dropped_after_it_was_handed_the_turn_forgets_the_line() {
        let turns = Arc::new(LocalTurns::new());
        let held = turns.take(&"k", Share::Alone, Wait::No).await.unwrap();
        let waiting = tokio::spawn({
            let turns = turns.clone();
            async move {
                turns
                    .take(&"k", Share::Alone, Wait::Forever)
                    .await
                    .map(drop)
            }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        // The turn passes to the waiter, which is dropped before it runs.
        drop(held);
        waiting.abort();
        let _ = waiting.await;
        assert!(turns.is_empty(), "a line nobody holds or waits for is kept");
    }
}
