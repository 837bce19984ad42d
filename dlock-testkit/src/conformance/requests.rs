//! Asking a holder to let go: a release request reaches the grant it
//! names, and only it; the holder decides.

use std::time::Duration;

use dlock_core::LockError;

use super::{must, patient, taken, Harness, PATIENCE};

/// Whether the backend can say who holds a key (release requests need
/// it); if not, checks that asking is refused, typed.
async fn offered(h: &Harness, key: &str) -> bool {
    if h.capabilities().await.has_fencing() {
        return true;
    }
    let asked = h.locker().await.request_release(key).await;
    assert!(
        matches!(asked, Err(LockError::Unsupported { .. })),
        "[{}] a release request without holder reads: {asked:?}",
        h.name
    );
    false
}

/// A holder asked to let go hears it, and keeps its lock while it does
/// not; the next holder is not asked; nobody holding, nobody is asked.
pub async fn a_release_request_reaches_its_holder_who_decides(h: &Harness) {
    let key = h.key("asked");
    if !offered(h, &key).await {
        return;
    }
    let (holder, asker, other) = (h.locker().await, h.locker().await, h.locker().await);
    let free = must(
        h,
        "asking about a free key",
        asker.request_release(&key).await,
    );
    assert!(!free, "[{}] a request asked nobody", h.name);
    let guard = must(h, "lock", holder.lock_with(&key, patient()).await);
    let asked = must(h, "request a release", asker.request_release(&key).await);
    assert!(asked, "[{}] the request found no holder", h.name);
    match tokio::time::timeout(PATIENCE, guard.release_requested()).await {
        Ok(heard) => must(h, "hear the request", heard),
        Err(_) => panic!("[{}] the holder never heard the request", h.name),
    }
    // Heard, and ignored: the lock is still the holder's alone.
    taken(
        h,
        "try_lock beside the asked holder",
        &other,
        &key,
        "a release request freed the key",
    )
    .await;
    assert!(
        !guard.is_lost(),
        "[{}] the request cost the holder its lock",
        h.name
    );
    // A request names its grant where the holder's fence can be read
    // (elsewhere it asks whoever holds the key while it stands).
    let named = must(h, "read the holder", other.holder(&key).await)
        .and_then(|holder| holder.fence())
        .is_some();
    must(h, "release", guard.release().await);
    let next = must(h, "the next holder", other.lock_with(&key, patient()).await);
    let asked_next =
        tokio::time::timeout(Duration::from_millis(500), next.release_requested()).await;
    assert!(
        !named || asked_next.is_err(),
        "[{}] the next holder was asked too: {asked_next:?}",
        h.name
    );
    must(h, "release the next", next.release().await);
}

/// A leader asked to step down hears it; when it resigns, another
/// candidate leads.
pub async fn a_leader_asked_to_step_down_hands_over(h: &Harness) {
    let name = h.key("step-down");
    if !offered(h, &name).await {
        return;
    }
    let (first, second, deployer) = (h.locker().await, h.locker().await, h.locker().await);
    let leading = must(h, "elect the first", first.elect(&name));
    let leadership = must(h, "the first leads", leading.lead().await);
    let waiting = must(h, "elect the second", second.elect(&name));
    let asked = must(h, "ask the leader", deployer.request_step_down(&name).await);
    assert!(asked, "[{}] the request found no leader", h.name);
    match tokio::time::timeout(PATIENCE, leadership.release_requested()).await {
        Ok(heard) => must(h, "hear the request", heard),
        Err(_) => panic!("[{}] the leader never heard the request", h.name),
    }
    assert!(
        leadership.is_current(),
        "[{}] asking deposed the leader",
        h.name
    );
    must(h, "resign", leading.resign().await);
    match tokio::time::timeout(PATIENCE, waiting.lead()).await {
        Ok(next) => {
            let next = must(h, "the second leads", next);
            assert!(
                next.term() > leadership.term(),
                "[{}] the term did not rise",
                h.name
            );
        }
        Err(_) => panic!(
            "[{}] no candidate led after the leader stepped down",
            h.name
        ),
    }
}
