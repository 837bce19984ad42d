//! Leader election (`Locker::elect`): one leader at a time, terms that
//! strictly increase, and a deposed leader that knows it.

use std::time::Duration;

use dlock_core::{election::Role, Election, LockError, LockKey, Locker, Token};
use tokio::time::Instant;

use super::{must, release_behind_its_back, Harness, PATIENCE};

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

/// Whether the backend reads a lock's holder; if not, checks that asking
/// is [`LockError::Unsupported`], and the caller's check ends there.
async fn holders_offered(h: &Harness, key: &LockKey) -> bool {
    if h.capabilities().await.has_fencing() {
        return true;
    }
    let locker = h.locker().await;
    let refused = locker.backend().holder(key).await;
    assert!(
        matches!(refused, Err(LockError::Unsupported { .. })),
        "[{}] reading a holder without fencing tokens: {refused:?}",
        h.name
    );
    let refused = locker.leader("x").await;
    assert!(
        matches!(refused, Err(LockError::Unsupported { .. })),
        "[{}] asking who leads without fencing tokens: {refused:?}",
        h.name
    );
    false
}

/// What `backend().holder(key)` reads, as (fence, value).
async fn holder(
    h: &Harness,
    locker: &Locker,
    key: &LockKey,
) -> Option<(Option<u64>, Option<Vec<u8>>)> {
    let read = must(h, "reading the holder", locker.backend().holder(key).await);
    read.map(|holder| (holder.fence(), holder.into_value()))
}

/// `read` is a holder that proclaimed nothing, with `fence` (or none yet,
/// on a backend that learns the fence from a proclaim).
pub(super) fn unproclaimed(
    h: &Harness,
    read: Option<(Option<u64>, Option<Vec<u8>>)>,
    fence: Option<u64>,
    why: &str,
) {
    let ok = matches!(&read, Some((f, None)) if f.is_none() || *f == fence);
    assert!(ok, "[{}] {why}: {read:?}, holder fence {fence:?}", h.name);
}

