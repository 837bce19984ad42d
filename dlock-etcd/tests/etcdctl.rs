//! `layout=etcdctl` against a real etcd: dlock and `etcdctl lock` exclude
//! each other, nested names stay apart, a key left under an entry's name
//! is never taken over (and a wait for it survives a compacted watch),
//! a guard lost with its session or its fixed lease holds up nothing
//! (one that extends its fixed lease still excludes), and an acquisition
//! cancelled mid-enqueue never costs the next one its key.

use std::time::Duration;

use dlock_core::{
    backend::{Backend, Mode, RenewOutcome, RenewRequest},
    BackendExt, LockKey, LockOptions, Locker, Token,
};
use dlock_etcd::{etcd_client, EtcdBackend};
use dlock_testkit::fixture::EtcdServer;
use tokio::time::Instant;

async fn locker(url: &str) -> Locker {
    EtcdBackend::connect(url)
        .await
        .expect("connect to etcd")
        .into_locker()
}

async fn locker_with_ttl(url: &str, ttl: Duration) -> Locker {
    Locker::builder(EtcdBackend::connect(url).await.unwrap())
        .watchdog_lease(ttl)
        .build()
        .unwrap()
}

/// A fresh etcd, the URL of `etcdctl lock`'s layout on it (with a prefix,
/// which plain locks in that layout ignore), and a plain client of it.
async fn etcdctl_layout() -> (EtcdServer, String, etcd_client::Client) {
    let server = EtcdServer::start().expect("start etcd");
    let url = format!("etcd://{}/ignored?layout=etcdctl", server.endpoint());
    let client = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .expect("a plain client");
    (server, url, client)
}

/// The entries under `queue`, by name, with their create revisions.
async fn entries(client: &mut etcd_client::Client, queue: &str) -> Vec<(Vec<u8>, i64)> {
    let read = client
        .get(queue, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    read.kvs()
        .iter()
        .map(|kv| (kv.key().to_vec(), kv.create_revision()))
        .collect()
}

/// With `layout=etcdctl`, dlock's locks and `etcdctl lock NAME` (Debian's
/// `etcd-client`, Go's `concurrency.Mutex`) exclude each other, both
/// ways: `etcdctl` waits while dlock holds and runs its command only after
/// the release; dlock waits while `etcdctl` holds and is granted only
/// after it exits, with a fence above the one dlock held before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_lock_and_dlock_exclude_each_other() {
    use std::process::Stdio;
    let etcdctl = dlock_testkit::fixture::find_binary("etcdctl", "etcd-client")
        .expect("etcdctl, from the etcd-client package");
    let (server, url, _) = etcdctl_layout().await;
    let endpoint = server.endpoint();
    let locker = locker(&url).await;
    let etcdctl_lock = |command: &str| {
        tokio::process::Command::new(&etcdctl)
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &endpoint, "lock", "jobs/nightly", "--"])
            .args(["sh", "-c", command])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("run etcdctl")
    };

    // dlock holds: etcdctl waits.
    let held = locker.lock("jobs/nightly").await.unwrap();
    let waiting = etcdctl_lock("echo ran");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut waiting = waiting;
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "etcdctl ran its command while dlock held the lock"
    );
    let fence = held.fencing_token().expect("a fence");
    held.release().await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(10), waiting.wait_with_output())
        .await
        .expect("etcdctl never got the lock after the release")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ran"),
        "etcdctl: {out:?}"
    );

    // etcdctl holds: dlock waits until it exits.
    let done = std::env::temp_dir().join(format!("dlock-etcdctl-{}-done", std::process::id()));
    let _ = std::fs::remove_file(&done);
    let mut holding = etcdctl_lock(&format!("echo holding; sleep 2; touch {}", done.display()));
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "etcdctl never took the lock"
        );
        if locker.is_locked("jobs/nightly").await.unwrap() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        locker.try_lock("jobs/nightly").await.unwrap().is_none(),
        "dlock was granted beside etcdctl"
    );
    let granted = locker
        .lock_with(
            "jobs/nightly",
            LockOptions::new().wait(Duration::from_secs(10)),
        )
        .await
        .expect("dlock's lock after etcdctl's");
    // etcdctl deletes its key once its command ended: the command's
    // last step is done before dlock's grant.
    assert!(
        done.exists(),
        "dlock was granted while etcdctl still ran its command"
    );
    let _ = holding.wait().await;
    let _ = std::fs::remove_file(&done);
    assert!(granted.fencing_token() > Some(fence));
}

