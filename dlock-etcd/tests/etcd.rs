//! etcd-specific behaviour against real etcd processes: a 3-member cluster
//! losing its leader mid-hold, a session cut off through a proxy, fencing
//! across a restart, the round trips of an uncontended lock, and the
//! handoff rate under contention; and permit waiters that never sleep
//! beside a free permit.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{BackendExt, DistSemaphore, LockOptions, Locker, LostReason};
use dlock_etcd::{etcd_client, EtcdBackend};
use dlock_testkit::{
    fixture::{EtcdServer, TcpProxy},
    session_faults, OverlapDetector,
};
use tokio::time::Instant;

async fn locker(url: &str) -> Locker {
    EtcdBackend::connect(url)
        .await
        .expect("connect to etcd")
        .into_locker()
}

/// The index of the member that leads the cluster.
async fn leader(servers: &[EtcdServer]) -> usize {
    for _ in 0..100 {
        for (i, server) in servers.iter().enumerate() {
            if let Ok(mut client) = etcd_client::Client::connect([server.endpoint()], None).await {
                if let Ok(status) = client.status().await {
                    let me = status.header().map(|h| h.member_id());
                    if status.leader() != 0 && Some(status.leader()) == me {
                        return i;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no leader elected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_mid_hold_keeps_the_lock_and_grants_nothing_twice() {
    let mut servers = EtcdServer::cluster(3).expect("start a 3-member etcd cluster");
    let endpoints: Vec<String> = servers.iter().map(EtcdServer::endpoint).collect();
    let url = format!("etcd://{}/dlock-test", endpoints.join(","));
    let ttl = Duration::from_secs(3);
    let holder = Locker::builder(EtcdBackend::connect(&url).await.unwrap())
        .watchdog_lease(ttl)
        .build()
        .unwrap();
    let guard = holder.lock("leader").await.unwrap();

    let detector = Arc::new(OverlapDetector::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..3 {
        let (url, detector, order) = (url.clone(), detector.clone(), order.clone());
        waiters.push(tokio::spawn(async move {
            let locker = locker(&url).await;
            let g = locker
                .lock_with("leader", LockOptions::new().wait(Duration::from_secs(30)))
                .await
                .unwrap_or_else(|e| panic!("waiter {i}: {e}"));
            {
                // The section ends before the release: the next owner may
                // enter as soon as the server has it.
                let _section = detector.enter();
                order.lock().unwrap().push(g.fencing_token().unwrap());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            g.release().await.unwrap();
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let lead = leader(&servers).await;
    servers[lead].process().kill();
    // Past a whole TTL: an election and several keepalives of the session.
    tokio::time::sleep(ttl + ttl / 3).await;
    assert!(
        !guard.is_lost(),
        "the holder lost its lock to a leader change"
    );
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "a waiter got the lock while it was held"
    );
    let fence = guard.fencing_token().unwrap();
    guard.release().await.unwrap();
    for w in waiters {
        tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("a waiter never got the lock")
            .unwrap();
    }
    assert_eq!(detector.overlaps(), 0);
    let order = order.lock().unwrap().clone();
    assert_eq!(order.len(), 3);
    assert!(order.iter().all(|f| *f > fence), "{order:?} after {fence}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_cut_off_is_lost_before_anyone_else_acquires() {
    let server = EtcdServer::start().expect("start etcd");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    let ttl = Duration::from_secs(2);
    let cut_off = Locker::builder(
        EtcdBackend::connect(&format!("etcd://{}/t", proxy.endpoint()))
            .await
            .unwrap(),
    )
    .watchdog_lease(ttl)
    .build()
    .unwrap();
    let other = locker(&format!("etcd://{}/t", server.endpoint())).await;
    let guard = cut_off.lock("cut").await.unwrap();
    tokio::time::sleep(ttl).await;
    assert!(!guard.is_lost());

    proxy.block();
    let blocked = Instant::now();
    let acquired = other
        .lock_with("cut", LockOptions::new().wait(Duration::from_secs(20)))
        .await
        .unwrap();
    let acquired_after = blocked.elapsed();
    assert!(
        guard.is_lost(),
        "another client acquired while the cut-off guard said it held"
    );
    let reason = tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .unwrap();
    assert!(
        matches!(
            reason,
            LostReason::LeaseExpired | LostReason::SessionExpired
        ),
        "{reason:?}"
    );
    // The last keepalive was about a third of the TTL before the cut (a late
    // one makes it earlier): half the TTL is a safe lower bound.
    assert!(
        acquired_after >= ttl / 2,
        "acquired only {acquired_after:?} after the cut"
    );
    println!("acquired {acquired_after:?} after the cut (TTL {ttl:?})");
    drop(acquired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncontended_lock_costs_a_put_and_a_delete() {
    let server = EtcdServer::start().expect("start etcd");
    let endpoint = server.endpoint();
    let locker = locker(&format!("etcd://{endpoint}/rt")).await;
    // The session is started by the first lock; count the steady state.
    locker.lock("warm").await.unwrap().release().await.unwrap();
    let methods = ["Txn", "Range", "Put", "DeleteRange", "LeaseGrant", "Watch"];
    let count = |m: &str| -> u64 {
        let requests = server.grpc_requests().expect("etcd /metrics");
        requests.get(m).copied().unwrap_or(0)
    };
    let before: Vec<u64> = methods.iter().map(|m| count(m)).collect();
    const N: u64 = 50;
    for _ in 0..N {
        locker.lock("rt").await.unwrap().release().await.unwrap();
    }
    let used: Vec<(&str, u64)> = methods
        .iter()
        .zip(before)
        .map(|(m, b)| (*m, count(m) - b))
        .collect();
    println!("calls for {N} lock + release: {used:?}");
    let calls: u64 = used.iter().map(|(_, n)| n).sum();
    // A raw client does one put and one delete: 2 calls per cycle.
    assert_eq!(calls, 2 * N, "round trips per lock + release: {used:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contended_handoffs_never_overlap() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/handoff", server.endpoint());
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 25;
    let detector = Arc::new(OverlapDetector::default());
    let mut tasks = Vec::new();
    let mut lockers = Vec::new();
    for _ in 0..CLIENTS {
        lockers.push(locker(&url).await);
    }
    let start = Instant::now();
    for locker in lockers {
        let detector = detector.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let g = locker
                    .lock_with("hot", LockOptions::new().wait(Duration::from_secs(30)))
                    .await
                    .unwrap();
                drop(detector.enter());
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = start.elapsed();
    let rate = (CLIENTS * ROUNDS) as f64 / elapsed.as_secs_f64();
    println!(
        "{} contended acquisitions in {elapsed:?}: {rate:.0} handoffs/s",
        CLIENTS * ROUNDS
    );
    assert_eq!(detector.overlaps(), 0);
    assert_eq!(detector.entries(), CLIENTS * ROUNDS);
    // The rate is printed, not asserted: speed is the benchmark's to show.
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_granted_after_more_than_a_ttl_holds_a_live_lock() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/long-wait", server.endpoint());
    let ttl = Duration::from_secs(2);
    let build = |backend| {
        Locker::builder(backend)
            .watchdog_lease(ttl)
            .build()
            .unwrap()
    };
    let holder = build(EtcdBackend::connect(&url).await.unwrap());
    let waiter = build(EtcdBackend::connect(&url).await.unwrap());
    let guard = holder.lock("k").await.unwrap();
    let waiting = tokio::spawn(async move {
        let g = waiter
            .lock_with("k", LockOptions::new().wait(Duration::from_secs(20)))
            .await;
        (waiter, g)
    });
    // Longer than the session TTL: the waiter's session renews meanwhile.
    tokio::time::sleep(ttl * 2).await;
    guard.release().await.unwrap();
    let (_waiter, got) = waiting.await.unwrap();
    let got = got.expect("granted after a long wait");
    tokio::time::sleep(ttl).await;
    assert!(
        !got.is_lost(),
        "a lock granted after a long wait was reported lost while held"
    );
    got.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_cut_off_by_the_network_is_sent_again_once_it_is_back() {
    let server = EtcdServer::start().expect("start etcd");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    // A TTL the cut stays well inside: the session survives it.
    let cut_off = locker_with_ttl(
        &format!("etcd://{}/r", proxy.endpoint()),
        Duration::from_secs(8),
    )
    .await;
    let other = locker(&format!("etcd://{}/r", server.endpoint())).await;
    session_faults::check_release_cut_off_then_back(
        &cut_off,
        &other,
        &proxy,
        Duration::from_millis(1500),
    )
    .await;
}

/// A release whose reply was lost is sent again (by core's retry of a
/// failed release) and finds its key gone, deleted by the first send: it
/// must answer that it released, in both key layouts, and leave the next
/// owner's key alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_sent_again_after_its_reply_was_lost_is_a_no_op_that_succeeds() {
    let server = EtcdServer::start().expect("start etcd");
    for layout in ["dlock", "etcdctl"] {
        let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
            .await
            .unwrap();
        let backend =
            EtcdBackend::connect(&format!("etcd://{}/s?layout={layout}", proxy.endpoint()))
                .await
                .unwrap();
        let cut = backend.clone().into_locker();
        let next = locker(&format!("etcd://{}/s?layout={layout}", server.endpoint())).await;
        session_faults::check_a_release_sent_again_after_a_lost_reply_succeeds(
            &backend,
            &cut,
            &next,
            &proxy,
            &format!("resent-{layout}"),
        )
        .await;
    }
}

/// The other side of the test above: a release sent again after its
/// session's lease ran out (the lock was lost before it) still says
/// `NotHeld`, though its first send may have run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_sent_again_after_the_session_expired_says_not_held() {
    use dlock_core::backend::{Backend, Mode, ReleaseOutcome};
    let server = EtcdServer::start().expect("start etcd");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    let url = format!("etcd://{}/x", proxy.endpoint());
    let backend = EtcdBackend::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(2);
    let holder = Locker::builder(backend.clone())
        .watchdog_lease(ttl)
        .build()
        .unwrap();
    let next = locker(&format!("etcd://{}/x", server.endpoint())).await;
    let guard = holder.lock("expired").await.unwrap();
    let token = *guard.token();
    guard.leak();
    let key = dlock_core::LockKey::new("expired").unwrap();
    proxy.block();
    let first = backend.release(&key, Mode::Exclusive, &token).await;
    assert!(first.is_err(), "a release with no network: {first:?}");
    // Granted once the session's lease ran out and took the key.
    let taken = next
        .lock_with("expired", LockOptions::new().wait(ttl * 5))
        .await
        .expect("the expired holder's key never went");
    proxy.unblock();
    let again = backend.release(&key, Mode::Exclusive, &token).await;
    assert!(
        matches!(again, Ok(ReleaseOutcome::NotHeld)),
        "a release sent again after the session expired answered {again:?}"
    );
    assert!(!taken.is_lost());
    taken.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoning_a_token_gives_up_its_session_and_its_key_expires() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/a", server.endpoint());
    let backend = EtcdBackend::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(3);
    let locker = Locker::builder(backend.clone())
        .watchdog_lease(ttl)
        .build()
        .unwrap();
    let other = locker_with_ttl(&url, ttl).await;
    session_faults::check_abandon_gives_up_the_session(&backend, &locker, &other, ttl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_server_restart() {
    let mut server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/f", server.endpoint());
    // A TTL the restart (well under a second here) stays inside.
    let ttl = Duration::from_secs(10);
    let holder = locker_with_ttl(&url, ttl).await;
    let other = locker_with_ttl(&url, ttl).await;
    session_faults::check_fencing_across_a_restart(&holder, &other, || server.restart(), ttl).await;
}

async fn locker_with_ttl(url: &str, ttl: Duration) -> Locker {
    Locker::builder(EtcdBackend::connect(url).await.unwrap())
        .watchdog_lease(ttl)
        .build()
        .unwrap()
}

/// A backend on the application's own `etcd_client::Client` locks the same
/// keys as one built from a URL with the same prefix: each excludes the
/// other, and fencing tokens grow across both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_on_the_applications_client_shares_the_locks() {
    let server = EtcdServer::start().expect("start etcd");
    let endpoint = server.endpoint();
    let options = etcd_client::ConnectOptions::new().with_require_leader(true);
    let client = etcd_client::Client::connect([endpoint.as_str()], Some(options))
        .await
        .unwrap();
    let own = EtcdBackend::from_client(client)
        .await
        .unwrap()
        .into_locker();
    // `from_client` takes the default prefix, `dlock`.
    let by_url = locker(&format!("etcd://{endpoint}/dlock")).await;
    dlock_testkit::assert_locks_are_shared(&own, &by_url).await;
}

/// A permit waiter wakes when any holder ahead of it releases, whatever
/// its entry's name: here the holder that releases entered second, but its
/// lease (the first part of its name) sorts before the first holder's, so
/// a watch of the names from the oldest entry on would never see it go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_waiter_sees_a_release_whose_name_sorts_first() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/p", server.endpoint());
    let (early, late, waiter) = (locker(&url).await, locker(&url).await, locker(&url).await);
    // `early` starts its session (and lease) first, so its names sort
    // first; it then queues second.
    drop(early.lock("warm-up").await.expect("warm-up"));
    let first = DistSemaphore::new(&late, "sorted", 2);
    let second = DistSemaphore::new(&early, "sorted", 2);
    let third = DistSemaphore::new(&waiter, "sorted", 2);
    let held_first = first.acquire().await.expect("the first permit");
    let held_second = second.acquire().await.expect("the second permit");
    let waiting = tokio::spawn(async move { third.acquire().await.map(|_| ()) });
    // The names, oldest first: the second holder's sorts before the first's.
    let mut client = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .expect("connect");
    let started = Instant::now();
    let names = loop {
        let queue = client
            .get(
                "p/",
                Some(etcd_client::GetOptions::new().with_prefix().with_sort(
                    etcd_client::SortTarget::Create,
                    etcd_client::SortOrder::Ascend,
                )),
            )
            .await
            .expect("read the queue");
        let names: Vec<String> = queue
            .kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok())
            .filter(|name| name.contains("sorted"))
            .map(str::to_owned)
            .collect();
        if names.len() == 3 || started.elapsed() > Duration::from_secs(5) {
            break names;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(names.len(), 3, "two holders and a waiter: {names:?}");
    assert!(
        names[1] < names[0],
        "the set-up: the second holder's name sorts first: {names:?}"
    );
    held_second.release().await.expect("release");
    let got = tokio::time::timeout(Duration::from_secs(5), waiting).await;
    assert!(
        matches!(got, Ok(Ok(Ok(())))),
        "the waiter missed a free permit: {got:?}"
    );
    drop(held_first);
}

/// A permit waiter that a release admits while it is still queueing (the
/// release lands between its enqueue and its first look at the entries
/// ahead) takes the free permit at once, instead of waiting for one more
/// release. Each round releases a holder the moment the waiter's entry
/// appears, so most rounds hit that window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_freed_while_the_waiter_queues_is_taken_at_once() {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/q", server.endpoint());
    let (a, b, c) = (locker(&url).await, locker(&url).await, locker(&url).await);
    let mut client = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .expect("connect");
    for round in 0..12 {
        let key = format!("race{round}");
        let held_first = DistSemaphore::new(&a, &key, 2)
            .acquire()
            .await
            .expect("first");
        let held_second = DistSemaphore::new(&b, &key, 2)
            .acquire()
            .await
            .expect("second");
        let mut watch = client
            .watch(
                format!("q/{key}%sem/"),
                Some(etcd_client::WatchOptions::new().with_prefix()),
            )
            .await
            .expect("watch the queue");
        let third = DistSemaphore::new(&c, &key, 2);
        let waiting = tokio::spawn(async move { third.acquire().await.map(drop) });
        // The waiter's entry is the first put the watch sees.
        let queued = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(response) = watch.message().await.expect("watch") {
                if response
                    .events()
                    .iter()
                    .any(|e| e.event_type() == etcd_client::EventType::Put)
                {
                    return;
                }
            }
        })
        .await;
        assert!(queued.is_ok(), "round {round}: the waiter never queued");
        held_second.release().await.expect("release");
        let got = tokio::time::timeout(Duration::from_secs(3), waiting).await;
        assert!(
            matches!(got, Ok(Ok(Ok(())))),
            "round {round}: the waiter slept beside a free permit: {got:?}"
        );
        drop(held_first);
    }
}

/// `Locker::state` follows the session lease: `Suspended` when a
/// keepalive goes unanswered, `Reconnected` at the next answered one (the
/// lock kept), `Lost` when the lease runs out with the lock on it,
/// `Reconnected` on a new lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_state_follows_the_session_lease() {
    let server = EtcdServer::start().expect("start etcd");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    // A TTL the short cut and the client's reconnection stay inside.
    let locker = locker_with_ttl(
        &format!("etcd://{}/states", proxy.endpoint()),
        Duration::from_secs(8),
    )
    .await;
    session_faults::check_connection_states(
        &locker,
        &proxy,
        Some(Duration::from_millis(1200)),
        Duration::from_secs(25),
    )
    .await;
}
