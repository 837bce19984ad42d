//! Locker and guard behaviour that is the same for every backend, pinned on
//! `MemoryBackend`: runtime handling, the default locker, lost holds, wait
//! order and options.

use std::{
    future::Future,
    pin::pin,
    sync::{Arc, Mutex},
    task::{Context, Poll, Waker},
    time::Duration,
};

use dlock_core::{
    backend::{
        AcquireRequest, Acquired, Backend, Capabilities, Mode, ReleaseOutcome, RenewOutcome,
        RenewRequest,
    },
    default_locker, set_default_locker, BackendExt, LockError, LockKey, LockOptions, Locker,
    LostReason, MemoryBackend, Token,
};
use tokio::time::Instant;

#[test]
fn locking_outside_a_tokio_runtime_is_an_error_not_a_panic() {
    let locker = MemoryBackend::new().into_locker();
    let mut cx = Context::from_waker(Waker::noop());
    let attempt = pin!(locker.try_lock("k"));
    match attempt.poll(&mut cx) {
        Poll::Ready(Err(LockError::NoRuntime)) => {}
        other => panic!("expected NoRuntime at once, got {other:?}"),
    }
}

#[test]
fn dropping_a_guard_after_its_runtime_is_gone_leaves_the_lease_to_expire() {
    let server = MemoryBackend::new();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let lease = Duration::from_secs(1);
    let guard = runtime
        .block_on(
            server
                .clone()
                .into_locker()
                .lock_with("k", LockOptions::new().lease(lease)),
        )
        .unwrap();
    drop(runtime);
    drop(guard); // must not panic; nothing can release it now
    assert!(!server.is_idle(), "the lock is still held on the server");
    std::thread::sleep(lease + lease / 4);
    assert!(server.is_idle(), "the lease did not expire");
}

#[tokio::test]
async fn default_locker_is_an_error_until_set() {
    assert!(matches!(default_locker(), Err(LockError::NoDefaultLocker)));
    let server = MemoryBackend::new();
    set_default_locker(server.clone().into_locker());
    let guard = default_locker().unwrap().lock("k").await.unwrap();
    assert!(!server.is_idle());
    guard.release().await.unwrap();
    assert!(server.is_idle());
}

#[tokio::test]
async fn re_entering_a_lost_hold_is_an_error() {
    let locker = MemoryBackend::new().into_locker();
    let guard = locker
        .lock_with("k", LockOptions::new().lease(Duration::from_millis(50)))
        .await
        .unwrap();
    assert_eq!(guard.lost().await, LostReason::LeaseExpired);
    match guard.scope(locker.lock("k")).await {
        Err(LockError::Lost { key, reason }) => {
            assert_eq!(key, "k");
            assert_eq!(reason, LostReason::LeaseExpired);
        }
        other => panic!("re-entered a lost hold: {other:?}"),
    }
}