/// With `layout=etcdctl`, lock `a`'s queue `a/` also holds the entries of
/// lock `a/b` (`a/b/{lease}`): they are not `a`'s. `a` is free while
/// `a/b` is held, has no holder, and a forced release of `a` leaves `a/b`
/// alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_a_lock_ignores_the_locks_nested_under_it() {
    let (_server, url, _) = etcdctl_layout().await;
    let (nested, outer) = (locker(&url).await, locker(&url).await);
    let held = nested.lock("a/b").await.unwrap();
    assert_eq!(
        outer.holder("a").await.unwrap(),
        None,
        "a/b read as a's holder"
    );
    assert!(
        !outer.force_release("a").await.unwrap(),
        "a forced release of a found a holder"
    );
    assert!(outer.is_locked("a/b").await.unwrap(), "a/b was released");
    let a = outer
        .try_lock("a")
        .await
        .unwrap()
        .expect("a waited behind a/b");
    assert!(!held.is_lost(), "a/b was lost");
    a.release().await.unwrap();
    held.release().await.unwrap();
}

/// With `layout=etcdctl`, an entry is named by the session's lease alone,
/// so a key left under that name on a lease of its own (as an abandoned
/// fixed-lease grant leaves it; put here with a plain client) is not this
/// session's to take over: an acquisition waits until its lease ends and
/// is then granted with a fence of its own, above the old key's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_a_key_left_on_another_lease_is_never_taken_over() {
    let (_server, url, mut client) = etcdctl_layout().await;
    let locker = locker(&url).await;
    // Learns the entry's name (the session lives on after the release).
    let guard = locker.lock("job").await.unwrap();
    let read = client
        .get("job/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let name = read.kvs()[0].key().to_vec();
    guard.release().await.unwrap();

    let lease = client.lease_grant(3, None).await.unwrap().id();
    let put = client
        .put(
            name.clone(),
            "",
            Some(etcd_client::PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    let left = put.header().unwrap().revision();
    let started = Instant::now();
    assert!(
        locker.try_lock("job").await.unwrap().is_none(),
        "the key left on another lease was taken over"
    );
    let granted = locker
        .lock_with("job", LockOptions::new().wait(Duration::from_secs(15)))
        .await
        .expect("granted once the old lease ended");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "granted {:?} after the old key was left, inside its lease",
        started.elapsed()
    );
    let fence = granted.fencing_token().expect("a fence");
    assert!(
        fence > u64::try_from(left).unwrap(),
        "fence {fence} given twice"
    );
    // The same name, on the same session: the case under test.
    let now = client
        .get("job/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let names: Vec<Vec<u8>> = now.kvs().iter().map(|kv| kv.key().to_vec()).collect();
    assert_eq!(names, [name], "the new entry is not under the old name");
    granted.release().await.unwrap();
}

/// With the etcdctl layout, a guard lost with its session (its lease
/// revoked behind its back) and not yet dropped does not hold up the
/// acquisition of its key already queued behind it in the same process:
/// that one moves to a new session, under another name, and is granted
/// with a higher fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_a_guard_lost_with_its_session_holds_up_nothing() {
    let (_server, url, mut client) = etcdctl_layout().await;
    let locker = locker_with_ttl(&url, Duration::from_secs(3)).await;
    let lost = locker.lock("job").await.unwrap();
    let read = client
        .get("job/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let (old_name, lease) = (read.kvs()[0].key().to_vec(), read.kvs()[0].lease());
    // Queued in the process behind the guard, on the same session.
    let waiting = {
        let locker = locker.clone();
        tokio::spawn(async move {
            locker
                .lock_with("job", LockOptions::new().wait(Duration::from_secs(30)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "granted beside a live guard");
    client.lease_revoke(lease).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), lost.lost())
        .await
        .expect("the guard was not told its session ended");
    let next = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the queued acquisition waited for the lost guard")
        .unwrap()
        .expect("the queued acquisition");
    assert!(
        next.fencing_token() > lost.fencing_token(),
        "{:?} after {:?}",
        next.fencing_token(),
        lost.fencing_token()
    );
    let now = client
        .get("job/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert!(
        now.kvs().len() == 1 && now.kvs()[0].key() != old_name.as_slice(),
        "{:?}",
        now.kvs()
    );
    drop(lost);
    next.release().await.unwrap();
}

/// A fixed lease of `lease` seconds, waiting up to `wait` seconds.
fn fixed(lease: u64, wait: u64) -> LockOptions {
    LockOptions::new()
        .lease(Duration::from_secs(lease))
        .wait(Duration::from_secs(wait))
}

/// Waits (boundedly) until etcd has deleted every entry under `queue`.
async fn until_empty(client: &mut etcd_client::Client, queue: &str) {
    for _ in 0..100 {
        if entries(client, queue).await.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "etcd kept {queue}'s entries: {:?}",
        entries(client, queue).await
    );
}

/// With the etcdctl layout, a guard whose fixed lease ended, kept and not
/// dropped, holds up nothing: once etcd freed the key, the next
/// fixed-lease acquisition of it in the same process (on the same session,
/// so under the same entry name) is granted with a higher fence. The old
/// guard reports lost, a renewal of its token finds it not held, and its
/// release then removes nothing of the new holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_a_kept_guard_whose_fixed_lease_ended_holds_up_nothing() {
    let (_server, url, mut client) = etcdctl_layout().await;
    let backend = EtcdBackend::connect(&url).await.unwrap();
    let (locker, other) = (backend.clone().into_locker(), locker(&url).await);
    let old = locker.lock_with("job", fixed(2, 1)).await.unwrap();
    let old_entries = entries(&mut client, "job/").await;
    tokio::time::timeout(Duration::from_secs(5), old.lost())
        .await
        .expect("the guard was not told its fixed lease ended");
    until_empty(&mut client, "job/").await;

    let started = Instant::now();
    let new = locker
        .lock_with("job", fixed(10, 3))
        .await
        .unwrap_or_else(|e| panic!("etcd freed the key, yet after {:?}: {e}", started.elapsed()));
    assert!(
        new.fencing_token() > old.fencing_token(),
        "{:?} after {:?}",
        new.fencing_token(),
        old.fencing_token()
    );
    let now = entries(&mut client, "job/").await;
    assert_eq!(
        now.iter().map(|(name, _)| name).collect::<Vec<_>>(),
        old_entries.iter().map(|(name, _)| name).collect::<Vec<_>>(),
        "the new entry is not under the old name: not the case under test"
    );

    // Under one name, only the new grant's token holds.
    let renewal = |token: &Token| RenewRequest {
        key: LockKey::new("job").unwrap(),
        mode: Mode::Exclusive,
        token: *token,
        lease: Duration::from_secs(10),
    };
    let renewed = backend
        .renew(&[renewal(old.token()), renewal(new.token())])
        .await
        .unwrap();
    assert_eq!(
        renewed,
        [RenewOutcome::NotHeld, RenewOutcome::Renewed],
        "a renewal counted the new grant's entry as the old guard's"
    );
    assert!(old.release().await.is_err(), "a lost guard released fine");
    assert_eq!(
        entries(&mut client, "job/").await,
        now,
        "the old guard's release removed the new grant's entry"
    );
    assert!(
        other.try_lock("job").await.unwrap().is_none(),
        "granted beside the new holder"
    );
    assert!(!new.is_lost(), "the new holder was lost");
    new.release().await.unwrap();
    assert!(entries(&mut client, "job/").await.is_empty());
}

/// With the etcdctl layout, an acquisition queued in the same process
/// behind a fixed-lease guard is let in when that lease ends, the guard
/// kept and not dropped, and not before: the old guard has reported lost
/// by then. Dropping the old guard afterwards removes nothing of the new
/// holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_a_waiter_behind_a_kept_fixed_lease_is_granted_when_it_ends() {
    let (_server, url, mut client) = etcdctl_layout().await;
    let (locker, other) = (locker(&url).await, locker(&url).await);
    let old = locker.lock_with("job", fixed(2, 1)).await.unwrap();
    let waiting = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock_with("job", fixed(10, 8)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "granted beside a live guard");

    let new = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("the acquisition outlived its own wait limit")
        .unwrap()
        .expect("granted once the old fixed lease ended");
    assert!(old.is_lost(), "granted while the old guard held");
    assert!(
        new.fencing_token() > old.fencing_token(),
        "{:?} after {:?}",
        new.fencing_token(),
        old.fencing_token()
    );
    let now = entries(&mut client, "job/").await;
    drop(old);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        entries(&mut client, "job/").await,
        now,
        "dropping the old guard removed the new grant's entry"
    );
    assert!(
        other.try_lock("job").await.unwrap().is_none(),
        "granted beside the new holder"
    );
    assert!(!new.is_lost(), "the new holder was lost");
    new.release().await.unwrap();
}

/// With the etcdctl layout, a fixed-lease guard that extends its lease
/// keeps excluding the acquisitions of its key queued behind it in the same
/// process past the lease it started with; the next is granted once it
/// releases, with a higher fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_an_extended_fixed_lease_keeps_excluding_the_process() {
    let (_server, url, _) = etcdctl_layout().await;
    let locker = locker(&url).await;
    let held = locker.lock_with("job", fixed(2, 1)).await.unwrap();
    held.extend(Duration::from_secs(8)).await.unwrap();
    let waiting = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock_with("job", fixed(10, 15)).await })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!held.is_lost(), "the extended guard was lost");
    assert!(!waiting.is_finished(), "granted beside the extended guard");
    let fence = held.fencing_token();
    held.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the next acquisition missed the release")
        .unwrap()
        .expect("granted after the release");
    assert!(
        next.fencing_token() > fence,
        "{:?} after {fence:?}",
        next.fencing_token()
    );
    next.release().await.unwrap();
}

