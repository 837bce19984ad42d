//! ZooKeeper-specific behaviour against real servers: an ensemble losing
//! the server the holder is connected to, a session cut off until it
//! expires, and fencing across a restart.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use dlock_core::{BackendExt, HoldState, LockOptions};
use dlock_testkit::{
    fixture::{TcpProxy, ZooKeeperServer},
    session_faults, OverlapDetector,
};
use dlock_zk::{zookeeper_client, ZkBackend};
use tokio::time::Instant;

/// The servers' endpoints, the index of the one serving `session`.
async fn serving(servers: &[ZooKeeperServer], session: i64) -> Option<usize> {
    let sid = format!("sid=0x{session:x}");
    for (i, server) in servers.iter().enumerate() {
        // A killed server answers nothing.
        if server
            .four_letter_word("cons")
            .unwrap_or_default()
            .contains(&sid)
        {
            return Some(i);
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_connected_server_keeps_the_lock_and_grants_nothing_twice() {
    let mut servers = ZooKeeperServer::ensemble(3).expect("start a 3-server ensemble");
    // The fixture hands out an ensemble that serves: one leader, followers.
    let modes: Vec<String> = servers
        .iter()
        .map(|s| {
            let srvr = s.four_letter_word("srvr").unwrap();
            srvr.lines()
                .find_map(|l| l.strip_prefix("Mode: "))
                .unwrap_or("not serving")
                .to_owned()
        })
        .collect();
    assert_eq!(
        modes.iter().filter(|m| *m == "leader").count(),
        1,
        "{modes:?}"
    );
    assert_eq!(
        modes.iter().filter(|m| *m == "follower").count(),
        2,
        "{modes:?}"
    );
    let hosts: Vec<String> = servers.iter().map(ZooKeeperServer::endpoint).collect();
    let timeout = Duration::from_secs(4);
    let url = format!(
        "zk://{}/ensemble?session_timeout={}s",
        hosts.join(","),
        timeout.as_secs()
    );
    let backend = ZkBackend::connect(&url).await.unwrap();
    let session = backend.session_id().expect("a session");
    let holder = backend.into_locker();
    let guard = holder.lock("k").await.unwrap();

    let detector = Arc::new(OverlapDetector::default());
    let fences = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for _ in 0..2 {
        let (url, detector, fences) = (url.clone(), detector.clone(), fences.clone());
        waiters.push(tokio::spawn(async move {
            let locker = ZkBackend::connect(&url).await.unwrap().into_locker();
            let g = locker
                .lock_with("k", LockOptions::new().wait(Duration::from_secs(60)))
                .await
                .unwrap();
            {
                // The section ends before the release: the next owner may
                // enter as soon as the server has it.
                let _section = detector.enter();
                fences.lock().unwrap().push(g.fencing_token().unwrap());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            g.release().await.unwrap();
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let connected = serving(&servers, session)
        .await
        .expect("the holder's server");
    servers[connected].process().kill();
    let killed = Instant::now();
    // Past a whole session timeout: the session must have moved, not expired.
    tokio::time::sleep(timeout * 3 / 2).await;
    assert!(!guard.is_lost(), "the lock was lost when its server died");
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "a waiter got a held lock"
    );
    println!(
        "holder kept its lock {:?} after its server was killed",
        killed.elapsed()
    );
    let fence = guard.fencing_token().unwrap();
    guard.release().await.unwrap();
    for w in waiters {
        tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("a waiter never got the lock")
            .unwrap();
    }
    assert_eq!(detector.overlaps(), 0);
    let fences = fences.lock().unwrap().clone();
    assert_eq!(fences.len(), 2);
    assert!(
        fences.iter().all(|f| *f > fence),
        "{fences:?} after {fence}"
    );
}

/// Cuts a holder off from ZooKeeper and checks that its guard says
/// "unsure" first, then lost, and that another client gets the lock only
/// once the session could have expired.
async fn cut_off_holder(options: LockOptions) {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    let timeout = Duration::from_secs(2);
    let cut_off = ZkBackend::connect(&format!(
        "zk://{}/expiry?session_timeout=2s",
        proxy.endpoint()
    ))
    .await
    .unwrap()
    .into_locker();
    let other = ZkBackend::connect(&format!(
        "zk://{}/expiry?session_timeout=2s",
        server.endpoint()
    ))
    .await
    .unwrap()
    .into_locker();
    let guard = cut_off.lock_with("k", options).await.unwrap();
    tokio::time::sleep(timeout).await;
    assert_eq!(guard.state(), HoldState::Held);

    proxy.block();
    let blocked = Instant::now();
    let mut unsure = false;
    while blocked.elapsed() < timeout / 3 && !unsure {
        unsure = guard.state() == HoldState::Unsure;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        unsure,
        "a disconnected guard did not say it was unsure: {:?}",
        guard.state()
    );
    let acquired = other
        .lock_with("k", LockOptions::new().wait(Duration::from_secs(30)))
        .await
        .unwrap();
    let after = blocked.elapsed();
    assert!(
        guard.is_lost(),
        "another client acquired while the cut-off guard said it held"
    );
    assert_eq!(guard.state(), HoldState::Lost);
    // The server last heard from the holder about a third of the timeout
    // before the cut (a late ping makes it earlier): half is a safe bound.
    assert!(
        after >= timeout / 2,
        "acquired only {after:?} after the cut"
    );
    println!("acquired {after:?} after the cut (session timeout {timeout:?})");
    drop(acquired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_session_loses_the_lock_before_anyone_else_gets_it() {
    cut_off_holder(LockOptions::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_session_ends_a_long_fixed_lease_too() {
    cut_off_holder(LockOptions::new().lease(Duration::from_secs(60))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncontended_lock_costs_three_packets() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    // A long session timeout: the session's own traffic (the client's
    // pings, our liveness check every third of the timeout) grows with
    // time, and a loaded machine makes the loop slow.
    const TIMEOUT_S: u64 = 30;
    let url = format!(
        "zk://{}/packets?session_timeout={TIMEOUT_S}s",
        server.endpoint()
    );
    let locker = ZkBackend::connect(&url).await.unwrap().into_locker();
    // The session and the parent nodes come with the first lock.
    locker.lock("warm").await.unwrap().release().await.unwrap();
    const N: u64 = 50;
    let before = server.packets_received().expect("mntr");
    let started = Instant::now();
    for _ in 0..N {
        locker.lock("rt").await.unwrap().release().await.unwrap();
    }
    let used = server.packets_received().expect("mntr") - before;
    let took = started.elapsed();
    println!("packets for {N} lock + release: {used} in {took:?}");
    // Create and list (pipelined), then delete. Besides: the key's parent
    // node, created at the first lock and again each time the server's
    // container sweep (every second in the fixture) removed it while empty,
    // about 3 packets each; and at most a ping and a check per third of
    // the session timeout that the loop lasted.
    let seconds = took.as_secs() + 1;
    let thirds = took.as_secs() / (TIMEOUT_S / 3) + 1;
    assert!(
        (3 * N..=3 * N + 4 + 3 * seconds + 2 * thirds).contains(&used),
        "{used} packets for {N} lock + release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_keeps_trying_until_the_server_answers_within_the_connect_timeout() {
    let mut zk = ZooKeeperServer::start().expect("zookeeper");
    let endpoint = zk.endpoint();
    // A stopped server accepts connections but answers nothing: each of the
    // client's attempts times out after the 1 s session timeout.
    zk.process().pause().unwrap();
    let url = format!("zk://{endpoint}/retry?session_timeout=1s&connect_timeout=30s");
    let started = Instant::now();
    let connecting = tokio::spawn(async move { ZkBackend::connect(&url).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!connecting.is_finished(), "connect gave up while paused");
    zk.process().resume().unwrap();
    let backend = tokio::time::timeout(Duration::from_secs(30), connecting)
        .await
        .expect("connect hung past its connect timeout")
        .unwrap()
        .expect("a session once the server answers");
    println!("connected after {:?}", started.elapsed());
    let guard = backend.into_locker().lock("k").await.unwrap();
    guard.release().await.unwrap();

    // Still stopped when the connect timeout runs out: a typed error, in time.
    zk.process().pause().unwrap();
    let (session, connect) = (Duration::from_secs(1), Duration::from_secs(3));
    let url = format!(
        "zk://{endpoint}/retry?session_timeout={}s&connect_timeout={}s",
        session.as_secs(),
        connect.as_secs()
    );
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), ZkBackend::connect(&url))
        .await
        .expect("connect hung past its connect timeout");
    let took = started.elapsed();
    zk.process().resume().unwrap();
    match result {
        Err(dlock_core::LockError::Backend { .. }) => {}
        other => panic!("expected a backend error, got {other:?}"),
    }
    assert!(
        took >= connect - session && took < connect * 2,
        "gave up after {took:?} with a {connect:?} connect timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_cut_off_by_the_network_is_sent_again_once_it_is_back() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    // A session timeout the cut stays well inside: the session survives it.
    let cut_off = ZkBackend::connect(&format!("zk://{}/r?session_timeout=8s", proxy.endpoint()))
        .await
        .unwrap()
        .into_locker();
    let other = ZkBackend::connect(&format!("zk://{}/r", server.endpoint()))
        .await
        .unwrap()
        .into_locker();
    session_faults::check_release_cut_off_then_back(
        &cut_off,
        &other,
        &proxy,
        Duration::from_millis(2500),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoning_a_token_closes_its_session_and_its_node_goes() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let url = format!("zk://{}/a?session_timeout=3s", server.endpoint());
    let backend = ZkBackend::connect(&url).await.unwrap();
    let locker = backend.clone().into_locker();
    let other = ZkBackend::connect(&url).await.unwrap().into_locker();
    let first_session = backend.session_id();
    session_faults::check_abandon_gives_up_the_session(
        &backend,
        &locker,
        &other,
        Duration::from_secs(3),
    )
    .await;
    assert_ne!(backend.session_id(), first_session, "no new session");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_server_restart() {
    let mut server = ZooKeeperServer::start().expect("start ZooKeeper");
    // A session timeout the restart (a JVM start, 1-3 s here) stays inside.
    let timeout = Duration::from_secs(15);
    let url = format!(
        "zk://{}/f?session_timeout={}s",
        server.endpoint(),
        timeout.as_secs()
    );
    let holder = ZkBackend::connect(&url).await.unwrap().into_locker();
    let other = ZkBackend::connect(&url).await.unwrap().into_locker();
    session_faults::check_fencing_across_a_restart(&holder, &other, || server.restart(), timeout)
        .await;
}

/// Polls a future until it has been woken `polls - 1` times, then drops it
/// where it stands.
struct CutAfter<F: std::future::Future> {
    inner: std::pin::Pin<Box<F>>,
    polls_left: usize,
}

impl<F: std::future::Future> std::future::Future for CutAfter<F> {
    type Output = Option<F::Output>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        if self.polls_left == 0 {
            return std::task::Poll::Ready(None);
        }
        self.polls_left -= 1;
        self.inner.as_mut().poll(cx).map(Some)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_cut_off_leave_no_parent_that_never_had_a_child() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let url = format!("zk://{}/cut", server.endpoint());
    let locker = ZkBackend::connect(&url).await.unwrap().into_locker();
    // Cut first-time attempts on fresh keys at every step they take.
    let mut cut = 0;
    for polls in 1..=8 {
        for round in 0..3 {
            let attempt = CutAfter {
                inner: Box::pin(locker.lock(format!("k{polls}-{round}"))),
                polls_left: polls,
            };
            match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                Ok(None) => cut += 1,
                Ok(Some(guard)) => guard.unwrap().release().await.unwrap(),
                Err(_) => panic!("an attempt on a free key did not end"),
            }
        }
    }
    assert!(cut >= 6, "only {cut} attempts were cut off");
    locker.wait_for_releases().await;
    let raw = zookeeper_client::Client::connect(&server.endpoint())
        .await
        .unwrap();
    let mut never_had_a_child = Vec::new();
    for parent in raw.list_children("/cut").await.unwrap() {
        if let Some(stat) = raw.check_stat(&format!("/cut/{parent}")).await.unwrap() {
            if stat.num_children == 0 && stat.cversion == 0 {
                never_had_a_child.push(parent);
            }
        }
    }
    assert!(
        never_had_a_child.is_empty(),
        "parents the server will never reap: {never_had_a_child:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_counts_its_lease_from_what_the_leader_saw_not_from_a_listing() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    let timeout = Duration::from_secs(6);
    let holder = ZkBackend::connect(&format!("zk://{}/l", server.endpoint()))
        .await
        .unwrap()
        .into_locker();
    let held = holder.lock("k").await.unwrap();
    // The waiter's session is confirmed when it opens; its next `sync` is
    // a third of the timeout later. Its create goes through the leader as
    // it queues; the listing that finds it first does not.
    let waiter = ZkBackend::connect(&format!(
        "zk://{}/l?session_timeout={}s",
        proxy.endpoint(),
        timeout.as_secs()
    ))
    .await
    .unwrap()
    .into_locker();
    let waiting = tokio::spawn(async move { waiter.lock("k").await });
    // The waiter queues this long before its grant, well before its first
    // `sync` (at a third of the timeout).
    let head = timeout / 5;
    tokio::time::sleep(head).await;
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let granted = Instant::now();
    // No more word from the leader: the guard's lease runs out from the
    // last thing the leader saw.
    proxy.block();
    tokio::time::timeout(timeout * 2, guard.lost())
        .await
        .expect("the cut-off guard was never lost");
    let lasted = granted.elapsed();
    println!("lost {lasted:?} after the grant (session timeout {timeout:?})");
    assert!(
        lasted < timeout - head / 2,
        "the lease was counted from the listing that granted the lock: lost {lasted:?} after it"
    );
}

/// A backend from the application's own connector opens its sessions with
/// the connector's settings: under a path only a digest user may write,
/// a backend from a URL alone is refused (a typed error), and two from a
/// connector authenticated as that user lock, and exclude each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_from_the_applications_connector_uses_its_settings() {
    use zookeeper_client::{Acls, Client, CreateMode};
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let connector = || Client::connector().with_auth("digest", b"app:secret");
    let admin = connector()
        .connect(&server.endpoint())
        .await
        .expect("the application's client");
    admin
        .create(
            "/secured",
            b"",
            &CreateMode::Persistent.with_acls(Acls::creator_all()),
        )
        .await
        .expect("a path only the app may write");
    let url = format!("zk://{}/secured", server.endpoint());
    let anonymous = ZkBackend::connect(&url).await.unwrap().into_locker();
    let refused = anonymous.try_lock("report").await;
    assert!(
        matches!(refused, Err(dlock_core::LockError::PermissionDenied { .. })),
        "a backend without the app's auth wrote under its path: {refused:?}"
    );
    let config = dlock_zk::ZkConfig::from_url(&url).unwrap();
    let a = ZkBackend::from_connector(connector(), config.clone())
        .await
        .expect("a backend from the connector")
        .into_locker();
    let b = ZkBackend::from_connector(connector(), config)
        .await
        .expect("another")
        .into_locker();
    dlock_testkit::assert_locks_are_shared(&a, &b).await;
}

/// With credentials in the URL, every node dlock creates admits only its
/// creator: another client, anonymous or with other credentials, can
/// neither delete a held lock's node nor list or join its queue (a typed
/// error), while a second backend with the same credentials shares the
/// lock. The password shows nowhere in the config's `Debug`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_credentials_only_the_creator_may_touch_a_held_lock_node() {
    use zookeeper_client::{Client, Error as ZkError};
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let endpoint = server.endpoint();
    let url = |userinfo: &str| format!("zk://{userinfo}@{endpoint}/acl");
    let config = dlock_zk::ZkConfig::from_url(&url("app:s3cret")).unwrap();
    assert!(!format!("{config:?}").contains("s3cret"), "{config:?}");
    let holder = ZkBackend::connect_with(config).await.unwrap().into_locker();
    let guard = holder.lock("k").await.unwrap();
    let app = Client::connector()
        .with_auth("digest", b"app:s3cret")
        .connect(&endpoint)
        .await
        .unwrap();
    let parents = app.list_children("/acl").await.unwrap();
    assert_eq!(parents.len(), 1, "{parents:?}");
    let parent = format!("/acl/{}", parents[0]);
    let children = app.list_children(&parent).await.unwrap();
    assert_eq!(children.len(), 1, "{children:?}");
    let node = format!("{parent}/{}", children[0]);
    for path in ["/acl", parent.as_str(), node.as_str()] {
        let (acls, _) = app.get_acl(path).await.unwrap();
        assert!(
            !acls.is_empty()
                && acls
                    .iter()
                    .all(|a| a.scheme() == "digest" && a.id().starts_with("app:")),
            "{path} admits others: {acls:?}"
        );
    }
    let anonymous = Client::connect(&endpoint).await.unwrap();
    let other = Client::connector()
        .with_auth("digest", b"other:pw")
        .connect(&endpoint)
        .await
        .unwrap();
    for (who, client) in [
        ("an anonymous client", &anonymous),
        ("another user", &other),
    ] {
        let deleted = client.delete(&node, None).await;
        assert!(
            matches!(deleted, Err(ZkError::NoAuth)),
            "{who} deleted the held lock's node: {deleted:?}"
        );
        let listed = client.list_children(&parent).await;
        assert!(
            matches!(listed, Err(ZkError::NoAuth)),
            "{who} listed the lock's queue: {listed:?}"
        );
    }
    let intruder = ZkBackend::connect(&url("other:pw"))
        .await
        .unwrap()
        .into_locker();
    match intruder.try_lock("k").await {
        Err(e @ dlock_core::LockError::PermissionDenied { .. }) => {
            assert!(e.to_string().contains("not authorized"), "{e}")
        }
        other => panic!("another user's backend was not refused: {other:?}"),
    }
    let forced = intruder.force_release("k").await;
    assert!(
        matches!(forced, Err(dlock_core::LockError::PermissionDenied { .. })),
        "another user's backend forced the release: {forced:?}"
    );
    let colleague = ZkBackend::connect(&url("app:s3cret"))
        .await
        .unwrap()
        .into_locker();
    assert!(colleague.try_lock("k").await.unwrap().is_none());
    assert!(!guard.is_lost(), "the holder lost its lock");
    guard.release().await.unwrap();
    assert!(colleague.try_lock("k").await.unwrap().is_some());
}

/// A holder whose lock node is deleted by another client (an operator's
/// `delete`, a forced unlock) is told at once: its guard is lost, as the
/// key is free to others from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_node_another_client_deletes_is_told() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let url = format!("zk://{}/del", server.endpoint());
    let holder = ZkBackend::connect(&url).await.unwrap().into_locker();
    let other = ZkBackend::connect(&url).await.unwrap().into_locker();
    let guard = holder.lock("k").await.unwrap();
    // What an operator sees and deletes: the one lock node under the key.
    let raw = zookeeper_client::Client::connect(&server.endpoint())
        .await
        .unwrap();
    let mut nodes = Vec::new();
    for parent in raw.list_children("/del").await.unwrap() {
        for child in raw.list_children(&format!("/del/{parent}")).await.unwrap() {
            nodes.push(format!("/del/{parent}/{child}"));
        }
    }
    assert_eq!(nodes.len(), 1, "the held lock's node: {nodes:?}");
    raw.delete(&nodes[0], None).await.unwrap();
    let deleted = Instant::now();
    let told = tokio::time::timeout(Duration::from_secs(5), guard.lost()).await;
    assert!(
        matches!(told, Ok(dlock_core::LostReason::NotHeld)),
        "the holder was not told its node was deleted: {told:?}"
    );
    assert!(guard.is_lost(), "the guard still says it holds");
    assert!(
        deleted.elapsed() < Duration::from_secs(2),
        "told {:?} after the delete",
        deleted.elapsed()
    );
    let taken = other.try_lock("k").await.unwrap();
    assert!(taken.is_some(), "the key is free to others");
}

/// Fixed leases that were released leave no task behind (see
/// `check_released_fixed_leases_leave_no_tasks`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_fixed_leases_leave_no_timer_tasks_behind() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let url = format!("zk://{}/timers", server.endpoint());
    let locker = ZkBackend::connect(&url).await.unwrap().into_locker();
    session_faults::check_released_fixed_leases_leave_no_tasks(&locker).await;
}

/// `Locker::state` follows the session: `Suspended` while the client is
/// cut off, `Reconnected` when it is back within the session timeout (the
/// lock kept), `Lost` when the session expires, `Reconnected` on a new
/// session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_state_follows_the_session() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    let locker = ZkBackend::connect(&format!(
        "zk://{}/states?session_timeout=4s",
        proxy.endpoint()
    ))
    .await
    .unwrap()
    .into_locker();
    // The client's reconnection attempts after a cut come within about a
    // second: a 4 s session keeps the lock through the short cut.
    session_faults::check_connection_states(
        &locker,
        &proxy,
        Some(Duration::from_millis(300)),
        Duration::from_secs(15),
    )
    .await;
}

/// With `layout=curator`, dlock's plain locks and Apache Curator's
/// `InterProcessMutex` (Debian's `libcurator-recipes-java`, driven by
/// `tests/curator/CuratorLock.java`, which the JDK compiles and runs) on
/// one lock path queue in one line and exclude each other, both ways:
/// Curator waits while dlock holds and takes the mutex after the release;
/// dlock waits while Curator holds and is granted only after Curator's
/// last step under it, with a fence above the one dlock held before. A
/// forced release of Curator's holder, which would never learn of it, is
/// refused, and so is a dlock client in its own layout on that path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_mutex_and_dlock_exclude_each_other() {
    use std::{path::Path, process::Stdio};
    let java = dlock_testkit::fixture::find_binary("java", "default-jdk-headless")
        .expect("java, from a JDK");
    let jars = [
        "curator-recipes",
        "curator-framework",
        "curator-client",
        "zookeeper",
        "zookeeper-jute",
        "guava",
        "slf4j-api",
    ]
    .map(|jar| format!("/usr/share/java/{jar}.jar"));
    for jar in &jars {
        assert!(
            Path::new(jar).is_file(),
            "{jar} is missing: install libcurator-recipes-java"
        );
    }
    let classpath = jars.join(":");
    let program = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/curator/CuratorLock.java"
    );
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let endpoint = server.endpoint();
    let locker = ZkBackend::connect(&format!("zk://{endpoint}/locks?layout=curator"))
        .await
        .unwrap()
        .into_locker();
    let raw = zookeeper_client::Client::connect(&endpoint).await.unwrap();
    let dir = std::env::temp_dir().join(format!("dlock-curator-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let curator = |hold_ms: u64, done: &Path| {
        tokio::process::Command::new(&java)
            .args(["-cp", &classpath, program, &endpoint, "/locks/nightly"])
            .arg(hold_ms.to_string())
            .arg(done)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("run java")
    };
    let queue = || async {
        match raw.list_children("/locks/nightly").await {
            Ok(children) => children,
            Err(zookeeper_client::Error::NoNode) => Vec::new(),
            Err(e) => panic!("listing the lock path: {e}"),
        }
    };

    // dlock holds, in Curator's naming: Curator queues behind and waits.
    let held = locker.lock("nightly").await.unwrap();
    let fence = held.fencing_token().expect("a fence");
    let ours = queue().await;
    assert!(
        ours.len() == 1 && ours[0].starts_with("_c_") && ours[0].contains("-lock-"),
        "dlock's node is not named as Curator names its own: {ours:?}"
    );
    let first_done = dir.join("first");
    let mut waiting = curator(0, &first_done);
    let started = Instant::now();
    while queue().await.len() < 2 {
        assert!(
            !first_done.exists(),
            "Curator took its mutex while dlock held the lock"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "Curator never queued: {:?}",
            waiting.try_wait()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !first_done.exists() && waiting.try_wait().unwrap().is_none(),
        "Curator took its mutex while dlock held the lock"
    );
    held.release().await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(20), waiting.wait_with_output())
        .await
        .expect("Curator never got its mutex after the release")
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("holding") && said.contains("released"),
        "Curator: {out:?}"
    );

    // Curator holds: dlock waits until Curator's last step under it.
    let second_done = dir.join("second");
    let mut holding = curator(3000, &second_done);
    let started = Instant::now();
    while !locker.is_locked("nightly").await.unwrap() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "Curator never took its mutex: {:?}",
            holding.try_wait()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        locker.try_lock("nightly").await.unwrap().is_none(),
        "dlock was granted beside Curator"
    );
    // Curator's holder never watches its own node: forcing it is refused.
    let forced = locker.force_release("nightly").await;
    assert!(
        matches!(forced, Err(dlock_core::LockError::Unsupported { .. })),
        "a Curator holder's node was forced: {forced:?}"
    );
    // A client in dlock's own layout, whose node Curator would misorder,
    // is refused rather than queued.
    let own_layout = ZkBackend::connect(&format!("zk://{endpoint}/locks"))
        .await
        .unwrap()
        .into_locker();
    let mixed = own_layout.try_lock("nightly").await;
    assert!(
        matches!(mixed, Err(dlock_core::LockError::InvalidOptions { .. })),
        "a dlock-layout client queued beside Curator: {mixed:?}"
    );
    let granted = locker
        .lock_with("nightly", LockOptions::new().wait(Duration::from_secs(20)))
        .await
        .expect("dlock's lock after Curator's");
    assert!(
        second_done.exists(),
        "dlock was granted while Curator still held its mutex"
    );
    assert!(
        granted.fencing_token() > Some(fence),
        "the fence did not rise"
    );
    granted.release().await.unwrap();
    let _ = holding.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Curator client's lock node whose data merely starts like dlock's
/// noted proclaim (byte 2, a length, that many bytes) is still Curator's:
/// its holder never watches its own node, so a forced release is refused
/// and the node stays (two holders otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_curator_holder_whose_data_starts_like_ours_is_not_forced() {
    use zookeeper_client::{Client, CreateMode};
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let endpoint = server.endpoint();
    let raw = Client::connect(&endpoint).await.unwrap();
    let persistent = CreateMode::Persistent.with_acls(zookeeper_client::Acls::anyone_all());
    for path in ["/locks", "/locks/nightly"] {
        raw.create(path, b"", &persistent).await.unwrap();
    }
    let ephemeral = CreateMode::EphemeralSequential.with_acls(zookeeper_client::Acls::anyone_all());
    let (_, sequence) = raw
        .create(
            "/locks/nightly/_c_5f0c3a52-8f0e-4c47-9d43-3f6c0e2b7a11-lock-",
            b"\x02\x03abc: Curator's own data",
            &ephemeral,
        )
        .await
        .unwrap();
    let node = format!("/locks/nightly/_c_5f0c3a52-8f0e-4c47-9d43-3f6c0e2b7a11-lock-{sequence}");
    let locker = ZkBackend::connect(&format!("zk://{endpoint}/locks?layout=curator"))
        .await
        .unwrap()
        .into_locker();
    assert!(locker.is_locked("nightly").await.unwrap());
    let forced = locker.force_release("nightly").await;
    assert!(
        matches!(forced, Err(dlock_core::LockError::Unsupported { .. })),
        "a Curator holder's node was forced: {forced:?}"
    );
    assert!(
        raw.check_stat(&node).await.unwrap().is_some(),
        "the Curator holder's node is gone"
    );
}