#[tokio::test]
async fn waiting_forever_is_woken_by_the_release() {
    let server = MemoryBackend::new();
    let (a, b) = (server.clone().into_locker(), server.into_locker());
    let held = a.lock("k").await.unwrap();
    let waiter = tokio::spawn(async move {
        let start = Instant::now();
        let g = b.lock_with("k", LockOptions::new().wait_forever()).await;
        (start.elapsed(), g.map(|g| g.fencing_token()))
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished());
    held.release().await.unwrap();
    let (waited, fence) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(waited >= Duration::from_millis(100));
    assert!(fence.unwrap().is_some());
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order() {
    let server = MemoryBackend::new();
    let holder = server.clone().into_locker();
    let held = holder.lock("k").await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..5 {
        let (locker, order) = (server.clone().into_locker(), order.clone());
        waiters.push(tokio::spawn(async move {
            let g = locker.lock("k").await.unwrap();
            order.lock().unwrap().push(i);
            g.release().await.unwrap();
        }));
        // Let each waiter queue before the next one arrives.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held.release().await.unwrap();
    for w in waiters {
        tokio::time::timeout(Duration::from_secs(5), w)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

/// A backend in front of `MemoryBackend` that changes how grants are
/// answered, to reach core's handling of slow networks.
#[derive(Debug)]
struct Answer {
    inner: MemoryBackend,
    /// Pretend the winning request was sent this much earlier.
    sent_earlier: Duration,
    /// Hold the reply back this long after the server granted.
    reply_delay: Duration,
    /// Hold a release back this long before it reaches the server.
    release_delay: Duration,
}

impl Backend for Answer {
    fn name(&self) -> &'static str {
        "answer"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn acquire(&self, req: AcquireRequest<'_>) -> dlock_core::Result<Option<Acquired>> {
        let granted = self.inner.acquire(req).await?;
        tokio::time::sleep(self.reply_delay).await;
        Ok(granted.map(|a| {
            let late = Acquired::new(a.sent_at() - self.sent_earlier);
            match a.fence() {
                Some(f) => late.with_fence(f),
                None => late,
            }
        }))
    }
    async fn release(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
    ) -> dlock_core::Result<ReleaseOutcome> {
        tokio::time::sleep(self.release_delay).await;
        self.inner.release(key, mode, token).await
    }
    async fn renew(&self, locks: &[RenewRequest]) -> dlock_core::Result<Vec<RenewOutcome>> {
        self.inner.renew(locks).await
    }
}

/// Whether `server` holds nothing within `within`.
async fn eventually_idle(server: &MemoryBackend, within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if server.is_idle() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.is_idle()
}

/// How long a release with no delay of its own may take to settle.
const SETTLE: Duration = Duration::from_secs(2);

#[tokio::test]
async fn a_grant_that_arrives_after_its_lease_is_refused_and_released() {
    let server = MemoryBackend::new();
    let locker = Locker::new(Answer {
        inner: server.clone(),
        sent_earlier: Duration::from_secs(1),
        reply_delay: Duration::ZERO,
        release_delay: Duration::ZERO,
    });
    match locker
        .lock_with("k", LockOptions::new().lease(Duration::from_millis(500)))
        .await
    {
        Err(LockError::Lost {
            reason: LostReason::LeaseExpired,
            ..
        }) => {}
        other => panic!("a guard with an expired lease was handed out: {other:?}"),
    }
    assert!(
        eventually_idle(&server, SETTLE).await,
        "the refused grant was not released"
    );
}

#[tokio::test]
async fn a_grant_whose_reply_misses_the_wait_limit_is_released() {
    let server = MemoryBackend::new();
    let locker = Locker::new(Answer {
        inner: server.clone(),
        sent_earlier: Duration::ZERO,
        reply_delay: Duration::from_secs(3600),
        release_delay: Duration::ZERO,
    });
    let result = locker
        .lock_with("k", LockOptions::new().wait(Duration::from_millis(100)))
        .await;
    assert!(
        matches!(result, Err(LockError::Timeout { .. })),
        "{result:?}"
    );
    assert!(
        eventually_idle(&server, SETTLE).await,
        "a grant in flight was left holding the key"
    );

    // The same when the caller drops the future instead.
    let attempt = tokio::time::timeout(Duration::from_millis(50), locker.lock("k2")).await;
    assert!(attempt.is_err());
    assert!(
        eventually_idle(&server, SETTLE).await,
        "a cancelled grant was left holding the key"
    );
}

/// A backend answers for its own wait a little after the limit (a
/// server's own timer, started when the request arrived, ends it a moment
/// later): its answer is heard, not cut off, so that nothing of the wait
/// is left to end from outside after the caller was told.
#[tokio::test]
async fn a_grant_answered_shortly_after_the_wait_limit_is_kept() {
    let server = MemoryBackend::new();
    let locker = Locker::new(Answer {
        inner: server.clone(),
        sent_earlier: Duration::ZERO,
        reply_delay: Duration::from_millis(250),
        release_delay: Duration::ZERO,
    });
    let start = Instant::now();
    let guard = locker
        .lock_with("k", LockOptions::new().wait(Duration::from_millis(100)))
        .await
        .expect("the answer that came 150 ms past the limit");
    assert!(start.elapsed() >= Duration::from_millis(250));
    assert!(!server.is_idle(), "the kept grant is not held");
    guard.release().await.unwrap();
    assert!(server.is_idle());
}

#[tokio::test]
async fn a_release_dropped_before_it_reached_the_server_is_still_sent() {
    let server = MemoryBackend::new();
    let release_delay = Duration::from_secs(1);
    let locker = Locker::new(Answer {
        inner: server.clone(),
        sent_earlier: Duration::ZERO,
        reply_delay: Duration::ZERO,
        release_delay,
    });
    let guard = locker.lock("k").await.unwrap();
    let cut = tokio::time::timeout(release_delay / 10, guard.release()).await;
    assert!(cut.is_err(), "the release was not cut off: {cut:?}");
    assert!(!server.is_idle(), "released before the delay passed");
    assert!(
        eventually_idle(&server, release_delay + SETTLE).await,
        "a release dropped half-way was never sent"
    );
}

#[test]
fn the_watchdog_outlives_a_runtime_that_shut_down_under_it() {
    let lease = Duration::from_millis(600);
    let locker = Locker::builder(MemoryBackend::new())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    for round in 0..2 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let guard = locker.lock("k").await.unwrap();
            // Past a whole lease: only renewals keep it.
            tokio::time::sleep(lease * 3 / 2).await;
            assert!(
                !guard.is_lost(),
                "round {round}: the watchdog did not renew"
            );
            // Leave the watchdog task mid-period when the runtime goes.
            guard.release().await.unwrap();
        });
        drop(runtime);
    }
}

#[tokio::test]
async fn builder_defaults_apply_and_calls_override_them() {
    let server = MemoryBackend::new();
    let wait = Duration::from_millis(100);
    let locker = Locker::builder(server.clone())
        .wait(wait)
        .lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let other = server.into_locker();
    let held = other.lock("k").await.unwrap();
    let start = Instant::now();
    assert!(matches!(
        locker.lock("k").await,
        Err(LockError::Timeout { .. })
    ));
    assert!(start.elapsed() < wait + Duration::from_secs(2));
    drop(held);
    let g = locker
        .lock_with("k", LockOptions::new().wait(Duration::from_secs(5)))
        .await
        .unwrap();
    // The default fixed lease applies: the guard ends on its own.
    tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn wait_for_releases_returns_once_dropped_guards_were_released() {
    let counting = std::sync::Arc::new(dlock_testkit::CountingBackend::new(std::sync::Arc::new(
        dlock_core::MemoryBackend::new(),
    )));
    let locker = dlock_core::Locker::from_arc(counting.clone());
    // Nothing pending: returns at once.
    locker.wait_for_releases().await;
    for key in ["a", "b", "c"] {
        drop(locker.lock(key).await.unwrap());
    }
    // On this single-threaded runtime the scheduled releases have not run.
    assert_eq!(counting.releases(), 0);
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        locker.wait_for_releases(),
    )
    .await
    .expect("the releases settle");
    assert_eq!(counting.releases(), 3);
}

#[test]
fn the_watchdog_renews_holds_of_every_runtime_when_the_first_is_no_longer_driven() {
    let server = MemoryBackend::new();
    let lease = Duration::from_millis(600);
    let locker = Locker::builder(server.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let current_thread = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    // The first hold starts the watchdog on `first`; after `block_on`
    // returns, nothing drives that runtime any more.
    let first = current_thread();
    let early = first.block_on(locker.lock("early")).unwrap();
    let second = current_thread();
    second.block_on(async {
        let late = locker.lock("late").await.unwrap();
        let rival = server.clone().into_locker();
        // Past three leases: only renewals keep them.
        tokio::time::sleep(lease * 3 + lease / 3).await;
        assert!(
            !late.is_lost(),
            "a hold of the driven runtime was not renewed"
        );
        assert!(
            !early.is_lost(),
            "a hold of the runtime no longer driven was not adopted"
        );
        assert!(rival.try_lock("late").await.unwrap().is_none());
        assert!(rival.try_lock("early").await.unwrap().is_none());
        late.release().await.unwrap();
    });
    drop(early);
    drop(first);
}

/// A backend in front of `MemoryBackend` whose releases fail a given number
/// of times, and which records the tokens it is told to abandon.
#[derive(Debug)]
struct FailingReleases {
    inner: MemoryBackend,
    failures_left: std::sync::atomic::AtomicUsize,
    abandoned: Mutex<Vec<Token>>,
}

impl FailingReleases {
    fn new(inner: MemoryBackend, failures: usize) -> Arc<Self> {
        Arc::new(FailingReleases {
            inner,
            failures_left: failures.into(),
            abandoned: Mutex::default(),
        })
    }
}

impl Backend for FailingReleases {
    fn name(&self) -> &'static str {
        "failing-releases"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn acquire(&self, req: AcquireRequest<'_>) -> dlock_core::Result<Option<Acquired>> {
        self.inner.acquire(req).await
    }
    async fn release(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
    ) -> dlock_core::Result<ReleaseOutcome> {
        use std::sync::atomic::Ordering;
        let fail = self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            let error = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut off");
            return Err(LockError::backend("failing-releases", error));
        }
        self.inner.release(key, mode, token).await
    }
    async fn abandon(&self, _key: &LockKey, _mode: Mode, token: &Token) {
        self.abandoned.lock().unwrap().push(*token);
    }
    async fn renew(&self, locks: &[RenewRequest]) -> dlock_core::Result<Vec<RenewOutcome>> {
        self.inner.renew(locks).await
    }
}

#[tokio::test]
async fn a_failed_release_is_sent_again_until_it_succeeds_and_is_waited_for() {
    let server = MemoryBackend::new();
    let backend = FailingReleases::new(server.clone(), 3);
    let locker = Locker::from_arc(backend.clone());
    let long = LockOptions::new().lease(Duration::from_secs(60));

    // An explicit release hears of the failure; the retries go on.
    let guard = locker.lock_with("k", long).await.unwrap();
    assert!(matches!(
        guard.release().await,
        Err(LockError::Backend { .. })
    ));
    tokio::time::timeout(Duration::from_secs(10), locker.wait_for_releases())
        .await
        .expect("the retries did not end");
    assert!(
        server.is_idle(),
        "wait_for_releases returned before the release was sent again"
    );

    // A dropped guard's release is retried the same way.
    backend
        .failures_left
        .store(3, std::sync::atomic::Ordering::SeqCst);
    drop(locker.lock_with("k", long).await.unwrap());
    tokio::time::timeout(Duration::from_secs(10), locker.wait_for_releases())
        .await
        .expect("the retries did not end");
    assert!(
        server.is_idle(),
        "a dropped guard's release was not retried"
    );
    assert!(backend.abandoned.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_release_that_fails_for_a_whole_lease_abandons_its_token() {
    let backend = FailingReleases::new(MemoryBackend::new(), usize::MAX);
    let locker = Locker::from_arc(backend.clone());
    let lease = Duration::from_millis(400);
    let guard = locker
        .lock_with("k", LockOptions::new().lease(lease))
        .await
        .unwrap();
    let token = *guard.token();
    let start = Instant::now();
    drop(guard);
    tokio::time::timeout(Duration::from_secs(10), locker.wait_for_releases())
        .await
        .expect("the retries did not end");
    assert!(
        start.elapsed() >= lease,
        "gave up after {:?}, before a whole lease",
        start.elapsed()
    );
    assert_eq!(*backend.abandoned.lock().unwrap(), vec![token]);
}

/// A release that keeps the lock until `hold_at_least` waits for a
/// watchdog renewal already on its way: landing after it, that renewal
/// would set the lease back to a whole watchdog lease, here shorter than
/// the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_on_its_way_does_not_undo_hold_at_least() {
    let server = MemoryBackend::new();
    let slow = Arc::new(
        dlock_testkit::CountingBackend::new(Arc::new(server.clone()))
            .renew_delay(Duration::from_millis(60)),
    );
    let locker = Locker::builder(slow.clone())
        .watchdog_lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let other = server.into_locker();
    let hold = Duration::from_secs(1);
    let guard = locker
        .lock_with("k", LockOptions::new().hold_at_least(hold))
        .await
        .unwrap();
    let granted = Instant::now();
    // Release while a renewal waits out its delay.
    let deadline = Instant::now() + Duration::from_secs(5);
    while slow.renewals() == slow.renewals_answered() {
        assert!(Instant::now() < deadline, "no renewal started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    guard.release().await.unwrap();
    tokio::time::sleep_until(granted + hold - Duration::from_millis(200)).await;
    assert!(
        other.try_lock("k").await.unwrap().is_none(),
        "the key freed {:?} after the grant, before hold_at_least",
        granted.elapsed()
    );
}