/// A proclaimed value is the holder's own, for exactly as long as it
/// holds: a stranger's token cannot write it, a release takes it, the next
/// holder shows none until it proclaims, and the old holder's token can no
/// longer write. Values are bytes, not text.
pub async fn a_proclaimed_value_lives_exactly_as_long_as_its_hold(h: &Harness) {
    let name = h.key("proclaimed");
    let key = LockKey::new(&name).expect("valid key");
    if !holders_offered(h, &key).await {
        return;
    }
    let (first, second) = (h.locker().await, h.locker().await);
    // A hold is proclaimed for through the client that took it (on some
    // backends only that client can name the hold).
    let (backend1, backend2) = (first.backend().clone(), second.backend().clone());
    assert_eq!(
        holder(h, &first, &key).await,
        None,
        "[{}] a free key has a holder",
        h.name
    );

    let g1 = must(h, "first lock", first.lock(&name).await);
    let fence1 = g1.fencing_token();
    unproclaimed(
        h,
        holder(h, &second, &key).await,
        fence1,
        "before any proclaim",
    );
    let proclaimed = must(
        h,
        "proclaim",
        backend1.proclaim(&key, g1.token(), b"one").await,
    );
    assert!(proclaimed, "[{}] the holder's proclaim was refused", h.name);
    assert_eq!(
        holder(h, &second, &key).await,
        Some((fence1, Some(b"one".to_vec()))),
        "[{}] after the holder proclaimed",
        h.name
    );
    let stranger = Token::generate();
    let written = must(
        h,
        "a stranger's proclaim",
        backend1.proclaim(&key, &stranger, b"x").await,
    );
    assert!(
        !written,
        "[{}] a token that holds nothing proclaimed",
        h.name
    );
    assert_eq!(
        holder(h, &second, &key).await,
        Some((fence1, Some(b"one".to_vec()))),
        "[{}] a stranger changed the holder's value",
        h.name
    );

    let stale = *g1.token();
    must(h, "release", g1.release().await);
    assert_eq!(
        holder(h, &second, &key).await,
        None,
        "[{}] a released key has a holder",
        h.name
    );

    // The same client holds the key again (on SQL, on the same session):
    // the last hold's value is not this one's, nor is a value whose
    // proclaim was dropped in flight once this hold is released.
    for round in 0..8 {
        let again = must(h, "lock again", first.lock(&name).await);
        unproclaimed(
            h,
            holder(h, &second, &key).await,
            again.fencing_token(),
            &format!("round {round}: the same client's last hold's value outlived it"),
        );
        let cut_short = backend1.proclaim(&key, again.token(), b"cut short");
        let _ = tokio::time::timeout(Duration::ZERO, cut_short).await;
        must(h, "release again", again.release().await);
    }

    let g2 = must(h, "second lock", second.lock(&name).await);
    let fence2 = g2.fencing_token();
    unproclaimed(
        h,
        holder(h, &first, &key).await,
        fence2,
        "the last holder's value outlived its hold",
    );
    let written = must(
        h,
        "a stale proclaim",
        backend1.proclaim(&key, &stale, b"stale").await,
    );
    assert!(!written, "[{}] a released token proclaimed", h.name);
    let bytes = [0u8, 255, b'\n', b'|', b'+', 0, b'{', b'}'];
    let proclaimed = must(
        h,
        "proclaim bytes",
        backend2.proclaim(&key, g2.token(), &bytes).await,
    );
    assert!(
        proclaimed,
        "[{}] the second holder's proclaim was refused",
        h.name
    );
    assert_eq!(
        holder(h, &first, &key).await,
        Some((fence2, Some(bytes.to_vec()))),
        "[{}] the value is not byte for byte what was proclaimed",
        h.name
    );
    release_behind_its_back(h, &second, &g2).await;
    assert_eq!(
        holder(h, &first, &key).await,
        None,
        "[{}] released behind its back",
        h.name
    );
    let written = must(
        h,
        "proclaim after the loss",
        backend2.proclaim(&key, g2.token(), b"late").await,
    );
    assert!(
        !written,
        "[{}] a token whose lock was released proclaimed",
        h.name
    );
    drop(g2);
}

/// Anyone can ask who leads: the leader's term and value, written before
/// the leadership is announced (so never missing once `leading` returns),
/// changed by a later `proclaim`, handed on with the leadership, and gone
/// when nobody leads.
pub async fn followers_read_the_leader_and_its_value(h: &Harness) {
    let name = h.key("observed");
    if !holders_offered(
        h,
        &LockKey::new(format!("election:{name}")).expect("valid key"),
    )
    .await
    {
        return;
    }
    let follower = h.locker().await;
    let read = |what: &'static str| {
        let follower = &follower;
        let name = &name;
        async move { must(h, what, follower.leader(name).await) }
    };
    assert_eq!(
        read("nobody leads").await,
        None,
        "[{}] a leader before any candidate",
        h.name
    );

    let a = must(h, "candidate a", h.locker().await.elect(&name));
    must(h, "a proclaims", a.proclaim("node-a").await);
    let term_a = must(h, "a leads", a.leading().await);
    let leader = read("a leads").await.expect("a leader");
    assert_eq!(
        (leader.term, leader.value.as_deref()),
        (term_a, Some(&b"node-a"[..])),
        "[{}] the leader as a follower reads it",
        h.name
    );
    let b = must(h, "candidate b", h.locker().await.elect(&name));
    must(h, "b proclaims", b.proclaim("node-b").await);
    assert!(!b.is_leader(), "[{}] two leaders", h.name);
    let written = must(h, "a proclaims again", a.proclaim("node-a:2").await);
    assert!(
        written,
        "[{}] the leader's proclaim was not written",
        h.name
    );
    let leader = read("a proclaimed again").await.expect("a leader");
    assert_eq!(
        leader.value.as_deref(),
        Some(&b"node-a:2"[..]),
        "[{}]",
        h.name
    );

    let leadership = must(h, "a's leadership", a.lead().await);
    assert!(
        leadership.term() == term_a && leadership.is_current(),
        "[{}] {leadership:?} in term {term_a}",
        h.name
    );
    must(h, "a resigns", a.resign().await);
    assert!(
        !leadership.is_current(),
        "[{}] a resigned leadership holds",
        h.name
    );
    let ended = tokio::time::timeout(PATIENCE, leadership.lost()).await;
    assert!(
        matches!(ended, Ok(None)),
        "[{}] a resignation ended the leadership as {ended:?}",
        h.name
    );
    let term_b = must(h, "b leads", b.leading().await);
    assert!(term_b > term_a, "[{}] term {term_b} after {term_a}", h.name);
    let leader = read("b leads").await.expect("a leader");
    assert_eq!(
        (leader.term, leader.value.as_deref()),
        (term_b, Some(&b"node-b"[..])),
        "[{}] the next leader as a follower reads it",
        h.name
    );
    assert_eq!(
        b.leader().await.ok().flatten(),
        Some(leader),
        "[{}] the leader's own read",
        h.name
    );
    must(h, "b resigns", b.resign().await);
    assert_eq!(
        read("nobody leads").await,
        None,
        "[{}] a leader after everyone resigned",
        h.name
    );
}

