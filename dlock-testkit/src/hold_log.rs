//! `HoldLog`: an exact overlap detector across processes. Every holder
//! appends the interval it held on `CLOCK_MONOTONIC` (one clock for every
//! process on the machine); afterwards any two intervals that intersect are
//! two holders at once.

use std::{
    collections::BTreeMap,
    fs::OpenOptions,
    io::Write,
    path::{Path, PathBuf},
};

/// Nanoseconds on `CLOCK_MONOTONIC`, which every process on the machine
/// reads alike (unlike [`std::time::Instant`], which cannot leave its
/// process).
///
/// # Examples
///
/// ```
/// let a = dlock_testkit::monotonic_ns();
/// assert!(dlock_testkit::monotonic_ns() >= a);
/// ```
#[must_use]
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer;
    // CLOCK_MONOTONIC is always available on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    let secs = u64::try_from(now.tv_sec).expect("a monotonic clock is not negative");
    let nanos = u64::try_from(now.tv_nsec).expect("nanoseconds are not negative");
    secs * 1_000_000_000 + nanos
}

/// One hold: from just after the grant was seen to just before the release
/// was sent (or the last guarded step that checked the guard was still
/// held), in [`monotonic_ns`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Interval {
    /// When the holder knew it held.
    pub start: u64,
    /// The last moment it acted as holder.
    pub end: u64,
}

/// A file that holders in any process append their intervals to, one line
/// each (`<holder> <start> <end>`, written with one `O_APPEND` write, which
/// Linux keeps whole). A holder may record the same hold again with a later
/// end as it goes on (a holder that may be killed records after each step);
/// the latest end counts.
///
/// With a correct lock, a hold starts after the previous one's release was
/// sent, so no two intervals intersect; [`overlaps`](HoldLog::overlaps)
/// counts those that do.
///
/// # Examples
///
/// ```
/// use dlock_testkit::HoldLog;
///
/// let dir = tempfile::tempdir().unwrap();
/// let log = HoldLog::new(&dir.path().join("holds"));
/// log.record("a", 10, 20).unwrap();
/// log.record("b", 21, 30).unwrap();
/// assert_eq!(log.overlaps().unwrap(), 0);
/// log.record("c", 25, 40).unwrap(); // while b held
/// assert_eq!(log.overlaps().unwrap(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct HoldLog {
    path: PathBuf,
}

impl HoldLog {
    /// The log kept in the file at `path` (created on the first record).
    pub fn new(path: &Path) -> HoldLog {
        HoldLog {
            path: path.to_owned(),
        }
    }

    /// Where the log is kept.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records that `holder` held from `start` to `end` (both from
    /// [`monotonic_ns`]). `holder` names one hold: no spaces, unique across
    /// processes (a pid and a counter).
    ///
    /// # Errors
    ///
    /// If the file cannot be appended to.
    pub fn record(&self, holder: &str, start: u64, end: u64) -> std::io::Result<()> {
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        file.write_all(format!("{holder} {start} {end}\n").as_bytes())
    }

