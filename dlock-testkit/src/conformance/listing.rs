//! Who holds what: the note every lock carries shows in
//! [`Locker::holder`](dlock_core::Locker::holder) and
//! [`Locker::list`](dlock_core::Locker::list); a listing pages through any
//! number of locks, each once, and shows only what is held now. Backends
//! that cannot list refuse with a typed `Unsupported`.

use std::collections::HashSet;

use dlock_core::{
    backend::{HeldLock, HolderNote, MAX_HOLDER_NOTE},
    InvalidReason, LockError, LockOptions, Locker,
};

use super::{must, patient, Harness};

/// Every lock under `prefix`, page by page (at most `page` each, and at
/// most 1000 pages), or `None` if the backend refuses to list, which must
/// be a typed `Unsupported` at the first page, from a harness that does
/// not say it [lists](Harness::lists).
async fn listed(h: &Harness, locker: &Locker, prefix: &str, page: usize) -> Option<Vec<HeldLock>> {
    let mut listing = locker.list(prefix).page_size(page);
    let mut all = Vec::new();
    for pages in 0.. {
        assert!(pages < 1000, "[{}] a listing never ended", h.name);
        match listing.next_page().await {
            Ok(Some(locks)) => {
                assert!(
                    locks.len() <= page,
                    "[{}] a page of {} locks, asked for at most {page}",
                    h.name,
                    locks.len()
                );
                all.extend(locks);
            }
            Ok(None) => break,
            Err(LockError::Unsupported { .. }) if pages == 0 && !h.lists => return None,
            Err(e) => panic!("[{}] list {prefix:?}: unexpected error: {e}", h.name),
        }
    }
    Some(all)
}

/// The keys of `locks`, as listed.
fn keys(locks: &[HeldLock]) -> Vec<String> {
    locks.iter().map(|l| l.key().to_string()).collect()
}

/// A lock's note (set, and by default `HOSTNAME:PID`) shows in
/// `holder` and `list`, with its fence; a note too long is a typed error
/// before anything is sent.
pub async fn a_note_shows_in_holder_and_list(h: &Harness) {
    let (a, b) = (h.locker().await, h.locker().await);
    let prefix = h.key("notes/");
    let (noted, plain) = (format!("{prefix}noted"), format!("{prefix}plain"));
    let too_long = LockOptions::new().holder_note("n".repeat(MAX_HOLDER_NOTE + 1));
    match a.try_lock_with(&noted, too_long).await {
        Err(LockError::InvalidOptions {
            reason: InvalidReason::HolderNote { .. },
        }) => {}
        other => panic!(
            "[{}] a note too long: expected InvalidReason::HolderNote, got {other:?}",
            h.name
        ),
    }
    let note = "conformance: job 7 on worker-3";
    let guard = must(
        h,
        "lock with a note",
        a.lock_with(&noted, patient().holder_note(note)).await,
    );
    let plain_guard = must(
        h,
        "lock without a note",
        a.lock_with(&plain, patient()).await,
    );
    match b.holder(&noted).await {
        Ok(Some(holder)) => match holder.note() {
            Some(shown) => assert_eq!(shown, note, "[{}] holder's note", h.name),
            None => assert!(!h.lists, "[{}] holder shows no note", h.name),
        },
        // A backend that cannot read holders says so.
        Err(LockError::Unsupported { .. }) if !h.lists => {}
        other => panic!("[{}] holder of a held key: {other:?}", h.name),
    }
    let Some(locks) = listed(h, &b, &prefix, 10).await else {
        return;
    };
    assert_eq!(
        keys(&locks),
        [noted.clone(), plain.clone()],
        "[{}] listed keys",
        h.name
    );
    let process = HolderNote::process();
    for (lock, guard, note) in [
        (&locks[0], &guard, note),
        (&locks[1], &plain_guard, process.as_str()),
    ] {
        let holders = lock.holders();
        assert_eq!(
            holders.len(),
            1,
            "[{}] holders of {}: {holders:?}",
            h.name,
            lock.key()
        );
        assert_eq!(
            holders[0].note(),
            Some(note),
            "[{}] listed note of {}",
            h.name,
            lock.key()
        );
        if let (Some(listed), Some(held)) = (holders[0].fence(), guard.fencing_token()) {
            assert_eq!(listed, held, "[{}] listed fence of {}", h.name, lock.key());
        }
    }
}

