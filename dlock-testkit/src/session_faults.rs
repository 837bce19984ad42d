//! Fault checks shared by the backends whose locks live on a client
//! session (etcd, ZooKeeper): a release cut off by the network, a token
//! given up with [`Backend::abandon`](dlock_core::backend::Backend::abandon), and fencing tokens across a server
//! restart.

use std::time::Duration;

use dlock_core::{
    backend::{DynBackend, Mode},
    LockKey, LockOptions, Locker,
};
use tokio::time::Instant;

use crate::fixture::{FixtureError, TcpProxy};

/// Drops a guard of `cut_off` (whose connections go through `proxy`)
/// while `proxy` is blocked for `cut`, then checks that
/// [`wait_for_releases`](Locker::wait_for_releases) waited through the cut,
/// and that `other` gets the key soon after the network is back (the
/// session outlives the cut, so without a release sent again it would hold
/// the key for as long as it lives).
///
/// # Panics
///
/// When a check fails.
pub async fn check_release_cut_off_then_back(
    cut_off: &Locker,
    other: &Locker,
    proxy: &TcpProxy,
    cut: Duration,
) {
    let guard = cut_off.lock("cut-release").await.unwrap();
    proxy.block();
    drop(guard);
    tokio::time::sleep(cut).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(100), cut_off.wait_for_releases())
            .await
            .is_err(),
        "wait_for_releases returned while the release could not be sent"
    );
    assert!(other.try_lock("cut-release").await.unwrap().is_none());

    proxy.unblock();
    let back = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), cut_off.wait_for_releases())
        .await
        .expect("the release was not retried to the end");
    let acquired = other
        .lock_with(
            "cut-release",
            LockOptions::new().wait(Duration::from_secs(3)),
        )
        .await
        .expect("the key stayed held after the network came back");
    println!("released {:?} after the network came back", back.elapsed());
    acquired.release().await.unwrap();
}

/// Releases a lock of `holder` (a locker on `backend`, whose connections
/// go through `proxy`) with its reply lost, as core's release does: the
/// guard's token goes to [`Backend::release`](dlock_core::backend::Backend::release). `proxy` lets the release
/// through and drops the answer until `next`, waiting for the key, is
/// granted (the release ran); then every connection is cut and new ones
/// allowed. The release either answers `Released` (the client sent it
/// again itself) or fails; if it fails it is sent again, as core's retry
/// sends it. Either way the send that finds the key gone, and held by
/// `next`, must answer `Released` (a release sent twice is a no-op, not a
/// lost lock) and leave `next`'s lock alone.
///
/// `holder`'s session must outlive the whole check by far (its keepalives
/// go unanswered while replies are dropped).
///
/// # Panics
///
/// When a check fails.
pub async fn check_a_release_sent_again_after_a_lost_reply_succeeds(
    backend: &dyn DynBackend,
    holder: &Locker,
    next: &Locker,
    proxy: &TcpProxy,
    name: &str,
) {
    use dlock_core::backend::ReleaseOutcome;
    let key = LockKey::new(name).unwrap();
    let guard = holder.lock(name).await.expect("the first lock");
    let token = *guard.token();
    // Released below through the backend, as core releases it.
    guard.leak();
    let waiting = {
        let (next, name) = (next.clone(), name.to_owned());
        tokio::spawn(async move {
            next.lock_with(&name, LockOptions::new().wait(Duration::from_secs(20)))
                .await
        })
    };
    proxy.drop_replies();
    let release = backend.release(&key, Mode::Exclusive, &token);
    let (first, next_guard) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(20), release),
        async {
            let granted = tokio::time::timeout(Duration::from_secs(15), waiting)
                .await
                .expect("the release never reached the server")
                .unwrap()
                .expect("the next owner's lock");
            proxy.block();
            proxy.unblock();
            granted
        }
    );
    let first = first.expect("the release whose reply was lost never ended");
    println!("the release whose reply was lost answered {first:?}");
    // Sent again while it fails, as core sends it (bounded here).
    let mut released = first;
    for _ in 0..20 {
        if released.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        released = backend.release(&key, Mode::Exclusive, &token).await;
    }
    assert!(
        matches!(released, Ok(ReleaseOutcome::Released)),
        "the release sent again after its reply was lost answered {released:?}"
    );
    assert!(!next_guard.is_lost(), "the next owner's guard says lost");
    assert!(
        holder.try_lock(name).await.expect("a try").is_none(),
        "the release sent again freed the next owner's lock"
    );
    next_guard
        .release()
        .await
        .expect("the next owner's release (its lock untouched)");
}