/// With the etcdctl layout, an acquisition that finds its entry's name
/// taken by a key on another lease watches that key from the revision it
/// read. If that revision has been compacted meanwhile, the watch is
/// cancelled: the wait reads the key again and watches on, so the key's
/// deletion lets it in at once rather than after the key's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_a_wait_for_a_left_key_survives_a_compacted_watch() {
    let (_server, url, mut client) = etcdctl_layout().await;
    let locker = locker(&url).await;
    // Learns the entry's name (the session lives on after the release).
    let guard = locker.lock("job").await.unwrap();
    let name = entries(&mut client, "job/").await[0].0.clone();
    guard.release().await.unwrap();

    // A key left under that name on a long lease of its own, then the
    // revisions after it compacted away.
    let lease = client.lease_grant(60, None).await.unwrap().id();
    let put = Some(etcd_client::PutOptions::new().with_lease(lease));
    client.put(name.clone(), "", put).await.unwrap();
    let mut last = 0;
    for i in 0..3 {
        let put = client.put("unrelated", i.to_string(), None).await.unwrap();
        last = put.header().unwrap().revision();
    }
    client.compact(last, None).await.unwrap();

    let waiting = {
        let locker = locker.clone();
        tokio::spawn(async move {
            locker
                .lock_with("job", LockOptions::new().wait(Duration::from_secs(30)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished(), "granted beside the left key");
    client.delete(name, None).await.unwrap();
    let deleted = Instant::now();
    let granted = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the wait missed the deletion after its watch was compacted")
        .unwrap()
        .expect("granted once the left key was deleted");
    assert!(!granted.is_lost());
    granted.release().await.unwrap();
    assert!(deleted.elapsed() < Duration::from_secs(5));
}

/// With the etcdctl layout, an acquisition cancelled at any point of its
/// enqueue (whose request runs on, and whose release follows) shares its
/// entry's name with the next acquisition of its key in the same process,
/// on the same session: that one is never handed the cancelled one's key,
/// nor loses its own to the cancelled one's clean-up. Each round cancels
/// a little later; the next holder's key must stay, and exclude others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_etcdctl_layout_a_cancelled_enqueue_never_takes_the_next_holders_key() {
    let (_server, url, mut client) = etcdctl_layout().await;
    let (locker, other) = (locker(&url).await, locker(&url).await);
    // The session exists before the first round.
    locker.lock("job").await.unwrap().release().await.unwrap();
    for round in 0..30u64 {
        let cancelled =
            tokio::time::timeout(Duration::from_micros(round * 150), locker.lock("job")).await;
        if let Ok(guard) = cancelled {
            guard.unwrap().release().await.unwrap();
            continue;
        }
        let held = locker
            .lock_with("job", LockOptions::new().wait(Duration::from_secs(10)))
            .await
            .expect("the next acquisition");
        // Whatever the cancelled one left runs to its end meanwhile.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = entries(&mut client, "job/").await;
        assert_eq!(now.len(), 1, "round {round}: entries {now:?}");
        assert_eq!(
            Some(u64::try_from(now[0].1).unwrap()),
            held.fencing_token(),
            "round {round}: the holder's key is another's"
        );
        assert!(
            other.try_lock("job").await.unwrap().is_none(),
            "round {round}: granted beside the holder"
        );
        held.release().await.unwrap();
    }
    until_empty(&mut client, "job/").await;
}
