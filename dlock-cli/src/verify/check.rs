//! The checker: every hold the workers recorded, across processes, against
//! what the primitive promises.

use std::fmt;

/// What a hold took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A mutex: exclusive.
    Exclusive,
    /// A read share: with readers, never with a writer.
    Read,
    /// A write hold: exclusive.
    Write,
    /// One permit of a semaphore.
    Permit,
    /// A leadership: exclusive.
    Leader,
}

impl Kind {
    /// The letter a log line uses.
    pub(crate) fn letter(self) -> char {
        match self {
            Kind::Exclusive => 'x',
            Kind::Read => 'r',
            Kind::Write => 'w',
            Kind::Permit => 'p',
            Kind::Leader => 'l',
        }
    }

    pub(crate) fn from_letter(letter: &str) -> Option<Kind> {
        Some(match letter {
            "x" => Kind::Exclusive,
            "r" => Kind::Read,
            "w" => Kind::Write,
            "p" => Kind::Permit,
            "l" => Kind::Leader,
            _ => return None,
        })
    }

    /// Whether a hold of this kind excludes every other hold.
    fn exclusive(self) -> bool {
        matches!(self, Kind::Exclusive | Kind::Write | Kind::Leader)
    }
}

/// One hold: from when the lock was granted to the last moment its holder
/// knew it still held it, on the machine's monotonic clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hold {
    /// The worker process (its number, not its pid: a respawn keeps it).
    pub(crate) worker: u32,
    /// The task within the worker.
    pub(crate) task: u32,
    pub(crate) start_ns: u64,
    pub(crate) end_ns: u64,
    pub(crate) fence: Option<u64>,
    pub(crate) kind: Kind,
}

impl fmt::Display for Hold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "worker {} task {} {:?} [{:.6} s, {:.6} s]",
            self.worker,
            self.task,
            self.kind,
            self.start_ns as f64 / 1e9,
            self.end_ns as f64 / 1e9
        )?;
        match self.fence {
            Some(fence) => write!(f, " fence {fence}"),
            None => Ok(()),
        }
    }
}

/// A broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Violation {
    /// Two holds that may not overlap did.
    Overlap(Hold, Hold),
    /// A later hold got a fence no greater than an earlier one it must
    /// rise above.
    FenceOrder(Hold, Hold),
    /// More permits were held at once than the semaphore has.
    TooMany { limit: u32, holds: Vec<Hold> },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Overlap(a, b) => write!(f, "overlap:\n    {a}\n    {b}"),
            Violation::FenceOrder(a, b) => {
                write!(f, "fence not rising:\n    {a}\n    then {b}")
            }
            Violation::TooMany { limit, holds } => {
                write!(f, "{} permits held at once, of {limit}:", holds.len())?;
                for hold in holds {
                    write!(f, "\n    {hold}")?;
                }
                Ok(())
            }
        }
    }
}

