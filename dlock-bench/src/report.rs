//! The results: one [`Row`] per scenario and run, and the table that shows,
//! for each scenario, the median of its runs and their spread.

use std::{fmt::Write as _, time::Duration};

/// One scenario on one backend, in one run.
#[derive(Debug, Default, Clone)]
pub(crate) struct Row {
    pub(crate) scenario: String,
    pub(crate) backend: String,
    pub(crate) ops: u64,
    pub(crate) ops_per_sec: f64,
    pub(crate) p50: Duration,
    pub(crate) p99: Duration,
    pub(crate) max: Duration,
    pub(crate) raw_p50: Option<Duration>,
    pub(crate) raw_ops_per_sec: Option<f64>,
    /// dlock (or the peer) against the raw floor: p50 latency over the
    /// floor's in `serial`, the floor's throughput over ours elsewhere.
    pub(crate) ratio: Option<f64>,
    /// Every request the servers received per operation, from any client
    /// of this side (on Redis counted in a pass of its own: see
    /// [`Target::counting_pass`](crate::Target::counting_pass)).
    pub(crate) requests: Option<f64>,
    /// The same for the raw floor, where the scenario has one.
    pub(crate) raw_requests: Option<f64>,
    /// Critical sections that found another holder inside, where the
    /// scenario checks (contended rows).
    pub(crate) overlaps: Option<u64>,
    pub(crate) notes: String,
}

pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Row {
    /// One JSON object: this run's figures, unaggregated.
    pub(crate) fn json(&self, run: usize) -> String {
        let opt = |v: Option<f64>| v.map_or_else(|| "null".to_owned(), |v| format!("{v:.3}"));
        format!(
            "{{\"run\":{run},\"scenario\":\"{}\",\"backend\":\"{}\",\"ops\":{},\"ops_per_sec\":{:.1},\"p50_us\":{:.1},\"p99_us\":{:.1},\"max_us\":{:.1},\"raw_p50_us\":{},\"raw_ops_per_sec\":{},\"ratio\":{},\"requests_per_op\":{},\"raw_requests_per_op\":{},\"overlaps\":{},\"notes\":\"{}\"}}",
            self.scenario,
            self.backend,
            self.ops,
            self.ops_per_sec,
            micros(self.p50),
            micros(self.p99),
            micros(self.max),
            opt(self.raw_p50.map(micros)),
            opt(self.raw_ops_per_sec),
            opt(self.ratio),
            opt(self.requests),
            opt(self.raw_requests),
            self.overlaps.map_or_else(|| "null".to_owned(), |n| n.to_string()),
            self.notes.replace('"', "'")
        )
    }

    /// The figure that picks the median run, whose notes the table shows:
    /// the ratio where there is one, the throughput elsewhere.
    fn headline(&self) -> f64 {
        self.ratio.unwrap_or(self.ops_per_sec)
    }
}

/// The median of some runs' values and their range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