/// A listing of more locks than one page reads them all, each once, page
/// by page, and none whose key does not start with the prefix.
pub async fn list_pages_through_more_locks_than_one_page(h: &Harness) {
    const LOCKS: usize = 25;
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    let prefix = h.key("pages/");
    let outside = must(
        h,
        "lock outside the prefix",
        a.lock_with(&h.key("pages-not-listed"), patient()).await,
    );
    let mut guards = vec![outside];
    let mut wanted = Vec::new();
    for i in 0..LOCKS {
        let key = format!("{prefix}{i:02}");
        let locker = if i % 2 == 0 { &a } else { &b };
        guards.push(must(
            h,
            "lock a key to list",
            locker.lock_with(&key, patient()).await,
        ));
        wanted.push(key);
    }
    let Some(locks) = listed(h, &c, &prefix, 10).await else {
        return;
    };
    let mut got = keys(&locks);
    let unique: HashSet<_> = got.iter().cloned().collect();
    assert_eq!(
        unique.len(),
        got.len(),
        "[{}] a key listed twice: {got:?}",
        h.name
    );
    got.sort();
    assert_eq!(got, wanted, "[{}] listed keys", h.name);
}

/// A released lock leaves the list at once; the others stay.
pub async fn a_released_lock_leaves_the_list(h: &Harness) {
    let (a, b) = (h.locker().await, h.locker().await);
    let prefix = h.key("released/");
    let (first, second) = (format!("{prefix}first"), format!("{prefix}second"));
    let one = must(h, "lock the first", a.lock_with(&first, patient()).await);
    let two = must(h, "lock the second", a.lock_with(&second, patient()).await);
    let Some(locks) = listed(h, &b, &prefix, 10).await else {
        return;
    };
    assert_eq!(
        keys(&locks),
        [first.clone(), second.clone()],
        "[{}] both held",
        h.name
    );
    must(h, "release the first", one.release().await);
    let locks = listed(h, &b, &prefix, 10).await.unwrap_or_default();
    assert_eq!(keys(&locks), [second], "[{}] after a release", h.name);
    must(h, "release the second", two.release().await);
    let locks = listed(h, &b, &prefix, 10).await.unwrap_or_default();
    assert!(
        locks.is_empty(),
        "[{}] after both releases: {:?}",
        h.name,
        keys(&locks)
    );
}

/// Keys held throughout a listing are each listed exactly once, while
/// other keys among them are taken and released between its pages.
pub async fn a_listing_sees_each_steady_key_once_while_others_come_and_go(h: &Harness) {
    const STEADY: usize = 12;
    let (a, b, c) = (h.locker().await, h.locker().await, h.locker().await);
    let prefix = h.key("churn/");
    let mut steady = Vec::new();
    let mut wanted = Vec::new();
    for i in 0..STEADY {
        let key = format!("{prefix}{i:02}");
        steady.push(must(
            h,
            "lock a steady key",
            a.lock_with(&key, patient()).await,
        ));
        wanted.push(key);
    }
    let mut listing = c.list(&prefix).page_size(3);
    let mut seen = Vec::new();
    let mut coming: Vec<dlock_core::LockGuard> = Vec::new();
    for page in 0.. {
        assert!(page < 100, "[{}] a listing never ended", h.name);
        let locks = match listing.next_page().await {
            Ok(Some(locks)) => locks,
            Ok(None) => break,
            Err(LockError::Unsupported { .. }) if page == 0 && !h.lists => return,
            Err(e) => panic!("[{}] list: unexpected error: {e}", h.name),
        };
        seen.extend(keys(&locks));
        // Between pages: a key before the cursor and one after it come,
        // and the last that came goes.
        if let Some(gone) = coming.pop() {
            must(h, "release a coming key", gone.release().await);
        }
        for name in [format!("{prefix}00-{page}"), format!("{prefix}99-{page}")] {
            coming.push(must(
                h,
                "lock a coming key",
                b.lock_with(&name, patient()).await,
            ));
        }
    }
    for key in &wanted {
        let times = seen.iter().filter(|seen| *seen == key).count();
        assert_eq!(
            times, 1,
            "[{}] {key} listed {times} times: {seen:?}",
            h.name
        );
    }
    let unique: HashSet<_> = seen.iter().collect();
    assert_eq!(
        unique.len(),
        seen.len(),
        "[{}] a key listed twice: {seen:?}",
        h.name
    );
    drop(coming);
    drop(steady);
}