/// Every violation in `holds` (all of one key), for a semaphore of
/// `limit` permits where permits are taken.
pub(crate) fn check(holds: &[Hold], limit: u32) -> Vec<Violation> {
    let mut sorted: Vec<&Hold> = holds.iter().collect();
    sorted.sort_by_key(|h| (h.start_ns, h.end_ns));
    let mut violations = Vec::new();
    // A sweep in start order, with the holds still running.
    let mut active: Vec<&Hold> = Vec::new();
    for &hold in &sorted {
        active.retain(|a| a.end_ns > hold.start_ns);
        match hold.kind {
            Kind::Permit => {
                let permits = active.iter().filter(|a| a.kind == Kind::Permit).count();
                if permits + 1 > limit as usize {
                    let mut at_once: Vec<Hold> = active.iter().map(|a| (*a).clone()).collect();
                    at_once.push(hold.clone());
                    violations.push(Violation::TooMany {
                        limit,
                        holds: at_once,
                    });
                }
            }
            kind => {
                let clash = active
                    .iter()
                    .find(|a| kind.exclusive() || a.kind.exclusive());
                if let Some(other) = clash {
                    violations.push(Violation::Overlap((*other).clone(), hold.clone()));
                }
            }
        }
        active.push(hold);
    }
    // Fences rise in grant order: an exclusive hold's above every earlier
    // hold's, a reader's above every earlier exclusive hold's (readers
    // hold together, so their grant order is not their start order).
    // Permits are not compared: they too hold together.
    let mut top: Option<&Hold> = None;
    let mut top_exclusive: Option<&Hold> = None;
    for &hold in sorted.iter().filter(|h| h.kind != Kind::Permit) {
        let Some(fence) = hold.fence else {
            continue;
        };
        let above = if hold.kind.exclusive() {
            top
        } else {
            top_exclusive
        };
        if let Some(prev) = above.filter(|prev| prev.fence.is_some_and(|p| fence <= p)) {
            violations.push(Violation::FenceOrder(prev.clone(), hold.clone()));
        }
        let higher = |best: Option<&Hold>| best.is_none_or(|b| b.fence < Some(fence));
        if higher(top) {
            top = Some(hold);
        }
        if hold.kind.exclusive() && higher(top_exclusive) {
            top_exclusive = Some(hold);
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(worker: u32, start_ns: u64, end_ns: u64, fence: u64, kind: Kind) -> Hold {
        Hold {
            worker,
            task: 0,
            start_ns,
            end_ns,
            fence: Some(fence),
            kind,
        }
    }

    #[test]
    fn back_to_back_holds_pass_and_overlaps_fail() {
        let fine = [
            hold(1, 0, 10, 1, Kind::Exclusive),
            hold(2, 10, 20, 2, Kind::Exclusive),
            hold(1, 25, 30, 3, Kind::Exclusive),
        ];
        assert_eq!(check(&fine, 1), []);
        let overlap = [
            hold(1, 0, 10, 1, Kind::Exclusive),
            hold(2, 9, 20, 2, Kind::Exclusive),
        ];
        assert!(matches!(check(&overlap, 1)[..], [Violation::Overlap(..)]));
    }

    #[test]
    fn fences_must_rise_in_grant_order() {
        let backwards = [
            hold(1, 0, 10, 5, Kind::Leader),
            hold(2, 10, 20, 5, Kind::Leader),
        ];
        assert!(matches!(
            check(&backwards, 1)[..],
            [Violation::FenceOrder(..)]
        ));
    }

    #[test]
    fn a_writers_fence_rises_above_the_readers_before_it() {
        // Two readers (their fences in either order: they held together),
        // then a writer whose fence is not above the second reader's.
        let below_a_reader = [
            hold(1, 0, 10, 7, Kind::Read),
            hold(2, 2, 12, 6, Kind::Read),
            hold(3, 15, 20, 7, Kind::Write),
        ];
        assert!(matches!(
            check(&below_a_reader, 1)[..],
            [Violation::FenceOrder(..)]
        ));
        // A reader's fence rises above the writers' before it.
        let reader_below_a_writer = [
            hold(3, 0, 10, 7, Kind::Write),
            hold(1, 15, 20, 7, Kind::Read),
        ];
        assert!(matches!(
            check(&reader_below_a_writer, 1)[..],
            [Violation::FenceOrder(..)]
        ));
        let fine = [
            hold(1, 0, 10, 7, Kind::Read),
            hold(2, 2, 12, 6, Kind::Read),
            hold(3, 15, 20, 8, Kind::Write),
            hold(1, 25, 30, 9, Kind::Read),
            hold(2, 26, 30, 10, Kind::Read),
        ];
        assert_eq!(check(&fine, 1), []);
    }

    #[test]
    fn readers_share_and_writers_do_not() {
        let fine = [
            hold(1, 0, 10, 1, Kind::Read),
            hold(2, 5, 15, 1, Kind::Read),
            hold(3, 15, 20, 2, Kind::Write),
        ];
        assert_eq!(check(&fine, 1), []);
        let writer_among_readers = [
            hold(1, 0, 10, 1, Kind::Read),
            hold(3, 5, 20, 2, Kind::Write),
        ];
        assert_eq!(check(&writer_among_readers, 1).len(), 1);
        let reader_in_a_write = [
            hold(3, 0, 20, 2, Kind::Write),
            hold(1, 5, 10, 3, Kind::Read),
        ];
        assert_eq!(check(&reader_in_a_write, 1).len(), 1);
    }

    #[test]
    fn permits_never_exceed_the_limit() {
        let two = [
            hold(1, 0, 10, 1, Kind::Permit),
            hold(2, 0, 10, 2, Kind::Permit),
            hold(3, 10, 20, 3, Kind::Permit),
        ];
        assert_eq!(check(&two, 2), []);
        let three = [
            hold(1, 0, 10, 1, Kind::Permit),
            hold(2, 0, 10, 2, Kind::Permit),
            hold(3, 5, 20, 3, Kind::Permit),
        ];
        assert!(
            matches!(&check(&three, 2)[..], [Violation::TooMany { holds, .. }] if holds.len() == 3)
        );
    }
}