/// Abandons the token of one of two guards `locker` holds on `backend`,
/// then checks that both guards report lost, that `other` gets the key
/// within `ttl` (the session's lease or timeout) though its guard lives,
/// and that a later lock through `locker` is kept alive past `ttl`.
///
/// # Panics
///
/// When a check fails.
pub async fn check_abandon_gives_up_the_session(
    backend: &dyn DynBackend,
    locker: &Locker,
    other: &Locker,
    ttl: Duration,
) {
    let stuck = locker.lock("stuck").await.unwrap();
    let neighbour = locker.lock("neighbour").await.unwrap();

    let abandoned = Instant::now();
    backend
        .abandon(
            &LockKey::new("stuck").unwrap(),
            Mode::Exclusive,
            stuck.token(),
        )
        .await;
    assert!(stuck.is_lost(), "the abandoned guard still says it holds");
    assert!(
        neighbour.is_lost(),
        "a guard on the abandoned session still says it holds"
    );
    let acquired = other
        .lock_with("stuck", LockOptions::new().wait(ttl * 2))
        .await
        .expect("the abandoned key did not go");
    let gone_after = abandoned.elapsed();
    assert!(
        gone_after <= ttl + Duration::from_millis(500),
        "the abandoned key went only {gone_after:?} later"
    );
    acquired.release().await.unwrap();

    let fresh = locker.lock("fresh").await.unwrap();
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    assert!(
        !fresh.is_lost(),
        "a lock after the abandon was not kept alive"
    );
    assert!(other.try_lock("fresh").await.unwrap().is_none());
    drop((stuck, neighbour));
    fresh.release().await.unwrap();
}