impl Spread {
    /// `None` without values.
    pub(crate) fn of(values: impl IntoIterator<Item = f64>) -> Option<Spread> {
        let mut values: Vec<f64> = values.into_iter().collect();
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = if n % 2 == 1 {
            values[n / 2]
        } else {
            (values[n / 2 - 1] + values[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: values[0],
            max: values[n - 1],
        })
    }

    /// `median [min–max]`, each with `decimals` and `unit`.
    fn show(self, decimals: usize, unit: &str) -> String {
        if self.min == self.max {
            return format!("{:.decimals$}{unit}", self.median);
        }
        format!(
            "{:.decimals$}{unit} [{:.decimals$}–{:.decimals$}]",
            self.median, self.min, self.max
        )
    }
}

/// The table header of [`markdown`].
pub(crate) const HEADER: &str = "| scenario | backend | runs | ops/s | p50 | p99 | raw floor | ratio | server requests/op | notes (median run) |\n|---|---|---|---|---|---|---|---|---|---|\n";

/// One table line per scenario and backend, in the order they first ran:
/// each figure as the median of the runs and `[min–max]`.
pub(crate) fn markdown(runs: &[Vec<Row>]) -> String {
    let mut table = String::from(HEADER);
    let Some(first) = runs.first() else {
        return table;
    };
    for row in first {
        let same: Vec<&Row> = runs
            .iter()
            .filter_map(|run| {
                run.iter()
                    .find(|r| r.scenario == row.scenario && r.backend == row.backend)
            })
            .collect();
        let _ = writeln!(table, "{}", line(&same));
    }
    table
}

fn line(rows: &[&Row]) -> String {
    let spread = |f: &dyn Fn(&Row) -> Option<f64>| Spread::of(rows.iter().filter_map(|r| f(r)));
    let cell = |s: Option<Spread>, decimals: usize, unit: &str| {
        s.map_or_else(|| "-".to_owned(), |s| s.show(decimals, unit))
    };
    let first = rows[0];
    let timed = first.p50 > Duration::ZERO;
    let raw = if first.raw_p50.is_some() && first.scenario.starts_with("serial") {
        cell(spread(&|r| r.raw_p50.map(micros)), 1, " µs")
    } else {
        cell(spread(&|r| r.raw_ops_per_sec), 0, "/s")
    };
    let mut requests = cell(spread(&|r| r.requests), 2, "");
    if let Some(raw) = spread(&|r| r.raw_requests) {
        let _ = write!(requests, " (raw {})", raw.show(2, ""));
    }
    let median = Spread::of(rows.iter().map(|r| r.headline())).map_or(0.0, |s| s.median);
    let mut notes = rows
        .iter()
        .min_by(|a, b| {
            (a.headline() - median)
                .abs()
                .total_cmp(&(b.headline() - median).abs())
        })
        .map(|typical| typical.notes.clone())
        .unwrap_or_default();
    if first.overlaps.is_some() {
        let total: u64 = rows.iter().filter_map(|r| r.overlaps).sum();
        let _ = write!(notes, "; overlaps {total} in all runs");
    }
    format!(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
        first.scenario,
        first.backend,
        rows.len(),
        cell(spread(&|r| Some(r.ops_per_sec)), 0, ""),
        if timed {
            cell(spread(&|r| Some(micros(r.p50))), 1, " µs")
        } else {
            "-".to_owned()
        },
        if timed {
            cell(spread(&|r| Some(micros(r.p99))), 1, " µs")
        } else {
            "-".to_owned()
        },
        raw,
        cell(spread(&|r| r.ratio), 2, "×"),
        requests,
        notes.trim_start_matches("; "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_is_the_median_and_the_range_of_the_runs() {
        let s = Spread::of([1.3, 1.1, 1.2]).expect("values");
        assert_eq!((s.median, s.min, s.max), (1.2, 1.1, 1.3));
        let even = Spread::of([4.0, 1.0, 2.0, 3.0]).expect("values");
        assert_eq!(even.median, 2.5);
        assert!(Spread::of([]).is_none());
        assert_eq!(s.show(2, "×"), "1.20× [1.10–1.30]");
        assert_eq!(Spread::of([2.0]).expect("one").show(2, ""), "2.00");
    }

    #[test]
    fn the_table_shows_each_scenario_once_with_its_runs_spread() {
        let row = |ratio: f64, overlaps: u64, notes: &str| Row {
            scenario: "contended-16".into(),
            backend: "redis".into(),
            ops_per_sec: 100.0 * ratio,
            p50: Duration::from_micros(10),
            p99: Duration::from_micros(20),
            raw_ops_per_sec: Some(120.0),
            ratio: Some(ratio),
            requests: Some(6.0),
            overlaps: Some(overlaps),
            notes: notes.into(),
            ..Row::default()
        };
        let runs = vec![
            vec![row(1.3, 0, "third")],
            vec![row(1.1, 1, "first")],
            vec![row(1.2, 0, "median")],
        ];
        let table = markdown(&runs);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        let line = lines[2];
        assert!(line.contains("| 3 |"), "{line}");
        assert!(line.contains("1.20× [1.10–1.30]"), "{line}");
        assert!(
            line.contains("| median; overlaps 1 in all runs |"),
            "{line}"
        );
    }
}
