//! Leader election (`Locker::elect`): one leader at a time, terms that
//! strictly increase, and a deposed leader that knows it.

use std::time::Duration;

use dlock_core::{election::Role, Election, LockError};
use tokio::time::Instant;

use super::{must, Harness, PATIENCE};

/// Whether the backend offers elections; if not, checks that asking is
/// [`LockError::Unsupported`], and the caller's check ends there.
async fn offered(h: &Harness) -> bool {
    if h.capabilities().await.has_fencing() {
        return true;
    }
    let refused = h.locker().await.elect("x");
    assert!(
        matches!(refused, Err(LockError::Unsupported { .. })),
        "[{}] an election without fencing tokens: {refused:?}",
        h.name
    );
    false
}

/// The candidates that lead now, by their own account.
fn leaders(candidates: &[Option<Election>]) -> Vec<usize> {
    (0..candidates.len())
        .filter(|&i| candidates[i].as_ref().is_some_and(Election::is_leader))
        .collect()
}

/// Three candidates of three clients: exactly one leads at a time, and
/// when each leader resigns in turn the next one leads with a greater
/// term, until none is left. Every candidate's `changes()` saw its own
/// leadership.
pub async fn an_election_has_one_leader_at_a_time_and_rising_terms(h: &Harness) {
    if !offered(h).await {
        return;
    }
    let name = h.key("election");
    let mut candidates = Vec::new();
    let mut watches = Vec::new();
    for _ in 0..3 {
        let election = must(h, "a candidate", h.locker().await.elect(&name));
        watches.push(election.changes());
        candidates.push(Some(election));
    }
    let mut last_term = 0;
    for round in 0..3 {
        let started = Instant::now();
        let mut now = leaders(&candidates);
        while now.is_empty() && started.elapsed() < PATIENCE {
            tokio::time::sleep(Duration::from_millis(5)).await;
            now = leaders(&candidates);
        }
        assert_eq!(now.len(), 1, "[{}] round {round}: leaders {now:?}", h.name);
        let leader = candidates[now[0]].take().expect("the leader");
        let term = leader.term().expect("a leader's term");
        assert!(
            term > last_term,
            "[{}] round {round}: term {term} after {last_term}",
            h.name
        );
        last_term = term;
        assert_eq!(leader.role(), Role::Leader { term }, "[{}]", h.name);
        must(h, "the leader resigns", leader.resign().await);
        assert!(
            leaders(&candidates).len() <= 1,
            "[{}] two leaders after a resignation",
            h.name
        );
    }
    for (i, watch) in watches.iter().enumerate() {
        assert_eq!(
            *watch.borrow(),
            Role::Resigned,
            "[{}] candidate {i} did not see its resignation",
            h.name
        );
    }
}