/// A proclaimed value lasts as long as the hold, however many leases
/// that is: the watchdog's renewals keep it with the lock.
pub async fn a_proclaimed_value_lasts_while_the_lock_is_renewed(h: &Harness) {
    let name = h.key("proclaimed-renewed");
    let key = LockKey::new(&name).expect("valid key");
    if !holders_offered(h, &key).await {
        return;
    }
    let lease = Duration::from_millis(600);
    let holder_client = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let reader = h.locker().await;
    let guard = must(h, "lock", holder_client.lock(&name).await);
    let fence = guard.fencing_token();
    let backend = holder_client.backend();
    let written = must(
        h,
        "proclaim",
        backend.proclaim(&key, guard.token(), b"kept").await,
    );
    assert!(written, "[{}] the holder's proclaim was refused", h.name);
    let started = Instant::now();
    while started.elapsed() < lease * 4 {
        assert_eq!(
            holder(h, &reader, &key).await,
            Some((fence, Some(b"kept".to_vec()))),
            "[{}] the value {:?} into a renewed hold",
            h.name,
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!guard.is_lost(), "[{}] the renewed guard was lost", h.name);
    must(h, "release", guard.release().await);
}

/// A follower outside the election observes every change of leader, in
/// order, woken by the change: each leader with its term and value as it
/// is elected, and nobody once everyone resigned.
pub async fn followers_observe_every_change_of_leader(h: &Harness) {
    let name = h.key("watched");
    if !holders_offered(
        h,
        &LockKey::new(format!("election:{name}")).expect("valid key"),
    )
    .await
    {
        return;
    }
    let follower = h.locker().await;
    let mut leaders = must(h, "observe", follower.observe(&name).await);
    assert_eq!(
        *leaders.borrow_and_update(),
        None,
        "[{}] a leader before any candidate",
        h.name
    );
    // Everything the follower was shown, in order.
    let mut shown = leaders.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let log = tokio::spawn(async move {
        let mut seen = Vec::new();
        tokio::pin!(stopped);
        loop {
            let stopping = tokio::select! {
                biased;
                changed = shown.changed() => match changed {
                    Ok(()) => false,
                    Err(_) => break,
                },
                _ = &mut stopped => true,
            };
            // Stopped with a change not yet read (the runtime's task
            // budget can leave `changed` pending for a poll even so):
            // the change is logged before the log ends.
            if stopping && !shown.has_changed().unwrap_or(false) {
                break;
            }
            let leader = shown.borrow_and_update().clone();
            seen.push(leader.map(|l| (l.term, l.value)));
            if stopping {
                break;
            }
        }
        seen
    });
    let shows = |term: u64, value: &'static str| {
        let mut leaders = leaders.clone();
        async move {
            let wanted = Some((term, Some(value.as_bytes().to_vec())));
            let shown =
                leaders.wait_for(|l| l.as_ref().map(|l| (l.term, l.value.clone())) == wanted);
            let shown = matches!(tokio::time::timeout(PATIENCE, shown).await, Ok(Ok(_)));
            assert!(
                shown,
                "[{}] the follower was not shown term {term} led by {value} within {PATIENCE:?}: {:?}",
                h.name,
                *leaders.borrow()
            );
        }
    };
    let mut candidates = Vec::new();
    for node in ["node-a", "node-b", "node-c"] {
        let election = must(h, "a candidate", h.locker().await.elect(&name));
        must(
            h,
            "proclaim",
            election.proclaim(format!("{node}:start")).await,
        );
        candidates.push((node, election));
        if candidates.len() == 1 {
            let term = must(h, "the first leads", candidates[0].1.leading().await);
            shows(term, "node-a:start").await;
        }
    }
    // Once the others stand in line, only the leader's new value changes:
    // the follower must be woken by that alone.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (node, election) in &candidates {
        must(h, "proclaim again", election.proclaim(*node).await);
    }
    let mut terms = Vec::new();
    for _ in 0..3 {
        let at = candidates
            .iter()
            .position(|(_, e)| e.is_leader())
            .unwrap_or_else(|| panic!("[{}] no candidate leads", h.name));
        let (node, leader) = candidates.remove(at);
        let term = leader.term().expect("a leader's term");
        shows(term, node).await;
        terms.push(term);
        must(h, "the leader resigns", leader.resign().await);
        // Whichever candidate stood first in line leads next.
        let started = Instant::now();
        while !candidates.is_empty()
            && !candidates.iter().any(|(_, e)| e.is_leader())
            && started.elapsed() < PATIENCE
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let nobody = tokio::time::timeout(PATIENCE, leaders.wait_for(Option::is_none)).await;
    assert!(
        matches!(nobody, Ok(Ok(_))),
        "[{}] the follower was not shown that nobody leads",
        h.name
    );
    let _ = stop.send(());
    let seen = log.await.expect("the follower's log");
    // Each leader was shown while it led (`shows` above, on a receiver of
    // its own). A watch keeps only the latest value, so this log, read by
    // a task a loaded machine may not run between two changes, can skip
    // one; what it must never show is an older leader after a newer one,
    // or a term nobody had.
    let shown_terms: Vec<u64> = seen.iter().flatten().map(|(term, _)| *term).collect();
    let mut distinct = shown_terms.clone();
    distinct.dedup();
    assert!(
        distinct.windows(2).all(|w| w[0] < w[1]) && distinct.iter().all(|t| terms.contains(t)),
        "[{}] the leaders shown, in order: {seen:?}, of {terms:?}",
        h.name
    );
    assert_eq!(
        seen.last(),
        Some(&None),
        "[{}] the last thing shown: {seen:?}",
        h.name
    );
}

