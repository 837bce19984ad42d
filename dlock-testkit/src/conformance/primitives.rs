//! Read-write locks and semaphores: readers share and writers are alone, a
//! waiting writer keeps new readers out, permits are never exceeded and
//! come back from a crashed holder within its lease, cancelled waits leave
//! nothing, stale guards are refused, and bad counts are typed errors.
//!
//! A backend without a primitive (see `Capabilities`) must refuse it with
//! `LockError::Unsupported`: each check then checks exactly that.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dlock_core::{
    backend::{Mode, ReleaseOutcome, RenewOutcome, RenewRequest},
    DistSemaphore, InvalidReason, LockError, LockKey, LockOptions, Locker, LostReason,
};
use tokio::time::Instant;

use super::{must, patient, Harness, PATIENCE};

/// Whether the backend offers `mode`; if not, checks that asking for it is
/// [`LockError::Unsupported`], and the caller's check ends there.
pub(super) async fn offered(h: &Harness, locker: &Locker, key: &str, mode: Mode) -> bool {
    if h.capabilities().await.supports(mode) {
        return true;
    }
    match locker.try_lock_mode(key, mode, LockOptions::new()).await {
        Err(LockError::Unsupported { .. }) => false,
        other => panic!(
            "[{}] a backend without {mode:?} must say Unsupported, got {other:?}",
            h.name
        ),
    }
}

/// A writer through `locker` that waits for `key` (up to four times
/// [`PATIENCE`]), in a task of its own.
pub(super) fn waiting_writer(
    locker: &Locker,
    key: &str,
) -> tokio::task::JoinHandle<dlock_core::Result<dlock_core::LockGuard>> {
    let (locker, key) = (locker.clone(), key.to_owned());
    tokio::spawn(async move {
        locker
            .lock_mode(&key, Mode::Write, LockOptions::new().wait(4 * PATIENCE))
            .await
    })
}

