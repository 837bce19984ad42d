//! `dlock-bench chart`: the `serial` and `distinct-64` ratios of one or more
//! runs, dlock beside the peer recipe measured in the same run, as one SVG.
//!
//! ```text
//! dlock-bench chart --panel unpinned=a.jsonl [--panel pinned=b.jsonl] --title TEXT --out ratios.svg
//! ```
//!
//! Each `--panel` is the JSON lines file of one `dlock-bench` run (all of
//! its repetitions). A panel is a row of two plots, `serial` and 64 keys;
//! each point is the median ratio to the raw floor over the repetitions,
//! its bar the `[min–max]` spread, on a log scale where 1 is the floor.

use std::{path::Path, process::ExitCode};

use plotters::prelude::*;
use serde_json::Value;

use crate::report::Spread;

/// The backends in the order they are drawn, with their labels.
const BACKENDS: [(&str, &str); 9] = [
    ("file", "file"),
    ("redis", "Redis"),
    ("redis-unfenced", "Redis nf"),
    ("redlock-5", "Redlock-5"),
    ("etcd", "etcd"),
    ("zookeeper", "ZK"),
    ("postgres", "PG"),
    ("mysql", "MySQL"),
    ("mysql-unfenced", "MySQL nf"),
];

/// The scenarios drawn, with their titles.
const SCENARIOS: [(&str, &str); 2] = [
    ("serial", "serial lock + release (p50 / floor)"),
    (
        "distinct-64",
        "64 tasks, distinct keys (floor ops/s / ops/s)",
    ),
];

/// The ratios marked on the y axis, where they fall inside it.
const TICKS: [f64; 9] = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0];

/// One backend in one scenario: dlock's spread and, where the client crate
/// ships a recipe, the recipe's spread from the same run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Point {
    pub(crate) backend: &'static str,
    pub(crate) dlock: Option<Spread>,
    pub(crate) peer: Option<Spread>,
}

/// One row of a run's JSON lines, as far as the chart reads it.
#[derive(Debug)]
struct Line {
    scenario: String,
    backend: String,
    ratio: Option<f64>,
}

fn parse(text: &str) -> Result<Vec<Line>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1))?;
            let text = |k: &str| {
                v.get(k)
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .ok_or_else(|| format!("line {}: no `{k}`", i + 1))
            };
            Ok(Line {
                scenario: text("scenario")?,
                backend: text("backend")?,
                ratio: v.get("ratio").and_then(Value::as_f64),
            })
        })
        .collect()
}

/// The points of `scenario`: dlock's rows are named `scenario` exactly, the
/// peer's `scenario (peer name)`. Backends with neither are left out.
fn points(lines: &[Line], scenario: &str) -> Vec<Point> {
    let peer_prefix = format!("{scenario} (");
    BACKENDS
        .iter()
        .filter_map(|&(backend, label)| {
            let ratios = |is_side: &dyn Fn(&str) -> bool| {
                Spread::of(
                    lines
                        .iter()
                        .filter(|l| l.backend == backend && is_side(&l.scenario))
                        .filter_map(|l| l.ratio),
                )
            };
            let dlock = ratios(&|s| s == scenario);
            // Peers only: "serial (permit 1 of 4)" is dlock's own semaphore.
            let peer = ratios(&|s| s.starts_with(&peer_prefix) && !s.contains("permit"));
            (dlock.is_some() || peer.is_some()).then_some(Point {
                backend: label,
                dlock,
                peer,
            })
        })
        .collect()
}

