//! An undo matches its effect (property 10): cleanup armed for a dropped
//! future undoes exactly what the server granted to it, never a hold the
//! client owns for someone else, and never twice. Read locks show it
//! best: where a server stacks one session's shared holds, an unlock sent
//! for a read that was never granted removes a live reader's hold, and a
//! writer gets in beside it.

use std::time::Duration;

use dlock_core::{backend::Mode, LockKey, LockOptions};
use tokio::time::Instant;

use super::{
    must, patient,
    primitives::{offered, waiting_writer},
    Harness,
};

/// How many reads are cut off, and how many other keys keep the reader's
/// client busy meanwhile.
const CUT_READS: usize = 32;
const BUSY_KEYS: usize = 8;

/// Reads cut off while their client is busy never undo a live reader's
/// hold. Reader A holds the key and a writer on another client waits for
/// it. A's client is kept busy locking 8 other keys, while 32 more reads
/// of the key through A are each cut off after 1 ms (before their
/// statement is sent, mostly, since A's connections are busy). 1.5 s
/// later the writer still waits and A's guard is not lost; once A
/// releases, the writer gets the key.
pub async fn cancelled_reads_never_undo_a_live_readers_hold(h: &Harness) {
    let key = h.key("undo-cut-reads");
    let (a, w) = (h.locker().await, h.locker().await);
    if !offered(h, &a, &key, Mode::Write).await {
        return;
    }
    let reading = must(h, "read", a.lock_mode(&key, Mode::Read, patient()).await);
    let writing = waiting_writer(&w, &key);
    // Let the writer queue on the server.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let busy_until = Instant::now() + Duration::from_millis(1500);
    let busy: Vec<_> = (0..BUSY_KEYS)
        .map(|i| {
            let (locker, key) = (a.clone(), h.key(&format!("undo-busy-{i}")));
            tokio::spawn(async move {
                // At most 10,000 rounds, and only until `busy_until`.
                for _ in 0..10_000 {
                    if Instant::now() >= busy_until {
                        break;
                    }
                    if let Ok(guard) = locker.lock_with(&key, patient()).await {
                        let _ = guard.release().await;
                    }
                }
            })
        })
        .collect();
    for _ in 0..CUT_READS {
        let read = a.lock_mode(&key, Mode::Read, patient());
        // Granted within the millisecond or not, the read is gone after it.
        let _ = tokio::time::timeout(Duration::from_millis(1), read).await;
    }
    for task in busy {
        task.await.expect("a busy task panicked");
    }
    tokio::time::sleep_until(busy_until).await;
    assert!(
        !reading.is_lost(),
        "[{}] the reader's guard says lost, though nobody took its lock",
        h.name
    );
    assert!(
        !writing.is_finished(),
        "[{}] a writer was granted beside a live reader: a cut-off read \
         undid a hold it never had",
        h.name
    );
    must(h, "the reader's release", reading.release().await);
    let written = must(h, "the writer's turn", writing.await.expect("writer task"));
    drop(written);
}

/// A release cut off once its statement is on its way is not sent a
/// second time. A client holds two reads of the key (one session holds
/// both, where the server stacks them); the first one's release is
/// polled once and dropped, and then sent again through its guard. The
/// second reader still holds the key: a writer on another client is
/// refused, and the second guard is not lost. 4 rounds.
pub async fn a_release_cut_off_mid_statement_is_not_sent_twice(h: &Harness) {
    let key = h.key("undo-cut-release");
    let (a, w) = (h.locker().await, h.locker().await);
    if !offered(h, &a, &key, Mode::Write).await {
        return;
    }
    let lock_key = LockKey::new(&key).expect("a valid key");
    for round in 0..4 {
        let first = must(
            h,
            "first read",
            a.lock_mode(&key, Mode::Read, patient()).await,
        );
        let second = must(
            h,
            "second read",
            a.lock_mode(&key, Mode::Read, patient()).await,
        );
        // Polled once, so sent if the client's connection was free, then
        // dropped before its answer.
        let cut = a.backend().release(&lock_key, Mode::Read, first.token());
        let _ = tokio::time::timeout(Duration::ZERO, cut).await;
        // Whether the cut one was sent or not, this one frees the key of
        // the first reader, once.
        let _ = first.release().await;
        let writer = must(
            h,
            "a writer's attempt",
            w.try_lock_mode(&key, Mode::Write, LockOptions::new()).await,
        );
        assert!(
            writer.is_none(),
            "[{}] round {round}: a writer got in beside a live reader: a release \
             cut off mid-statement was sent again and removed the other reader's hold",
            h.name
        );
        assert!(
            !second.is_lost(),
            "[{}] round {round}: the second reader's guard says lost",
            h.name
        );
        must(h, "the second reader's release", second.release().await);
    }
    let writer = must(
        h,
        "a writer's attempt on the free key",
        w.try_lock_mode(&key, Mode::Write, LockOptions::new()).await,
    );
    assert!(
        writer.is_some(),
        "[{}] the key is still held after every reader released it",
        h.name
    );
}
