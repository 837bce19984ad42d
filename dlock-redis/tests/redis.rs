//! Redis-specific behaviour, against real `redis-server` processes: Redlock
//! with nodes down or a round cancelled half-way, a restart mid-hold, key
//! naming, unreachable servers
//! (wake-ups and herds across processes: `dlock-testkit/tests/faults.rs`).

mod common;

use common::calls;

use std::time::Duration;

use dlock_core::{BackendExt, LockError, LockOptions, Locker, LostReason};
use dlock_redis::{redis, RedisBackend};
use dlock_testkit::fixture::{free_port, RedisServer};
use tokio::time::Instant;

/// Five Redis servers, for Redlock.
fn five_nodes() -> Vec<RedisServer> {
    RedisServer::start_many(5).expect("redis-server")
}

fn redlock_url(servers: &[RedisServer]) -> String {
    RedisServer::redlock_url(servers)
}

async fn locker(url: &str) -> Locker {
    RedisBackend::connect(url)
        .await
        .expect("connect")
        .into_locker()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_grants_with_two_of_five_down_and_refuses_with_three() {
    let mut servers = five_nodes();
    let url = redlock_url(&servers);
    let (a, b) = (locker(&url).await, locker(&url).await);

    servers[0].process().kill();
    servers[3].process().kill();
    for round in 0..5 {
        let guard = a
            .lock_with(
                "minority-down",
                LockOptions::new().wait(Duration::from_secs(5)),
            )
            .await
            .unwrap_or_else(|e| panic!("round {round}: no lock with 3 of 5 nodes up: {e}"));
        assert!(
            guard.fencing_token().is_none(),
            "Redlock must not claim fencing tokens"
        );
        assert!(
            b.try_lock("minority-down").await.unwrap().is_none(),
            "granted twice with 3 of 5 up"
        );
        guard.release().await.unwrap();
    }

    servers[1].process().kill();
    let start = Instant::now();
    match a.try_lock("minority-down").await {
        Err(LockError::Backend {
            backend: "redis", ..
        }) => {}
        other => panic!("with 2 of 5 nodes up, expected a backend error, got {other:?}"),
    }
    match a
        .lock_with(
            "minority-down",
            LockOptions::new().wait(Duration::from_secs(1)),
        )
        .await
    {
        Err(LockError::Backend { .. }) | Err(LockError::Timeout { .. }) => {}
        other => panic!("with 2 of 5 nodes up, a lock was granted: {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "refusing took {:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_loses_the_lock_and_the_guard_says_so() {
    let mut server = RedisServer::start().expect("redis-server");
    let lease = Duration::from_secs(3);
    let backend = RedisBackend::connect(&server.url()).await.unwrap();
    let a = Locker::builder(backend)
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let guard = a.lock("restart").await.unwrap();
    tokio::time::sleep(lease).await;
    assert!(!guard.is_lost());

    let fence_before = guard
        .fencing_token()
        .expect("single node gives fencing tokens");
    server.restart().expect("restart redis-server");
    let restarted = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the guard was not told the server lost its lock");
    let noticed = restarted.elapsed();
    println!(
        "restart noticed after {noticed:?} (renewal tick {:?})",
        lease / 3
    );
    assert_eq!(reason, LostReason::NotHeld, "after {noticed:?}");
    // One tick, plus the reconnect: well before the lease could explain it.
    assert!(noticed < lease * 2 / 3, "noticed only after {noticed:?}");

    // The restarted server lost its counter, yet fencing tokens keep growing.
    drop(guard);
    let after = a.lock("restart").await.unwrap();
    let fence_after = after.fencing_token().unwrap();
    assert!(
        fence_after > fence_before,
        "fence went from {fence_before} to {fence_after}"
    );
}

async fn evalsha_calls(server: &RedisServer) -> u64 {
    calls(server, "evalsha").await
}

/// Without fences (`fence=off`), an uncontended lock is one plain `SET NX
/// PX` and its release one script, and no fence is given; with them (the
/// default), the acquire is a script that also writes the counter. The
/// release script's `RENAME` leaves the token behind, with no `SET` (see
/// `a_release_sent_again_after_its_reply_was_lost_is_a_no_op_that_succeeds`).
/// Elections, which order leaders by fence, are refused without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fences_an_uncontended_lock_is_one_plain_set() {
    let server = RedisServer::start().expect("redis-server");
    let unfenced = locker(&format!("{}?fence=off", server.url())).await;
    let fenced = locker(&server.url()).await;
    for (locker, fences, scripts_per_lock, sets_per_lock) in
        [(&unfenced, false, 1, 1), (&fenced, true, 2, 2)]
    {
        // The first lock of a locker may load the scripts.
        locker.lock("warm").await.unwrap().release().await.unwrap();
        let (sets, scripts) = (calls(&server, "set").await, evalsha_calls(&server).await);
        for _ in 0..10 {
            let guard = locker.lock("plain").await.unwrap();
            assert_eq!(guard.fencing_token().is_some(), fences);
            guard.release().await.unwrap();
        }
        assert_eq!(
            evalsha_calls(&server).await - scripts,
            10 * scripts_per_lock,
            "scripts per lock and release, fences {fences}"
        );
        assert_eq!(
            calls(&server, "set").await - sets,
            10 * sets_per_lock,
            "SETs per lock and release (in scripts too), fences {fences}"
        );
    }
    assert!(matches!(
        unfenced.leader("chair").await,
        Err(LockError::Unsupported { .. })
    ));
    assert_eq!(fenced.leader("chair").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_behind_a_bare_majority_does_not_spin() {
    let mut servers = five_nodes();
    let url = redlock_url(&servers);
    let (holder, waiter) = (locker(&url).await, locker(&url).await);
    servers[3].process().kill();
    servers[4].process().kill();
    let guard = holder.lock("bare").await.unwrap();
    servers[3].restart().unwrap();
    servers[4].restart().unwrap();
    // The waiter wins the two fresh nodes each round, never a majority.
    let before = evalsha_calls(&servers[3]).await;
    let result = waiter
        .lock_with("bare", LockOptions::new().wait(Duration::from_secs(2)))
        .await;
    assert!(
        matches!(result, Err(LockError::Timeout { .. })),
        "{result:?}"
    );
    let rounds = evalsha_calls(&servers[3]).await - before;
    println!("acquire rounds on a fresh node in 2 s: {rounds}");
    assert!(rounds <= 10, "the waiter spun: {rounds} rounds in 2 s");
    drop(guard);
}

/// Whether `server` has the lock key of `key` (a key with no braces,
/// stored as `dlock:{key}`).
async fn has_key(server: &RedisServer, key: &str) -> bool {
    let mut raw = server.connection().await;
    let exists: i64 = redis::cmd("EXISTS")
        .arg(format!("dlock:{{{key}}}"))
        .query_async(&mut raw)
        .await
        .unwrap();
    exists == 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_round_cancelled_half_way_leaves_no_key_on_any_node() {
    let mut servers = five_nodes();
    let url = redlock_url(&servers);
    let (a, b) = (locker(&url).await, locker(&url).await);
    // Connected to every node first: the round's requests then wait in the
    // paused nodes' sockets, to run when they resume.
    a.lock("warm").await.unwrap().release().await.unwrap();
    for server in &mut servers[2..] {
        server.process().pause().unwrap();
    }
    // Boxed, so that dropping it drops the attempt itself.
    let mut attempt =
        Box::pin(a.lock_with("half-way", LockOptions::new().wait(Duration::from_secs(30))));
    tokio::select! {
        result = &mut attempt => panic!("with 3 of 5 nodes paused: {result:?}"),
        () = tokio::time::sleep(Duration::from_millis(500)) => {}
    }
    // Half-way: two nodes set the key, three have yet to read the request.
    for server in &servers[..2] {
        assert!(has_key(server, "half-way").await, "the round had not begun");
    }
    drop(attempt);
    for server in &mut servers[2..] {
        server.process().resume().unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), a.wait_for_releases())
        .await
        .expect("the cancelled round's releases did not settle");
    // The paused nodes ran the round's request when they resumed, then
    // its release: no node keeps the key for a lease nobody holds.
    for (i, server) in servers.iter().enumerate() {
        assert!(
            !has_key(server, "half-way").await,
            "node {i} keeps the cancelled round's key"
        );
    }
    let taken = b.try_lock("half-way").await.unwrap();
    assert!(taken.is_some(), "the key stayed taken after the cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_keys_with_braces_spaces_and_unicode_are_stored_escaped() {
    let server = RedisServer::start().expect("redis-server");
    let (a, b) = (locker(&server.url()).await, locker(&server.url()).await);
    let mut key = String::from("{tag} with spaces, ключ 🔒 %7B");
    while key.len() < 1024 {
        key.push('x');
    }
    assert_eq!(key.len(), 1024);
    let guard = a.lock(&key).await.unwrap();
    assert!(b.try_lock(&key).await.unwrap().is_none());

    let mut raw = server.connection().await;
    let escaped = key
        .replace('%', "%25")
        .replace('{', "%7B")
        .replace('}', "%7D");
    let name = format!("dlock:{{{escaped}}}");
    let stored: Option<String> = redis::cmd("GET")
        .arg(&name)
        .query_async(&mut raw)
        .await
        .unwrap();
    // The token, then the holder's note between `~`s.
    let stored = stored.expect("stored");
    assert_eq!(
        stored.split('~').next(),
        Some(guard.token().to_string().as_str())
    );
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&name)
        .query_async(&mut raw)
        .await
        .unwrap();
    let lease = dlock_core::DEFAULT_WATCHDOG_LEASE.as_millis() as i64;
    assert!(ttl > 0 && ttl <= lease, "the lease is the key's TTL: {ttl}");

    guard.release().await.unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&name)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(exists, 0, "release left the key");
    assert!(b.try_lock(&key).await.unwrap().is_some());
}

#[tokio::test]
async fn an_unreachable_server_is_a_typed_error_within_the_connect_timeout() {
    let port = free_port().unwrap();
    let url = format!("redis://127.0.0.1:{port}/");
    let config = dlock_redis::RedisConfig::from_url(&url).unwrap();
    let start = Instant::now();
    match RedisBackend::connect(&url).await {
        Err(LockError::Backend {
            backend: "redis", ..
        }) => {}
        other => panic!("expected a backend error, got {other:?}"),
    }
    // Nothing listens: refused at once, or at worst one connect timeout
    // and one response timeout, with a margin.
    let limit = config.connect_timeout() + config.response_timeout() + Duration::from_secs(2);
    assert!(start.elapsed() < limit, "took {:?}", start.elapsed());
    match RedisBackend::connect("redis://127.0.0.1:notaport/").await {
        Err(LockError::InvalidOptions { .. }) => {}
        other => panic!("expected InvalidOptions, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_is_lost_before_anyone_else_acquires() {
    let server = RedisServer::start().expect("redis-server");
    let proxy = dlock_testkit::fixture::TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let lease = Duration::from_secs(1);
    let cut_off = Locker::builder(
        RedisBackend::connect(&format!("redis://{}/", proxy.endpoint()))
            .await
            .unwrap(),
    )
    .watchdog_lease(lease)
    .build()
    .unwrap();
    let other = locker(&server.url()).await;
    let guard = cut_off.lock("cut").await.unwrap();
    tokio::time::sleep(lease).await;
    assert!(!guard.is_lost());

    proxy.block();
    let blocked = Instant::now();
    let next = other
        .lock_with("cut", LockOptions::new().wait(Duration::from_secs(20)))
        .await
        .unwrap();
    let after = blocked.elapsed();
    // Checked on one monotonic clock, at the moment the other client holds.
    assert!(
        guard.is_lost(),
        "another client acquired while the cut-off guard said it held"
    );
    assert!(after >= lease / 2, "acquired only {after:?} after the cut");
    println!("acquired {after:?} after the cut (lease {lease:?})");
    drop(next);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_locks_again_at_once_queues_behind_the_waiter_it_woke() {
    let server = RedisServer::start().expect("redis-server");
    let locker = locker(&server.url()).await;
    let wait = LockOptions::new().wait(Duration::from_secs(10));
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    for round in 0..5 {
        order.lock().unwrap().clear();
        let held = locker.lock("fair").await.unwrap();
        let waiter = tokio::spawn({
            let (locker, order, wait) = (locker.clone(), order.clone(), wait);
            async move {
                let guard = locker.lock_with("fair", wait).await.unwrap();
                order.lock().unwrap().push("waiter");
                guard.release().await.unwrap();
            }
        });
        // Long enough for the waiter to have tried, subscribed and slept,
        // with room for a loaded machine.
        tokio::time::sleep(Duration::from_millis(500)).await;
        held.release().await.unwrap();
        let again = locker.lock_with("fair", wait).await.unwrap();
        order.lock().unwrap().push("releaser");
        again.release().await.unwrap();
        waiter.await.unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["waiter", "releaser"],
            "round {round}: the releasing task barged in ahead of the waiter"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_won_before_the_slow_nodes_answer_leaves_no_key_after_its_release() {
    let mut servers = five_nodes();
    let url = redlock_url(&servers);
    let (a, b) = (locker(&url).await, locker(&url).await);
    // Connected to every node first: requests to the paused nodes then
    // wait in their sockets, to run when they resume.
    a.lock("warm").await.unwrap().release().await.unwrap();
    for server in &mut servers[3..] {
        server.process().pause().unwrap();
    }
    let guard = a
        .lock_with("slow", LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .expect("a majority of three answers");
    assert!(
        b.try_lock("slow").await.unwrap().is_none(),
        "granted twice with two nodes paused"
    );
    guard.release().await.unwrap();
    for server in &mut servers[3..] {
        server.process().resume().unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), a.wait_for_releases())
        .await
        .expect("the releases did not settle");
    // The paused nodes granted the round late, then ran its release.
    let deadline = Instant::now() + Duration::from_secs(10);
    for (i, server) in servers.iter().enumerate() {
        while has_key(server, "slow").await {
            assert!(
                Instant::now() < deadline,
                "node {i} keeps the key of a released lock"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let taken = b.try_lock("slow").await.unwrap();
    assert!(taken.is_some(), "the key stayed taken after the release");
}

/// A backend on the application's own `redis::Client` locks the same keys
/// as one built from a URL: each excludes the other, fencing tokens grow
/// across both, and a Redlock config is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_on_the_applications_client_shares_the_locks() {
    let server = RedisServer::start().expect("redis-server");
    let client = redis::Client::open(server.url()).unwrap();
    let own = RedisBackend::from_client(client.clone())
        .await
        .unwrap()
        .into_locker();
    let by_url = locker(&server.url()).await;
    dlock_testkit::assert_locks_are_shared(&own, &by_url).await;
    let redlock = dlock_redis::RedisConfig::from_url("redis+redlock://a:1,b:1,c:1").unwrap();
    assert!(matches!(
        RedisBackend::from_client_with(client, &redlock).await,
        Err(LockError::InvalidOptions { .. })
    ));
}

/// `Locker::state` follows the backend's own requests: renewals that
/// cannot reach the server are `Suspended`, the next answered one
/// `Reconnected` (the lock kept), renewals failing for longer than the
/// lease `Lost`, and the next answer `Reconnected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_state_follows_the_renewals() {
    let server = RedisServer::start().expect("redis-server");
    let proxy = dlock_testkit::fixture::TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let locker = Locker::builder(
        RedisBackend::connect(&format!("redis://{}/", proxy.endpoint()))
            .await
            .unwrap(),
    )
    // Renewals every 2 s: the short cut (noticed at the next renewal,
    // then 1.2 s) ends well inside the lease.
    .watchdog_lease(Duration::from_secs(6))
    .build()
    .unwrap();
    dlock_testkit::session_faults::check_connection_states(
        &locker,
        &proxy,
        Some(Duration::from_millis(1200)),
        Duration::from_secs(20),
    )
    .await;
}

/// A server whose traffic goes dark (nothing refused, nothing answered):
/// the watchdog gives each renewal one period and drops it unanswered,
/// which is `Suspended`, then `Lost` once the lease has run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_state_sees_renewals_that_go_unanswered() {
    use dlock_core::ConnectionState;
    let server = RedisServer::start().expect("redis-server");
    let proxy = dlock_testkit::fixture::TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let lease = Duration::from_secs(3);
    let locker = Locker::builder(
        RedisBackend::connect(&format!("redis://{}/", proxy.endpoint()))
            .await
            .unwrap(),
    )
    .watchdog_lease(lease)
    .build()
    .unwrap();
    let guard = locker.lock("dark").await.unwrap();
    let mut state = locker.state();
    proxy.black_hole();
    for (wanted, within) in [
        (ConnectionState::Suspended, lease),
        (ConnectionState::Lost, lease * 2),
    ] {
        let seen = tokio::time::timeout(within, state.wait_for(|s| *s == wanted))
            .await
            .is_ok();
        assert!(
            seen,
            "no {wanted:?} within {within:?}: {:?}",
            *state.borrow()
        );
    }
    assert!(guard.is_lost());
}

/// A release whose reply is lost (the connection cut after the server ran
/// it) and which is sent again, as core's retry sends it, finds the key
/// gone, and even held by the next owner: the second send must be a no-op
/// that answers `Released`, not `NotHeld` (which tells the caller its lock
/// was lost), and must leave the next owner's lock alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_sent_again_after_its_reply_was_lost_is_a_no_op_that_succeeds() {
    use dlock_core::{
        backend::{Backend, Mode, ReleaseOutcome},
        LockKey, Token,
    };
    let server = RedisServer::start().expect("redis-server");
    let proxy = dlock_testkit::fixture::TcpProxy::start(server.host_port().parse().unwrap())
        .await
        .unwrap();
    let cut = RedisBackend::connect(&format!("redis://{}/", proxy.endpoint()))
        .await
        .unwrap();
    let direct = RedisBackend::connect(&server.url()).await.unwrap();
    let mut admin = server.connection().await;
    let holder = direct.clone().into_locker();
    holder.lock("resent").await.unwrap().leak();
    let hex: String = redis::cmd("GET")
        .arg("dlock:{resent}")
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut bytes = [0u8; 16];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("a hex token");
    }
    let (key, token) = (LockKey::new("resent").unwrap(), Token::from_bytes(bytes));

    // The release reaches the server and waits there (writes paused);
    // its reply is then dropped, and the connection cut once it ran.
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(600)
        .arg("WRITE")
        .query_async(&mut admin)
        .await
        .unwrap();
    let releasing = {
        let (cut, key) = (cut.clone(), key.clone());
        tokio::spawn(async move { cut.release(&key, Mode::Exclusive, &token).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.black_hole();
    let ran = Instant::now();
    loop {
        let held: Option<String> = redis::cmd("GET")
            .arg("dlock:{resent}")
            .query_async(&mut admin)
            .await
            .unwrap();
        if held.is_none() {
            break;
        }
        assert!(
            ran.elapsed() < Duration::from_secs(5),
            "the release never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.block();
    let first = tokio::time::timeout(Duration::from_secs(10), releasing)
        .await
        .expect("the cut release never ended")
        .unwrap();
    assert!(first.is_err(), "a release whose reply was lost: {first:?}");

    // The next owner takes the key; then the same token's release is sent
    // again.
    let next = holder.lock("resent").await.unwrap();
    let again = direct.release(&key, Mode::Exclusive, &token).await;
    assert!(
        matches!(again, Ok(ReleaseOutcome::Released)),
        "the release sent again after its reply was lost answered {again:?}"
    );
    assert!(!next.is_lost());
    let held: Option<String> = redis::cmd("GET")
        .arg("dlock:{resent}")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        held.is_some_and(|h| h != hex),
        "the resent release touched the next owner's lock"
    );
    next.release().await.expect("the next owner releases");
}