/// Draws `panels` (a label and its lines each) to `out`.
fn draw(panels: &[(String, Vec<Line>)], title: &str, out: &Path) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", out.display());
    let rows = u32::try_from(panels.len()).map_err(|e| err(&e))?;
    let root = SVGBackend::new(out, (1200, 40 + 380 * rows)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 20))
        .map_err(|e| err(&e))?;
    let cells = root.split_evenly((panels.len(), SCENARIOS.len()));
    let dlock_colour = RGBColor(31, 119, 180);
    let peer_colour = RGBColor(255, 127, 14);
    for (row, (label, lines)) in panels.iter().enumerate() {
        for (col, &(scenario, scenario_title)) in SCENARIOS.iter().enumerate() {
            let area = &cells[row * SCENARIOS.len() + col];
            let points = points(lines, scenario);
            let all: Vec<Spread> = points
                .iter()
                .flat_map(|p| [p.dlock, p.peer])
                .flatten()
                .collect();
            let low = all.iter().map(|s| s.min).fold(1.0, f64::min) * 0.8;
            let high = all.iter().map(|s| s.max).fold(1.0, f64::max) * 1.25;
            let n = points.len();
            let mut chart = ChartBuilder::on(area)
                .caption(format!("{scenario_title}, {label}"), ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(50)
                .build_cartesian_2d(
                    -0.5..n as f64 - 0.5,
                    (low..high).log_scale().with_key_points(
                        TICKS
                            .iter()
                            .copied()
                            .filter(|t| (low..=high).contains(t))
                            .collect(),
                    ),
                )
                .map_err(|e| err(&e))?;
            let names: Vec<&str> = points.iter().map(|p| p.backend).collect();
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(n)
                .x_label_formatter(&|x| {
                    let i = x.round();
                    if (x - i).abs() > 0.01 || i < 0.0 {
                        return String::new();
                    }
                    names
                        .get(i as usize)
                        .map_or_else(String::new, |s| (*s).to_owned())
                })
                .y_desc("ratio to the floor (log)")
                .y_label_formatter(&|y| format!("{y}×"))
                .draw()
                .map_err(|e| err(&e))?;
            chart
                .draw_series(LineSeries::new(
                    [(-0.5, 1.0), (n as f64 - 0.5, 1.0)],
                    BLACK.mix(0.4),
                ))
                .map_err(|e| err(&e))?;
            for (side, offset, colour, name) in [
                (0, -0.12, dlock_colour, "dlock"),
                (1, 0.12, peer_colour, "peer recipe, same run"),
            ] {
                let spreads: Vec<(f64, Spread)> = points
                    .iter()
                    .enumerate()
                    .filter_map(|(i, p)| {
                        let s = if side == 0 { p.dlock } else { p.peer };
                        s.map(|s| (i as f64 + offset, s))
                    })
                    .collect();
                chart
                    .draw_series(spreads.iter().map(|&(x, s)| {
                        ErrorBar::new_vertical(x, s.min, s.median, s.max, colour.filled(), 8)
                    }))
                    .map_err(|e| err(&e))?;
                chart
                    .draw_series(
                        spreads
                            .iter()
                            .map(|&(x, s)| Circle::new((x, s.median), 4, colour.filled())),
                    )
                    .map_err(|e| err(&e))?
                    .label(name)
                    .legend(move |(x, y)| Circle::new((x, y), 4, colour.filled()));
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .draw()
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))
}

/// `dlock-bench chart …`: exit 2 on bad arguments, 1 on a file that cannot
/// be read or written.
pub(crate) fn main(argv: &[String]) -> ExitCode {
    let usage = "usage: dlock-bench chart --panel LABEL=FILE.jsonl [--panel …] [--title TEXT] --out FILE.svg";
    let mut panels = Vec::new();
    let mut title =
        "dlock against the peer recipes: ratio to the raw client (median, min–max)".to_owned();
    let mut out = None;
    let mut it = argv.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value\n{usage}"))
        };
        let parsed = match arg.as_str() {
            "--panel" => value("--panel").and_then(|v| {
                v.split_once('=')
                    .map(|(l, f)| panels.push((l.to_owned(), f.to_owned())))
                    .ok_or_else(|| format!("--panel takes LABEL=FILE, not `{v}`"))
            }),
            "--title" => value("--title").map(|v| title = v),
            "--out" => value("--out").map(|v| out = Some(v)),
            _ => Err(usage.to_owned()),
        };
        if let Err(message) = parsed {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    }
    let Some(out) = out.filter(|_| !panels.is_empty()) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let mut loaded = Vec::new();
    for (label, file) in panels {
        match std::fs::read_to_string(&file)
            .map_err(|e| e.to_string())
            .and_then(|t| parse(&t))
        {
            Ok(lines) => loaded.push((label, lines)),
            Err(e) => {
                eprintln!("{file}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    match draw(&loaded, &title, Path::new(&out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUNS: &str = r#"
{"run":1,"scenario":"serial","backend":"redis","ratio":1.2}
{"run":1,"scenario":"serial (permit 1 of 4)","backend":"redis","ratio":9.0}
{"run":1,"scenario":"serial (rslock)","backend":"redis","ratio":1.0}
{"run":1,"scenario":"distinct-64","backend":"redis","ratio":2.0}
{"run":1,"scenario":"serial","backend":"memory","ratio":null}
{"run":2,"scenario":"serial","backend":"redis","ratio":1.1}
{"run":2,"scenario":"serial (rslock)","backend":"redis","ratio":0.9}
{"run":3,"scenario":"serial","backend":"redis","ratio":1.5}
{"run":3,"scenario":"serial (rslock)","backend":"redis","ratio":1.05}
{"run":1,"scenario":"serial","backend":"etcd","ratio":0.9}
"#;

    fn spread(median: f64, min: f64, max: f64) -> Option<Spread> {
        Some(Spread { median, min, max })
    }

    #[test]
    fn points_pair_dlock_with_its_peer_and_skip_the_semaphore_row() {
        let lines = parse(RUNS).unwrap();
        assert_eq!(
            points(&lines, "serial"),
            [
                Point {
                    backend: "Redis",
                    dlock: spread(1.2, 1.1, 1.5),
                    peer: spread(1.0, 0.9, 1.05),
                },
                Point {
                    backend: "etcd",
                    dlock: spread(0.9, 0.9, 0.9),
                    peer: None,
                },
            ]
        );
        assert_eq!(
            points(&lines, "distinct-64"),
            [Point {
                backend: "Redis",
                dlock: spread(2.0, 2.0, 2.0),
                peer: None,
            }]
        );
    }

    #[test]
    fn a_line_without_its_scenario_is_an_error_naming_the_line() {
        let e = parse("{\"backend\":\"redis\"}\n").unwrap_err();
        assert_eq!(e, "line 1: no `scenario`");
    }

    #[test]
    fn the_chart_names_every_backend_and_both_sides() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ratios.svg");
        let lines = parse(RUNS).unwrap();
        draw(&[("unpinned".to_owned(), lines)], "t", &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        for text in [
            "Redis",
            "etcd",
            "dlock",
            "peer recipe, same run",
            "unpinned",
        ] {
            assert!(svg.contains(text), "{text} missing from the chart");
        }
    }
}
