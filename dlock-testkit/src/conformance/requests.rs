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
    let asked = h.locker().await.request_release(key).await.map(|_| ());
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
    assert!(free.is_none(), "[{}] a request asked nobody", h.name);
    let guard = must(h, "lock", holder.lock_with(&key, patient()).await);
    // Withdrawn at once: a holder that listens later hears nothing.
    let withdrawn = must(h, "request a release", asker.request_release(&key).await);
    let withdrawn = withdrawn.unwrap_or_else(|| panic!("[{}] the request found no holder", h.name));
    must(h, "withdraw the request", withdrawn.withdraw().await);
    let withdrawn =
        tokio::time::timeout(Duration::from_millis(300), guard.release_requested()).await;
    assert!(
        withdrawn.is_err(),
        "[{}] a withdrawn request was heard: {withdrawn:?}",
        h.name
    );
    // Listening before the request is made, and after.
    let (heard, request) = tokio::join!(
        tokio::time::timeout(PATIENCE, guard.release_requested()),
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            must(h, "request a release", asker.request_release(&key).await)
        }
    );
    match heard {
        Ok(heard) => must(h, "hear the request", heard),
        Err(_) => panic!("[{}] the holder never heard the request", h.name),
    }
    let request = request.unwrap_or_else(|| panic!("[{}] the request found no holder", h.name));
    match tokio::time::timeout(PATIENCE, guard.release_requested()).await {
        Ok(heard) => must(h, "hear the request again", heard),
        Err(_) => panic!("[{}] a standing request was not heard", h.name),
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
    // The asker waits already when the holder lets go.
    let (answered, ()) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(3), request.answered()),
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            must(h, "release", guard.release().await);
        }
    );
    match answered {
        Ok(answered) => must(h, "see the holder let go", answered),
        Err(_) => panic!(
            "[{}] the asker did not see the holder let go within 3 s",
            h.name
        ),
    }
    let next = must(h, "the next holder", other.lock_with(&key, patient()).await);
    let asked_next =
        tokio::time::timeout(Duration::from_millis(500), next.release_requested()).await;
    assert!(
        !named || asked_next.is_err(),
        "[{}] the next holder was asked too: {asked_next:?}",
        h.name
    );
    must(h, "release the next", next.release().await);
    drop(request);
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
    let request = must(h, "ask the leader", deployer.request_step_down(&name).await);
    let request = request.unwrap_or_else(|| panic!("[{}] the request found no leader", h.name));
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
    match tokio::time::timeout(PATIENCE, request.answered()).await {
        Ok(answered) => must(h, "see the leader step down", answered),
        Err(_) => panic!("[{}] the asker never saw the leader step down", h.name),
    }
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