    /// Every hold recorded, its latest end taken, sorted by start.
    ///
    /// # Errors
    ///
    /// If the file cannot be read, or has a line this type did not write.
    pub fn intervals(&self) -> std::io::Result<Vec<Interval>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let mut holds: BTreeMap<(&str, u64), u64> = BTreeMap::new();
        for line in text.lines() {
            let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, line.to_owned());
            let mut parts = line.split(' ');
            let (Some(holder), Some(start), Some(end), None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(bad());
            };
            let start: u64 = start.parse().map_err(|_| bad())?;
            let end: u64 = end.parse().map_err(|_| bad())?;
            if end < start {
                return Err(bad());
            }
            let latest = holds.entry((holder, start)).or_insert(end);
            *latest = (*latest).max(end);
        }
        let mut intervals: Vec<Interval> = holds
            .into_iter()
            .map(|((_, start), end)| Interval { start, end })
            .collect();
        intervals.sort_unstable();
        Ok(intervals)
    }

    /// How many holds started while an earlier one had not ended: 0 for a
    /// lock that never granted twice.
    ///
    /// # Errors
    ///
    /// As [`intervals`](HoldLog::intervals).
    pub fn overlaps(&self) -> std::io::Result<usize> {
        Ok(overlapping(&self.intervals()?))
    }

    /// The most holds that were open at one instant: at most a
    /// semaphore's limit for holds of one permit each, 1 for a lock.
    ///
    /// # Errors
    ///
    /// As [`intervals`](HoldLog::intervals).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_testkit::HoldLog;
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let log = HoldLog::new(&dir.path().join("holds"));
    /// log.record("a", 0, 30).unwrap();
    /// log.record("b", 10, 20).unwrap();
    /// log.record("c", 20, 40).unwrap(); // b ended as c began
    /// assert_eq!(log.most_at_once().unwrap(), 2);
    /// ```
    pub fn most_at_once(&self) -> std::io::Result<usize> {
        Ok(most_at_once(&self.intervals()?))
    }
}

/// The most of `intervals` open at one instant. Touching ends are not
/// open together.
fn most_at_once(intervals: &[Interval]) -> usize {
    // Ends sort before starts at the same instant.
    let mut edges: Vec<(u64, bool)> = intervals
        .iter()
        .flat_map(|i| [(i.start, true), (i.end, false)])
        .collect();
    edges.sort_unstable();
    let (mut open, mut most) = (0_usize, 0);
    for (_, starts) in edges {
        if starts {
            open += 1;
            most = most.max(open);
        } else {
            open = open.saturating_sub(1);
        }
    }
    most
}

/// How many of `intervals` (sorted by start) start before an earlier one
/// ended. Touching ends are not an overlap.
fn overlapping(intervals: &[Interval]) -> usize {
    let mut latest_end = None;
    let mut overlaps = 0;
    for hold in intervals {
        if latest_end.is_some_and(|end| hold.start < end) {
            overlaps += 1;
        }
        latest_end = latest_end.max(Some(hold.end));
    }
    overlaps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holds(pairs: &[(u64, u64)]) -> Vec<Interval> {
        pairs
            .iter()
            .map(|&(start, end)| Interval { start, end })
            .collect()
    }

    #[test]
    fn a_hold_inside_a_long_earlier_one_is_an_overlap() {
        // The second hold ends first; the third still starts inside the first.
        assert_eq!(overlapping(&holds(&[(0, 100), (10, 20), (30, 40)])), 2);
    }

    #[test]
    fn most_at_once_counts_the_deepest_instant_only() {
        assert_eq!(most_at_once(&[]), 0);
        assert_eq!(most_at_once(&holds(&[(0, 10), (10, 20), (20, 30)])), 1);
        assert_eq!(
            most_at_once(&holds(&[(0, 100), (10, 20), (15, 30), (25, 40), (50, 60)])),
            3
        );
    }

    #[test]
    fn holds_one_after_another_do_not_overlap() {
        assert_eq!(overlapping(&holds(&[(0, 10), (10, 20), (21, 30)])), 0);
    }

    #[test]
    fn a_hold_recorded_again_counts_once_with_its_latest_end() {
        let dir = tempfile::tempdir().unwrap();
        let log = HoldLog::new(&dir.path().join("holds"));
        log.record("p1-0", 10, 20).unwrap();
        log.record("p1-0", 10, 50).unwrap();
        log.record("p2-0", 40, 60).unwrap();
        assert_eq!(
            log.intervals().unwrap(),
            holds(&[(10, 50), (40, 60)]),
            "one hold, extended"
        );
        assert_eq!(log.overlaps().unwrap(), 1);
    }

    #[test]
    fn a_line_it_did_not_write_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("holds");
        std::fs::write(&path, "p1 20 10\n").unwrap();
        assert!(HoldLog::new(&path).intervals().is_err());
    }
}