/// Returns once a reader through `other` (a client that holds nothing of
/// `key`) is refused: a writer waits on the server. Until then a reader
/// may still pass it.
async fn until_the_writer_waits(h: &Harness, other: &Locker, key: &str) {
    let queued = Instant::now();
    loop {
        let late = must(
            h,
            "try read",
            other
                .try_lock_mode(key, Mode::Read, LockOptions::new())
                .await,
        );
        match late {
            None => return,
            Some(late) => drop(late),
        }
        assert!(
            queued.elapsed() < PATIENCE,
            "[{}] readers kept passing a waiting writer",
            h.name
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Readers of different clients hold at once, and a writer overlaps
/// nobody: 4 clients with 2 reader tasks and 1 writer task each, 6 rounds
/// apiece, counted by who is inside.
pub async fn readers_share_and_a_writer_excludes_everyone(h: &Harness) {
    let key = h.key("rw");
    let (a, b) = (h.locker().await, h.locker().await);
    if !offered(h, &a, &key, Mode::Read).await {
        return;
    }
    let one = must(h, "read", a.lock_mode(&key, Mode::Read, patient()).await);
    let two = must(
        h,
        "second client's read",
        b.try_lock_mode(&key, Mode::Read, LockOptions::new()).await,
    );
    assert!(two.is_some(), "[{}] two readers did not share", h.name);
    let write = must(
        h,
        "try write",
        b.try_lock_mode(&key, Mode::Write, LockOptions::new()).await,
    );
    assert!(write.is_none(), "[{}] a writer joined readers", h.name);
    drop((one, two));

    let readers = Arc::new(AtomicUsize::new(0));
    let writers = Arc::new(AtomicUsize::new(0));
    let broken = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let locker = h.locker().await;
        for task in 0..3 {
            let mode = if task == 2 { Mode::Write } else { Mode::Read };
            let (locker, key, name) = (locker.clone(), key.clone(), h.name.clone());
            let (readers, writers, broken) = (readers.clone(), writers.clone(), broken.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..6 {
                    let guard = locker
                        .lock_mode(&key, mode, LockOptions::new().wait(4 * PATIENCE))
                        .await
                        .unwrap_or_else(|e| panic!("[{name}] {mode:?}: {e}"));
                    let (mine, other) = if mode == Mode::Write {
                        (&writers, &readers)
                    } else {
                        (&readers, &writers)
                    };
                    let before = mine.fetch_add(1, Ordering::SeqCst);
                    if other.load(Ordering::SeqCst) != 0 || (mode == Mode::Write && before != 0) {
                        broken.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    if other.load(Ordering::SeqCst) != 0 {
                        broken.fetch_add(1, Ordering::SeqCst);
                    }
                    mine.fetch_sub(1, Ordering::SeqCst);
                    drop(guard);
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("a reader or writer task panicked");
    }
    assert_eq!(
        broken.load(Ordering::SeqCst),
        0,
        "[{}] a writer overlapped a reader or another writer",
        h.name
    );
}

/// A writer that waits behind a reader keeps new readers out (no writer
/// starvation), gets the lock when the reader goes, and the reader who
/// came after it waits for it.
pub async fn a_waiting_writer_keeps_new_readers_out(h: &Harness) {
    let key = h.key("rw-starve");
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    if !offered(h, &a, &key, Mode::Write).await {
        return;
    }
    let reading = must(h, "read", a.lock_mode(&key, Mode::Read, patient()).await);
    let writing = waiting_writer(&b, &key);
    until_the_writer_waits(h, &c, &key).await;
    let (reader_key, reader) = (key.clone(), c.clone());
    let late_reader = tokio::spawn(async move {
        reader
            .lock_mode(
                &reader_key,
                Mode::Read,
                LockOptions::new().wait(4 * PATIENCE),
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !writing.is_finished(),
        "[{}] the writer joined a reader",
        h.name
    );
    assert!(
        !late_reader.is_finished(),
        "[{}] a reader passed a waiting writer",
        h.name
    );
    drop(reading);
    let written = must(h, "the writer's turn", writing.await.expect("writer task"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !late_reader.is_finished(),
        "[{}] a reader joined the writer",
        h.name
    );
    drop(written);
    let late = must(
        h,
        "the late reader's turn",
        late_reader.await.expect("reader task"),
    );
    drop(late);
}

/// A waiting writer keeps out new readers of the reading client itself,
/// not only of others: client A reads, a writer on B waits for it, and a
/// second read through A then waits behind the writer (no writer
/// starvation by one busy client). Once A's first read goes, the writer
/// gets the key, and A's second read only after it.
pub async fn a_waiting_writer_keeps_out_the_readers_own_client(h: &Harness) {
    let key = h.key("rw-own-client");
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    if !offered(h, &a, &key, Mode::Write).await {
        return;
    }
    let reading = must(h, "read", a.lock_mode(&key, Mode::Read, patient()).await);
    let writing = waiting_writer(&b, &key);
    until_the_writer_waits(h, &c, &key).await;
    let (reader_key, reader) = (key.clone(), a.clone());
    let own_reader = tokio::spawn(async move {
        reader
            .lock_mode(
                &reader_key,
                Mode::Read,
                LockOptions::new().wait(4 * PATIENCE),
            )
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !own_reader.is_finished(),
        "[{}] a second read of the reading client passed a waiting writer",
        h.name
    );
    drop(reading);
    let written = must(h, "the writer's turn", writing.await.expect("writer task"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !own_reader.is_finished(),
        "[{}] a reader joined the writer",
        h.name
    );
    drop(written);
    let late = must(
        h,
        "the second read's turn",
        own_reader.await.expect("reader task"),
    );
    drop(late);
}

/// `N` clients hold the `N` permits at once, the next is refused, and
/// under 16 contenders the permits held never exceed `N`, and every
/// waiter is woken in time (a wake-up lost between reading the queue and
/// watching it strands a waiter until its wait limit).
pub async fn permits_are_never_exceeded(h: &Harness) {
    const N: u32 = 3;
    let key = h.key("permits");
    let first = h.locker().await;
    if !offered(h, &first, &key, Mode::Permits { count: 1, limit: N }).await {
        return;
    }
    let mut held = Vec::new();
    for _ in 0..N {
        let semaphore = DistSemaphore::with_options(&h.locker().await, &key, N, patient());
        held.push(
            must(h, "a free permit", semaphore.try_acquire().await)
                .unwrap_or_else(|| panic!("[{}] fewer than {N} holders ran at once", h.name)),
        );
    }
    let extra = DistSemaphore::new(&first, &key, N);
    assert!(
        must(h, "one permit too many", extra.try_acquire().await).is_none(),
        "[{}] a permit beyond the limit was granted",
        h.name
    );
    drop(held);

    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for client in 0..8 {
        let locker = h.locker().await;
        for task in 0..2 {
            let count = if (client + task) % 3 == 0 { 2 } else { 1 };
            // Each wait well within the check's time: 16 short holds of
            // 3 permits take milliseconds, and only a lost wake-up waits
            // out a limit.
            let semaphore =
                DistSemaphore::with_options(&locker, &key, N, LockOptions::new().wait(PATIENCE));
            let (inside, most, name) = (inside.clone(), most.clone(), h.name.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    let permit = semaphore
                        .acquire_many(count)
                        .await
                        .unwrap_or_else(|e| panic!("[{name}] acquire {count}: {e}"));
                    let now = inside.fetch_add(count as usize, Ordering::SeqCst) + count as usize;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(count as usize, Ordering::SeqCst);
                    drop(permit);
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("a permit task panicked");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(
        most <= N as usize,
        "[{}] {most} permits held at once, of {N}",
        h.name
    );
}

/// A holder that vanishes with permits on a fixed lease keeps them until
/// the lease ends (others are refused), and not after: a waiter gets them
/// then.
pub async fn a_crashed_permit_holder_gives_them_back_after_its_lease(h: &Harness) {
    let key = h.key("permits-crash");
    let (a, b) = (h.locker().await, h.locker().await);
    if !offered(h, &a, &key, Mode::Permits { count: 1, limit: 2 }).await {
        return;
    }
    let lease = Duration::from_millis(600);
    let sent = Instant::now();
    let crashed = DistSemaphore::with_options(&a, &key, 2, patient().lease(lease));
    let permits = must(h, "both permits", crashed.acquire_many(2).await);
    permits.into_guard().leak();
    let other = DistSemaphore::with_options(&b, &key, 2, patient());
    assert!(
        must(h, "try while held", other.try_acquire().await).is_none(),
        "[{}] a leaked permit was free at once",
        h.name
    );
    let back = must(
        h,
        "the permits after the lease",
        other.acquire_many(2).await,
    );
    let after = sent.elapsed();
    assert!(
        after >= lease.mul_f64(0.9),
        "[{}] the permits came back after {after:?}, inside their {lease:?} lease",
        h.name
    );
    drop(back);
}

/// 64 waits for permits dropped half-way (by their wait limit, and by
/// abort) leave no permit and no queue entry: once the holder goes, a new
/// client takes every permit at once.
pub async fn cancelled_permit_waits_leave_nothing(h: &Harness) {
    const N: u32 = 2;
    let key = h.key("permits-cancel");
    let holder = h.locker().await;
    if !offered(h, &holder, &key, Mode::Permits { count: 1, limit: N }).await {
        return;
    }
    let all = must(
        h,
        "every permit",
        DistSemaphore::new(&holder, &key, N).acquire_many(N).await,
    );
    let mut waits = Vec::new();
    for i in 0..64 {
        let locker = if i % 8 == 0 {
            h.locker().await
        } else {
            holder.clone()
        };
        let limit = Duration::from_millis(50 + (i % 4) * 25);
        let semaphore =
            DistSemaphore::with_options(&locker, &key, N, LockOptions::new().wait(limit));
        waits.push(tokio::spawn(
            async move { semaphore.acquire().await.map(drop) },
        ));
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    for wait in waits.iter().step_by(2) {
        wait.abort();
    }
    for wait in waits {
        match wait.await {
            Err(e) if e.is_cancelled() => {}
            Ok(Err(LockError::Timeout { .. })) => {}
            other => panic!("[{}] a cancelled wait ended with {other:?}", h.name),
        }
    }
    assert!(
        !all.is_lost(),
        "[{}] the holder lost its permits to the waits dropped beside it",
        h.name
    );
    drop(all);
    let fresh = DistSemaphore::with_options(&h.locker().await, &key, N, patient());
    let every = must(
        h,
        "every permit after the storm",
        fresh.acquire_many(N).await,
    );
    drop(every);
}

/// A permit whose lease ran out can neither release nor renew what it no
/// longer holds, once others hold the permits.
pub async fn stale_permits_cannot_release_or_renew(h: &Harness) {
    let key = h.key("permits-stale");
    let (a, b) = (h.locker().await, h.locker().await);
    let mode = Mode::Permits { count: 1, limit: 1 };
    if !offered(h, &a, &key, mode).await {
        return;
    }
    let stale = must(
        h,
        "a permit on a fixed lease",
        a.lock_mode(&key, mode, patient().lease(Duration::from_millis(300)))
            .await,
    );
    let reason = tokio::time::timeout(PATIENCE, stale.lost()).await;
    assert_eq!(
        reason,
        Ok(LostReason::LeaseExpired),
        "[{}] the permit's lease did not end",
        h.name
    );
    let fresh = must(
        h,
        "the permit after it",
        b.lock_mode(&key, mode, patient()).await,
    );
    let lock_key = LockKey::new(&key).expect("valid key");
    let renewed = must(
        h,
        "renew a stale permit",
        a.backend()
            .renew(&[RenewRequest {
                key: lock_key.clone(),
                mode,
                token: *stale.token(),
                lease: Duration::from_secs(60),
            }])
            .await,
    );
    assert_eq!(
        renewed,
        vec![RenewOutcome::NotHeld],
        "[{}] a stale permit renewed",
        h.name
    );
    let released = must(
        h,
        "release a stale permit",
        a.backend().release(&lock_key, mode, stale.token()).await,
    );
    assert_eq!(
        released,
        ReleaseOutcome::NotHeld,
        "[{}] a stale permit released",
        h.name
    );
    assert!(
        matches!(stale.release().await, Err(LockError::Lost { .. })),
        "[{}] releasing a stale permit must say Lost",
        h.name
    );
    assert!(!fresh.is_lost(), "[{}] the fresh permit was taken", h.name);
    let extra = DistSemaphore::new(&b, &key, 1);
    assert!(must(h, "try the one permit", extra.try_acquire().await).is_none());
}

/// Bad permit counts, and a client naming another limit than the
/// semaphore's holders, are typed errors.
pub async fn bad_permit_counts_are_typed_errors(h: &Harness) {
    let key = h.key("permits-bad");
    let (a, b) = (h.locker().await, h.locker().await);
    for (count, limit) in [(0, 3), (4, 3), (1, 0)] {
        let asked = a
            .try_lock_mode(&key, Mode::Permits { count, limit }, LockOptions::new())
            .await;
        let bad_count = InvalidReason::Permits { count, limit };
        assert!(
            matches!(&asked, Err(LockError::InvalidOptions { reason }) if *reason == bad_count),
            "[{}] {count} of {limit} permits: {asked:?}",
            h.name
        );
        let semaphore = DistSemaphore::new(&a, &key, limit);
        assert!(
            matches!(
                semaphore.try_acquire_many(count).await,
                Err(LockError::InvalidOptions { reason }) if reason == bad_count
            ),
            "[{}] DistSemaphore took {count} of {limit}",
            h.name
        );
    }
    if !offered(h, &a, &key, Mode::Permits { count: 1, limit: 3 }).await {
        return;
    }
    let held = must(h, "1 of 3", DistSemaphore::new(&a, &key, 3).acquire().await);
    let other = DistSemaphore::with_options(&b, &key, 4, patient())
        .try_acquire()
        .await;
    assert!(
        matches!(
            other,
            Err(LockError::InvalidOptions {
                reason: InvalidReason::PermitLimitMismatch {
                    theirs: 3,
                    ours: 4,
                    ..
                }
            })
        ),
        "[{}] a client naming 4 permits where 3 are held got {other:?}",
        h.name
    );
    drop(held);
}

/// `DistSemaphore::available` reads, from another client and without
/// taking any, the limit less the permits held: all three free, one after
/// two are taken, still one while a waiter for two stands in line (a
/// waiter holds nothing), one again once the release lets the waiter in,
/// and all three after every release.
pub async fn available_counts_the_permits_held(h: &Harness) {
    const N: u32 = 3;
    let key = h.key("available");
    let (holder, reader) = (h.locker().await, h.locker().await);
    if !offered(h, &holder, &key, Mode::Permits { count: 1, limit: N }).await {
        let refused = DistSemaphore::new(&reader, &key, N).available().await;
        assert!(
            matches!(refused, Err(LockError::Unsupported { .. })),
            "[{}] permits read without semaphores: {refused:?}",
            h.name
        );
        return;
    }
    let read = DistSemaphore::new(&reader, &key, N);
    let available = |what: &'static str| {
        let read = &read;
        async move { must(h, what, read.available().await) }
    };
    assert_eq!(available("an unused semaphore").await, N, "[{}]", h.name);
    let semaphore = DistSemaphore::with_options(&holder, &key, N, patient());
    let two = must(h, "two permits", semaphore.acquire_many(2).await);
    assert_eq!(available("two held").await, 1, "[{}] two held", h.name);
    let waiting = {
        let semaphore = DistSemaphore::with_options(&h.locker().await, &key, N, patient());
        tokio::spawn(async move { semaphore.acquire_many(2).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        available("a waiter in line").await,
        1,
        "[{}] a waiter counted as a holder",
        h.name
    );
    must(h, "the first two go", two.release().await);
    let next = must(
        h,
        "the waiter's two",
        waiting.await.expect("the waiter's task"),
    );
    assert_eq!(available("the waiter's two held").await, 1, "[{}]", h.name);
    must(h, "the waiter's two go", next.release().await);
    assert_eq!(
        available("all released").await,
        N,
        "[{}] permits left held",
        h.name
    );
}
