//! `OverlapDetector`: counts critical sections that ran at the same time.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Detects overlapping critical sections: wrap each section in
/// [`enter`](OverlapDetector::enter), and afterwards
/// [`overlaps`](OverlapDetector::overlaps) must be zero.
///
/// # Examples
///
/// ```
/// use dlock_testkit::OverlapDetector;
///
/// let d = OverlapDetector::default();
/// let a = d.enter();
/// let b = d.enter(); // a second section while the first runs
/// drop((a, b));
/// assert_eq!(d.overlaps(), 1);
/// assert_eq!(d.entries(), 2);
/// ```
#[derive(Debug, Default)]
pub struct OverlapDetector {
    active: AtomicUsize,
    overlaps: AtomicUsize,
    entries: AtomicUsize,
}

/// One critical section; leaves on drop.
#[derive(Debug)]
#[must_use = "the section ends when this is dropped"]
pub struct Section<'a>(&'a OverlapDetector);

impl OverlapDetector {
    /// Enters a critical section.
    pub fn enter(&self) -> Section<'_> {
        self.entries.fetch_add(1, Ordering::SeqCst);
        if self.active.fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        Section(self)
    }

    /// How many sections started while another was running.
    pub fn overlaps(&self) -> usize {
        self.overlaps.load(Ordering::SeqCst)
    }

    /// How many sections started.
    pub fn entries(&self) -> usize {
        self.entries.load(Ordering::SeqCst)
    }
}

impl Drop for Section<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}