/// A leader whose lock is taken from it (released behind its back with
/// its own token, through its own client) is told: its leadership ends as
/// lost within a lease, it says so, and another candidate leads with a
/// greater term.
pub async fn a_deposed_leader_is_told(h: &Harness) {
    if !offered(h).await {
        return;
    }
    let name = h.key("deposed");
    let lease = Duration::from_secs(3);
    let client = h.locker_with(|b| b.watchdog_lease(lease)).await;
    let leader = must(h, "a candidate", client.elect(&name));
    let leadership = must(h, "it leads", leader.lead().await);
    let other = must(h, "another candidate", h.locker().await.elect(&name));
    let key = LockKey::new(format!("election:{name}")).expect("valid key");
    let token = leader.token().expect("the leader's token");
    // The answer may be `NotHeld`: on a backend that tells the guard as
    // the release starts (etcd), the deposed campaign's own release of the
    // dropped guard can delete the key first. Either way the lock is gone,
    // which the next leader's term shows below.
    must(
        h,
        "release behind the leader's back",
        client
            .backend()
            .release(&key, dlock_core::backend::Mode::Exclusive, &token)
            .await,
    );
    let told = tokio::time::timeout(PATIENCE, leadership.lost()).await;
    assert!(
        matches!(told, Ok(Some(_))),
        "[{}] the deposed leader was not told: {told:?}",
        h.name
    );
    // The deposed candidate campaigns again at once, and may already
    // lead again, in a later term: never in the lost one.
    let term = leadership.term();
    assert!(
        !leadership.is_current() && leader.term().is_none_or(|t| t > term),
        "[{}] the deposed leader still says it leads in term {term}: {:?}",
        h.name,
        leader.term()
    );
    assert!(
        match leader.role() {
            Role::Deposed { term: t, .. } => t == term,
            Role::Candidate => true,
            Role::Leader { term: t } => t > term,
            _ => false,
        },
        "[{}] the deposed leader's role: {:?}",
        h.name,
        leader.role()
    );
    // The next leader (either candidate: the deposed one campaigns again,
    // and may stand first in line) leads with a greater term.
    let started = Instant::now();
    let next = loop {
        let next = other.term().or_else(|| leader.term());
        if next.is_some() || started.elapsed() > PATIENCE {
            break next;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let Some(next) = next else {
        panic!("[{}] nobody led after the deposition", h.name);
    };
    assert!(
        next > leadership.term(),
        "[{}] term {next} after {}",
        h.name,
        leadership.term()
    );
    must(h, "resign", other.resign().await);
    must(h, "resign", leader.resign().await);
}

/// Dropping an election (rather than resigning it) tells every watcher of
/// its role that it resigned, and its leadership that it ended, as
/// `resign` does; the next candidate then leads.
pub async fn dropping_an_election_says_resigned(h: &Harness) {
    if !offered(h).await {
        return;
    }
    let name = h.key("dropped");
    let (first, second) = (h.locker().await, h.locker().await);
    let leader = must(h, "a candidate", first.elect(&name));
    let leadership = must(h, "it leads", leader.lead().await);
    let mut changes = leader.changes();
    let next = must(h, "another candidate", second.elect(&name));
    drop(leader);
    let resigned = tokio::time::timeout(PATIENCE, changes.wait_for(|r| *r == Role::Resigned))
        .await
        .map(|r| r.map(|_| ()));
    assert!(
        matches!(resigned, Ok(Ok(()))),
        "[{}] a dropped election's role: {:?}",
        h.name,
        *changes.borrow()
    );
    let ended = tokio::time::timeout(PATIENCE, leadership.lost()).await;
    assert_eq!(ended, Ok(None), "[{}] a dropped leadership ended", h.name);
    must(h, "the next leads", next.leading().await);
    must(h, "resign", next.resign().await);
}

/// A candidate on a locker whose default lease is fixed (and short) still
/// leads for as long as it lives: elections renew their lock, so the
/// leader is not deposed at each lease's end with a new term each time.
pub async fn an_election_renews_whatever_the_default_lease(h: &Harness) {
    if !offered(h).await {
        return;
    }
    let name = h.key("fixed-default");
    // Short, and long enough that a renewal (due each third of it) has
    // room on a loaded machine.
    let lease = Duration::from_secs(1);
    let locker = h.locker_with(|b| b.lease(lease)).await;
    let election = must(h, "a candidate", locker.elect(&name));
    let term = must(h, "it leads", election.leading().await);
    tokio::time::sleep(lease * 4).await;
    assert_eq!(
        election.term(),
        Some(term),
        "[{}] the leader's term after four default leases: {:?}",
        h.name,
        election.role()
    );
    must(h, "resign", election.resign().await);
}