/// Restarts the server with `restart` (which keeps its data) while
/// `holder` holds a lock, then checks that no key is granted twice and that
/// fencing tokens keep growing: the next owner of the held key, and the
/// first owner of a new key, get tokens above every token given before the
/// restart. A server that counted tokens from scratch after a restart
/// (state it did not keep, or a wiped data dir) fails this: a writer it
/// fenced out would be let in again.
///
/// Each client's session must outlive the restart or end with its guards
/// lost; `within` bounds every wait for the server to answer again.
///
/// # Panics
///
/// When a check fails. Runs `restart` on a multi-threaded runtime's
/// worker ([`tokio::task::block_in_place`]).
pub async fn check_fencing_across_a_restart(
    holder: &Locker,
    other: &Locker,
    restart: impl FnOnce() -> Result<(), FixtureError>,
    within: Duration,
) {
    let earlier = holder.lock("fence-restart-earlier").await.unwrap();
    let released = earlier.fencing_token().expect("a fencing token");
    earlier.release().await.unwrap();
    let held = holder.lock("fence-restart").await.unwrap();
    let before = held.fencing_token().expect("a fencing token");
    assert!(before > released, "tokens {released} then {before}");

    tokio::task::block_in_place(restart).expect("restart the server");
    let back = Instant::now();

    // Answered again: while the holder's guard says it holds, nobody else
    // gets the key.
    let taken = loop {
        match other.try_lock("fence-restart").await {
            Ok(taken) => break taken,
            Err(e) if back.elapsed() < within => {
                println!("not answering yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no answer {within:?} after the restart: {e}"),
        }
    };
    if let Some(taken) = &taken {
        assert!(
            held.is_lost(),
            "the key was granted again while its holder still held it"
        );
        println!("the restart ended the holder's session");
        assert!(taken.fencing_token().expect("a token") > before);
    }
    println!(
        "holder {} after the restart",
        if held.is_lost() { "lost" } else { "held" }
    );
    drop(taken);
    if !held.is_lost() {
        held.release().await.unwrap();
    }
    let next = other
        .lock_with("fence-restart", LockOptions::new().wait(within))
        .await
        .expect("the held key after the restart");
    let next_token = next.fencing_token().expect("a fencing token");
    assert!(
        next_token > before,
        "the next owner's token {next_token} is not above {before}, the token given before the restart"
    );
    let fresh = other.lock("fence-restart-fresh").await.unwrap();
    let fresh_token = fresh.fencing_token().expect("a fencing token");
    assert!(
        fresh_token > next_token && fresh_token > before,
        "a new key's token {fresh_token} is not above {before} and {next_token}"
    );
    println!("tokens: {released}, {before} before the restart; {next_token}, {fresh_token} after");
    next.release().await.unwrap();
    fresh.release().await.unwrap();
}

/// Fixed leases that were released leave no task behind, on a backend
/// that ends fixed leases itself (ZooKeeper, the databases): its leases
/// share one timer task, and a released one is cancelled. One sleeping
/// task per acquisition would keep 50 tasks alive here for an hour.
pub async fn check_released_fixed_leases_leave_no_tasks(locker: &Locker) {
    let hour = LockOptions::new().lease(Duration::from_secs(3600));
    let take_and_release = |key: String| async move {
        let guard = locker.lock_with(&key, hour).await.expect("lock");
        guard.release().await.expect("release");
    };
    take_and_release("timers-warm".to_owned()).await;
    locker.wait_for_releases().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    for i in 0..50 {
        take_and_release(format!("timers-{i}")).await;
    }
    locker.wait_for_releases().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = metrics.num_alive_tasks();
    assert!(
        after <= before + 5,
        "{after} tasks alive after 50 released fixed leases ({before} before)"
    );
}

/// The states [`Locker::state`] went through, recorded as they come.
#[derive(Debug, Clone, Default)]
struct StateLog(std::sync::Arc<std::sync::Mutex<Vec<dlock_core::ConnectionState>>>);

impl StateLog {
    fn follow(locker: &Locker) -> StateLog {
        let log = StateLog::default();
        let mut states = locker.state();
        let seen = log.clone();
        tokio::spawn(async move {
            seen.push(*states.borrow_and_update());
            while states.changed().await.is_ok() {
                seen.push(*states.borrow_and_update());
            }
        });
        log
    }

    fn push(&self, state: dlock_core::ConnectionState) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(state);
    }

    fn seen(&self) -> Vec<dlock_core::ConnectionState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until `state` is recorded after the first `after` entries;
    /// its index.
    async fn wait_for(
        &self,
        state: dlock_core::ConnectionState,
        after: usize,
        within: Duration,
    ) -> usize {
        let started = Instant::now();
        loop {
            if let Some(i) = self.seen().iter().skip(after).position(|s| *s == state) {
                return after + i;
            }
            assert!(
                started.elapsed() < within,
                "no {state:?} within {within:?}: the states were {:?}",
                self.seen()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Cuts every connection of `locker` (made through `proxy`) while it
/// holds a lock, and checks what [`Locker::state`] says:
///
/// - with `short`, a cut of that long, shorter than the session or lease:
///   `Suspended`, then `Reconnected` once the network is back, and the
///   lock still held;
/// - then a cut until the backend says `Lost` (within `lost_within`),
///   with the held lock lost too; once the network is back,
///   `Reconnected` with nothing held or asked for (the backend probes its
///   servers while disconnected), and a new lock works.
///
/// The states are exactly those, in that order, from `Connected` (a
/// second `Suspended` may come before `Lost`; without `short`, there is
/// no `Suspended` at all).
///
/// # Panics
///
/// When a check fails.
pub async fn check_connection_states(
    locker: &Locker,
    proxy: &TcpProxy,
    short: Option<Duration>,
    lost_within: Duration,
) {
    use dlock_core::ConnectionState::{Connected, Lost, Reconnected, Suspended};
    let log = StateLog::follow(locker);
    let guard = locker.lock("connection-states").await.expect("lock");
    let mut mark = 0;
    if let Some(short) = short {
        proxy.block();
        let suspended = log.wait_for(Suspended, 0, short * 4).await;
        tokio::time::sleep(short).await;
        proxy.unblock();
        mark = log.wait_for(Reconnected, suspended, short * 8).await;
        assert!(
            !guard.is_lost(),
            "a cut of {short:?} lost the lock: {:?}",
            log.seen()
        );
    }
    proxy.block();
    let lost = log.wait_for(Lost, mark, lost_within).await;
    let told = tokio::time::timeout(lost_within, guard.lost()).await;
    assert!(told.is_ok(), "the backend said Lost, the guard never did");
    proxy.unblock();
    // Told by the backend's own probe: nothing is held or asked for now.
    log.wait_for(Reconnected, lost, lost_within).await;
    let after = locker
        .lock_with(
            "connection-states-after",
            LockOptions::new().wait(lost_within),
        )
        .await
        .expect("a lock once the network is back");
    drop(after);
    let mut seen = log.seen();
    seen.dedup();
    let exact: Vec<Vec<dlock_core::ConnectionState>> = if short.is_some() {
        vec![
            vec![Connected, Suspended, Reconnected, Lost, Reconnected],
            vec![
                Connected,
                Suspended,
                Reconnected,
                Suspended,
                Lost,
                Reconnected,
            ],
        ]
    } else {
        vec![vec![Connected, Lost, Reconnected]]
    };
    assert!(
        exact.contains(&seen),
        "the states were {seen:?}, expected one of {exact:?}"
    );
}

/// Polls an uncontended lock of `locker` once, so that its request is on
/// its way, then leaves it parked without dropping it, as a `select!`
/// loop does with a `&mut` future while another branch's body runs. The
/// same task meanwhile releases a lock of `locker` and takes another: on a
/// backend whose keys share a connection (give it one session for them),
/// neither may wait for the parked request. Polled again, the parked lock
/// is granted, once: `other` is refused it.
///
/// # Panics
///
/// When a check fails.
pub async fn check_a_parked_lock_blocks_nothing(locker: &Locker, other: &Locker) {
    let held = locker.lock("parked-held").await.unwrap();
    // A first poll may send the request and read its answer at once (the
    // server was that quick): then take another key, up to 50 times.
    let mut parked = None;
    for attempt in 0..50 {
        let key = format!("parked-new-{attempt}");
        let (l, k) = (locker.clone(), key.clone());
        let mut lock = Box::pin(async move { l.lock(&k).await });
        tokio::select! {
            biased;
            granted = &mut lock => granted.expect("lock").release().await.expect("release"),
            () = std::future::ready(()) => {
                parked = Some((key, lock));
                break;
            }
        }
    }
    let (key, parked) =
        parked.expect("every lock was granted at its first poll: none was in flight");
    let meanwhile = async {
        held.release()
            .await
            .expect("release beside the parked lock");
        let again = locker
            .lock("parked-other")
            .await
            .expect("lock beside the parked lock");
        again
            .release()
            .await
            .expect("release beside the parked lock");
    };
    tokio::time::timeout(Duration::from_secs(5), meanwhile)
        .await
        .expect("a lock request polled once and parked held up the client's other locks");
    let guard = tokio::time::timeout(Duration::from_secs(5), parked)
        .await
        .expect("the parked lock never finished")
        .expect("the parked lock");
    assert!(
        other.try_lock(&key).await.unwrap().is_none(),
        "the parked lock's key was granted to another client too"
    );
    assert!(!guard.is_lost(), "the parked lock's guard says lost");
    guard.release().await.unwrap();
}
