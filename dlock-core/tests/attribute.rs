//! `#[distributed_lock]` (dlock-macros, re-exported here) at run time, on
//! `MemoryBackend`. It lives here, not in dlock-macros, so that the macro's
//! compile-time tests (`ui.rs`, built by trybuild with every
//! dev-dependency of dlock-macros) need no more than dlock-core.

use std::{
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_core::{
    distributed_lock, BackendExt, LockError, LockOptions, Locker, LostReason, MemoryBackend,
};
use dlock_testkit::{CountingBackend, OverlapDetector};
use tokio::time::Instant;

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Failed,
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}

/// How long another client may take to get a key its holder released (a
/// sixth of the default watchdog lease, so only a release explains it).
const SOON: Duration = Duration::from_secs(dlock_core::DEFAULT_WATCHDOG_LEASE.as_secs() / 6);

async fn acquired_soon(other: &Locker, key: &str) -> bool {
    let start = Instant::now();
    let got = other
        .lock_with(key, dlock_core::LockOptions::new().wait(SOON))
        .await
        .is_ok();
    got && start.elapsed() < SOON
}

#[distributed_lock(key = "stock:{item}", locker = locker)]
async fn buy(locker: &Locker, item: u32, detector: &OverlapDetector) -> Result<(), LockError> {
    let _section = detector.enter();
    tokio::time::sleep(Duration::from_millis(1)).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_calls_never_overlap() {
    let server = MemoryBackend::new();
    let detector = Arc::new(OverlapDetector::default());
    let lockers: Vec<Locker> = (0..5).map(|_| server.clone().into_locker()).collect();
    let calls: Vec<_> = (0..50)
        .map(|i| {
            let (locker, detector) = (lockers[i % 5].clone(), detector.clone());
            tokio::spawn(async move { buy(&locker, 42, &detector).await })
        })
        .collect();
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert_eq!(detector.entries(), 50);
    assert_eq!(detector.overlaps(), 0);
}

#[distributed_lock(key = "acct:{id}", locker = locker)]
async fn transfer(locker: &Locker, id: u32) -> Result<u32, LockError> {
    audit(locker, id).await
}

#[distributed_lock(key = "acct:{id}", locker = locker)]
async fn audit(locker: &Locker, id: u32) -> Result<u32, LockError> {
    Ok(id * 2)
}

#[distributed_lock(key = "tree:{id}", locker = locker)]
async fn walk(locker: &Locker, id: u32, depth: u32) -> Result<u32, LockError> {
    if depth == 0 {
        return Ok(0);
    }
    Ok(1 + Box::pin(walk(locker, id, depth - 1)).await?)
}

#[tokio::test]
async fn nested_and_recursive_calls_re_enter_without_backend_calls() {
    let counting = Arc::new(CountingBackend::new(Arc::new(MemoryBackend::new())));
    let locker = Locker::from_arc(counting.clone());
    assert_eq!(transfer(&locker, 7).await.unwrap(), 14);
    assert_eq!(counting.acquires(), 1, "the nested call asked the backend");
    assert_eq!(walk(&locker, 1, 10).await.unwrap(), 10);
    assert_eq!(counting.acquires(), 2, "the recursion asked the backend");
}

#[distributed_lock(key = "job:{name}", locker = locker)]
async fn failing(locker: &Locker, name: &str) -> Result<(), AppError> {
    Err(AppError::Failed)
}

#[distributed_lock(key = "job:{name}", locker = locker)]
async fn panicking(locker: &Locker, name: &str) -> Result<(), AppError> {
    panic!("the body panicked")
}

#[distributed_lock(key = "job:{name}", locker = locker)]
async fn slow(locker: &Locker, name: &str) -> Result<(), AppError> {
    tokio::time::sleep(Duration::from_secs(3600)).await;
    Ok(())
}

#[tokio::test]
async fn the_lock_is_released_on_err_panic_and_cancellation() {
    let server = MemoryBackend::new();
    let (locker, other) = (server.clone().into_locker(), server.into_locker());

    assert!(matches!(
        failing(&locker, "err").await,
        Err(AppError::Failed)
    ));
    assert!(
        acquired_soon(&other, "job:err").await,
        "not released after Err"
    );

    let panicked = tokio::spawn({
        let locker = locker.clone();
        async move { panicking(&locker, "panic").await }
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    assert!(
        acquired_soon(&other, "job:panic").await,
        "not released after a panic"
    );

    let cancelled = tokio::time::timeout(Duration::from_millis(50), slow(&locker, "cancel")).await;
    assert!(cancelled.is_err());
    assert!(
        acquired_soon(&other, "job:cancel").await,
        "not released after cancellation"
    );
}

#[distributed_lock(key = "slow-report", locker = locker, lease = "200ms")]
async fn slow_report(locker: &Locker, finished: &AtomicU32) -> Result<u32, AppError> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    finished.fetch_add(1, Ordering::SeqCst);
    Ok(7)
}

#[distributed_lock(key = "quick-report", locker = locker, lease = "200ms")]
async fn quick_report(locker: &Locker) -> Result<u32, AppError> {
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(7)
}

/// Without `abort_on_lost`, a body that outlives its lock runs to its end,
/// and the call then says the lock was lost instead of returning the
/// body's value as if it had been done under the lock.
#[tokio::test(start_paused = true)]
async fn a_body_that_outlived_its_lock_returns_lost_not_its_value() {
    let locker = MemoryBackend::new().into_locker();
    let finished = AtomicU32::new(0);
    match slow_report(&locker, &finished).await {
        Err(AppError::Lock(LockError::Lost { key, reason })) => {
            assert_eq!(key, "slow-report");
            assert_eq!(reason, LostReason::LeaseExpired);
        }
        other => panic!("expected the lost error, got {other:?}"),
    }
    assert_eq!(
        finished.load(Ordering::SeqCst),
        1,
        "the body ran to its end"
    );
    assert_eq!(
        quick_report(&locker).await.unwrap(),
        7,
        "a body within its lease"
    );
}

#[distributed_lock(key = "report", locker = locker, lease = "200ms", abort_on_lost)]
async fn long_report(locker: &Locker, progress: &AtomicU32) -> Result<(), AppError> {
    loop {
        progress.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn abort_on_lost_drops_the_body_when_the_lease_runs_out() {
    let locker = MemoryBackend::new().into_locker();
    let progress = AtomicU32::new(0);
    let start = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(10), long_report(&locker, &progress))
        .await
        .expect("the body was not aborted");
    let elapsed = start.elapsed();
    match result {
        Err(AppError::Lock(LockError::Lost { key, reason })) => {
            assert_eq!(key, "report");
            assert_eq!(reason, LostReason::LeaseExpired);
        }
        other => panic!("expected the lost error, got {other:?}"),
    }
    assert!(
        elapsed < Duration::from_millis(200),
        "aborted only after {elapsed:?}"
    );
    assert!(
        elapsed > Duration::from_millis(150),
        "aborted early, after {elapsed:?}"
    );
    let at_abort = progress.load(Ordering::SeqCst);
    assert!(at_abort > 0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        progress.load(Ordering::SeqCst),
        at_abort,
        "the body kept running"
    );
}

#[distributed_lock(key = "nightly", locker = locker, wait = "none")]
async fn nightly(locker: &Locker) -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn wait_none_fails_at_once_when_held() {
    let server = MemoryBackend::new();
    let (locker, other) = (server.clone().into_locker(), server.into_locker());
    nightly(&locker).await.unwrap();
    let held = other.lock("nightly").await.unwrap();
    let start = Instant::now();
    match nightly(&locker).await {
        Err(LockError::WouldBlock { key }) => assert_eq!(key, "nightly"),
        other => panic!("expected WouldBlock, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(1));
    drop(held);
}

#[distributed_lock(key = "nightly", locker = locker, wait = "100ms")]
async fn nightly_patient(locker: &Locker) -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn a_wait_limit_ends_in_timeout() {
    let server = MemoryBackend::new();
    let (locker, other) = (server.clone().into_locker(), server.into_locker());
    let held = other.lock("nightly").await.unwrap();
    let start = Instant::now();
    assert!(matches!(
        nightly_patient(&locker).await,
        Err(LockError::Timeout { .. })
    ));
    assert!(start.elapsed() >= Duration::from_millis(100));
    drop(held);
}

struct Orders {
    locker: Locker,
    shard: u32,
    observer: Locker,
}

struct User {
    id: u64,
}

struct Request {
    user: User,
    order: (u32, &'static str),
}

impl Orders {
    #[distributed_lock(key = "shard:{self.shard}:user:{req.user.id}:{req.order.1}", locker = self.locker)]
    async fn place(&self, req: &Request) -> Result<bool, LockError> {
        // While the body runs, the key built from the fields is held.
        let probe = self.observer.try_lock("shard:3:user:77:book").await?;
        Ok(probe.is_none())
    }

    #[distributed_lock(key = "shard:{self.shard}", locker = self.locker)]
    async fn bump(&mut self) -> Result<u32, LockError> {
        self.shard += 1;
        Ok(self.shard)
    }

    #[distributed_lock(key = "owned:{self.shard}", locker = self.locker.clone())]
    async fn consume(self: Arc<Self>) -> Result<u32, LockError> {
        Ok(self.shard)
    }
}

#[tokio::test]
async fn methods_and_keys_from_fields() {
    let server = MemoryBackend::new();
    let mut orders = Orders {
        locker: server.clone().into_locker(),
        shard: 3,
        observer: server.clone().into_locker(),
    };
    let req = Request {
        user: User { id: 77 },
        order: (1, "book"),
    };
    assert!(
        orders.place(&req).await.unwrap(),
        "the key from the fields was not held"
    );
    assert_eq!(orders.bump().await.unwrap(), 4);
    assert_eq!(Arc::new(orders).consume().await.unwrap(), 4);
}

#[distributed_lock(key = "generic:{id}", locker = locker)]
async fn generic<T: std::fmt::Display + Send + Sync>(
    locker: &Locker,
    id: T,
) -> Result<String, LockError> {
    Ok(id.to_string())
}

#[distributed_lock(key = "{{literal}}:{id}", locker = locker)]
async fn braces(locker: &Locker, id: u32, observer: &Locker) -> Result<bool, LockError> {
    Ok(observer.try_lock("{literal}:5").await?.is_none())
}

#[tokio::test]
async fn generic_fns_and_literal_braces() {
    let server = MemoryBackend::new();
    let locker = server.clone().into_locker();
    assert_eq!(generic(&locker, "x").await.unwrap(), "x");
    assert_eq!(generic(&locker, 5_u8).await.unwrap(), "5");
    assert!(braces(&locker, 5, &server.into_locker()).await.unwrap());
}

#[distributed_lock(key = "{{literal}}", locker = locker)]
async fn literal_only(locker: &Locker, observer: &Locker) -> Result<bool, LockError> {
    Ok(observer.try_lock("{literal}").await?.is_none())
}

#[tokio::test]
async fn doubled_braces_without_placeholders_are_single_braces() {
    let server = MemoryBackend::new();
    let locker = server.clone().into_locker();
    assert!(literal_only(&locker, &server.into_locker()).await.unwrap());
}

#[distributed_lock(key = "point:{x}:{y}:{first}", locker = locker)]
async fn patterns(
    locker: Arc<Locker>,
    (x, y): (i32, i32),
    [first, ..]: [u8; 3],
    observer: &Locker,
) -> Result<bool, LockError> {
    #![allow(clippy::needless_return)]
    //! Inner attributes and docs stay at the top of the body.
    return Ok(observer.try_lock("point:1:2:9").await?.is_none());
}

#[tokio::test]
async fn pattern_parameters_and_inner_attributes() {
    let server = MemoryBackend::new();
    let locker = Arc::new(server.clone().into_locker());
    assert!(patterns(locker, (1, 2), [9, 0, 0], &server.into_locker())
        .await
        .unwrap());
}

#[distributed_lock(key = "dyn", locker = locker, abort_on_lost)]
async fn boxed(
    locker: &Arc<Locker>,
    n: &str,
) -> Result<Box<dyn std::fmt::Display + Send>, AppError> {
    let parsed: u32 = n.parse().map_err(|_| AppError::Failed)?;
    // Coerces to the declared return type, as it would without the macro.
    Ok(Box::new(parsed))
}

#[distributed_lock(key = "bytes", locker = locker, abort_on_lost)]
async fn bytes(locker: &Locker) -> Result<&'static [u8], LockError> {
    Ok(b"abc")
}

#[distributed_lock(key = "opaque", locker = locker, abort_on_lost)]
async fn opaque(locker: &Locker) -> Result<impl std::fmt::Display, LockError> {
    Ok(5)
}

#[tokio::test]
async fn abort_on_lost_keeps_the_return_type_coercions_and_question_marks() {
    let locker = Arc::new(MemoryBackend::new().into_locker());
    assert_eq!(boxed(&locker, "12").await.unwrap().to_string(), "12");
    assert!(matches!(boxed(&locker, "x").await, Err(AppError::Failed)));
    assert_eq!(bytes(&locker).await.unwrap(), b"abc");
    assert_eq!(opaque(&locker).await.unwrap().to_string(), "5");
}

struct Owned {
    locker: Locker,
    name: String,
}

impl Owned {
    #[distributed_lock(key = "owned:{self.name}", locker = self.locker)]
    async fn finish(self) -> Result<String, LockError> {
        // `self` is moved by the body; the key and locker were used before.
        let Owned { name, .. } = self;
        Ok(name)
    }

    /// # Safety
    ///
    /// None needed; `unsafe` is kept on the signature.
    #[distributed_lock(key = "unsafe", locker = self.locker)]
    async unsafe fn marked(&self) -> Result<(), LockError> {
        Ok(())
    }
}

macro_rules! locked_getter {
    ($name:ident -> $ret:ty) => {
        #[distributed_lock(key = "macro", locker = locker)]
        async fn $name(locker: &Locker) -> $ret {
            Ok(1)
        }
    };
}

locked_getter!(from_macro -> Result<u32, LockError>);

#[tokio::test]
async fn self_by_value_unsafe_fns_and_macro_generated_fns() {
    let locker = MemoryBackend::new().into_locker();
    let owned = Owned {
        locker: locker.clone(),
        name: "n".into(),
    };
    // SAFETY: `marked` has no safety requirement.
    unsafe { owned.marked() }.await.unwrap();
    assert_eq!(owned.finish().await.unwrap(), "n");
    assert_eq!(from_macro(&locker).await.unwrap(), 1);
}

#[distributed_lock(key = "joined:{id}", locker = locker)]
async fn section(locker: &Locker, id: u32, detector: &OverlapDetector) -> Result<(), LockError> {
    let _section = detector.enter();
    tokio::time::sleep(Duration::from_millis(5)).await;
    Ok(())
}

#[tokio::test]
async fn calls_joined_in_one_task_exclude_each_other() {
    let locker = MemoryBackend::new().into_locker();
    let detector = OverlapDetector::default();
    for _ in 0..5 {
        let (a, b, c) = tokio::join!(
            section(&locker, 1, &detector),
            section(&locker, 1, &detector),
            section(&locker, 1, &detector),
        );
        a.and(b).and(c).unwrap();
    }
    assert_eq!(detector.entries(), 15);
    assert_eq!(
        detector.overlaps(),
        0,
        "joined calls were in the body together"
    );
}

#[distributed_lock(key = "{a}:{b}", locker = locker, wait = "none", guard = lock)]
async fn pair(locker: &Locker, a: &str, b: &str) -> Result<String, LockError> {
    Ok(lock.key().to_owned())
}

#[distributed_lock(key = "{a}:{b}", locker = locker, guard = lock)]
async fn pair_held(
    locker: &Locker,
    a: &str,
    b: &str,
    other: (&str, &str),
) -> Result<Result<String, LockError>, LockError> {
    let _ = lock;
    // Inside the scope of "x:y:z": the other pair renders the same key and
    // re-enters; outside it (a spawned task) it contends.
    let inside = pair(locker, other.0, other.1).await;
    let (locker, a, b) = (locker.clone(), other.0.to_owned(), other.1.to_owned());
    let outside = tokio::spawn(async move { pair(&locker, &a, &b).await })
        .await
        .unwrap();
    assert!(
        matches!(outside, Err(LockError::WouldBlock { .. })),
        "{outside:?}"
    );
    Ok(inside)
}

#[tokio::test]
async fn a_key_template_is_formatted_as_written() {
    let locker = MemoryBackend::new().into_locker();
    let one = pair(&locker, "x:y", "z").await.unwrap();
    locker.wait_for_releases().await;
    let two = pair(&locker, "x", "y:z").await.unwrap();
    locker.wait_for_releases().await;
    assert_eq!(one, "x:y:z");
    assert_eq!(one, two, "the documented collision: the same key");
    let inside = pair_held(&locker, "x:y", "z", ("x", "y:z")).await.unwrap();
    assert_eq!(inside.unwrap(), "x:y:z");
}

#[distributed_lock(keys = ["account:{from}", "account:{to}"], locker = locker, wait = "10s", guard = both)]
async fn move_money(
    locker: &Locker,
    from: u32,
    to: u32,
    detector: &OverlapDetector,
) -> Result<Vec<String>, LockError> {
    let _inside = detector.enter();
    // Inside the scope of both keys: each re-enters.
    let again = locker.lock(format!("account:{from}")).await?;
    assert!(both
        .guards()
        .iter()
        .any(|g| g.fencing_token() == again.fencing_token()));
    tokio::time::sleep(Duration::from_millis(1)).await;
    Ok(both.keys().map(str::to_owned).collect())
}

#[distributed_lock(keys = ["account:{from}", "account:{to}"], locker = locker, wait = "none")]
async fn move_at_once(locker: &Locker, from: u32, to: u32) -> Result<(), LockError> {
    Ok(())
}

/// `keys = [...]` takes every key in sorted order, whatever order the
/// template names them in: calls that name two accounts in opposite orders
/// neither deadlock nor overlap, the guard names the keys sorted, each key
/// re-enters inside the body, and `wait = "none"` with one key held
/// elsewhere is `WouldBlock` naming that key, holding neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_take_every_lock_in_one_order() {
    let locker = MemoryBackend::new().into_locker();
    let detector = Arc::new(OverlapDetector::default());
    let mut calls = Vec::new();
    for i in 0..40u32 {
        let (locker, detector) = (locker.clone(), detector.clone());
        let (from, to) = if i % 2 == 0 { (7, 3) } else { (3, 7) };
        calls.push(tokio::spawn(async move {
            move_money(&locker, from, to, &detector).await
        }));
    }
    for call in calls {
        let keys = call.await.expect("a call's task").expect("a transfer");
        assert_eq!(keys, ["account:3", "account:7"]);
    }
    assert_eq!(detector.entries(), 40);
    assert_eq!(detector.overlaps(), 0, "two transfers of one pair at once");
    let held = locker.lock("account:7").await.unwrap();
    let other = MemoryBackend::new().into_locker();
    drop(other);
    let refused = tokio::spawn({
        let locker = locker.clone();
        async move { move_at_once(&locker, 3, 7).await }
    })
    .await
    .unwrap();
    assert!(
        matches!(&refused, Err(LockError::WouldBlock { key }) if key == "account:7"),
        "{refused:?}"
    );
    assert!(
        locker.try_lock("account:3").await.unwrap().is_some(),
        "account:3 kept"
    );
    drop(held);
}

#[distributed_lock(key = "period", locker = locker, hold_at_least = "500ms")]
async fn once_a_period(locker: &Locker) -> Result<(), AppError> {
    Ok(())
}

/// `hold_at_least` keeps the key after a body that ended at once, until
/// that long after the grant.
#[tokio::test]
async fn hold_at_least_keeps_the_key_after_a_quick_body() {
    let locker = MemoryBackend::new().into_locker();
    let start = Instant::now();
    once_a_period(&locker).await.unwrap();
    assert!(
        locker.try_lock("period").await.unwrap().is_none(),
        "the key was free at once"
    );
    let next = locker
        .lock_with("period", LockOptions::new().wait(Duration::from_secs(5)))
        .await
        .unwrap();
    let freed = start.elapsed();
    assert!(freed >= Duration::from_millis(500), "freed after {freed:?}");
    // A waiter hears of the earlier end: it is not left waiting for the
    // watchdog lease's.
    assert!(freed < Duration::from_secs(2), "freed after {freed:?}");
    drop(next);
}
