//! The stock demo: 500 concurrent purchase requests against a stock of 300,
//! with the lock (nothing oversold) and without it (oversold), in one
//! process or in several sharing one stock file.
//!
//! ```text
//! cargo run -p dlock-examples --bin stock
//! cargo run -p dlock-examples --bin stock -- --processes 4 --backend redis://127.0.0.1:6379
//! ```

use std::{path::Path, process::ExitCode, sync::Arc, time::Duration};

use dlock_examples::{
    backend,
    stock::{self, StockConfig, StockReport, Store},
};
use tokio::{process::Command, time::Instant};

const USAGE: &str = "usage: stock [--backend URL] [--processes N] [--requests N] [--stock N] [--think-ms N] [--no-lock]";

/// The hidden argument a child process gets: it serves its share of the
/// requests against the shared stock file and prints what it sold.
const CHILD: &str = "--child-of-stock-demo";

struct Args {
    config: StockConfig,
    backend: Option<String>,
    processes: usize,
    only_unlocked: bool,
    /// In a child: the shared stock file.
    child_store: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        config: StockConfig::default(),
        backend: None,
        processes: 1,
        only_unlocked: false,
        child_store: None,
    };
    let mut argv = std::env::args().skip(1);
    while let Some(arg) = argv.next() {
        let mut value = |name: &str| argv.next().ok_or(format!("{name} needs a value\n{USAGE}"));
        let number = |name: &str, value: String| -> Result<u64, String> {
            value
                .parse()
                .map_err(|_| format!("{name}: `{value}` is not a number\n{USAGE}"))
        };
        match arg.as_str() {
            "--backend" => args.backend = Some(value("--backend")?),
            "--processes" => {
                args.processes = number("--processes", value("--processes")?)? as usize
            }
            "--requests" => {
                args.config.requests = number("--requests", value("--requests")?)? as usize
            }
            "--stock" => args.config.stock = number("--stock", value("--stock")?)?,
            "--think-ms" => {
                args.config.think =
                    Duration::from_millis(number("--think-ms", value("--think-ms")?)?)
            }
            "--no-lock" => args.only_unlocked = true,
            CHILD => args.child_store = Some(value(CHILD)?),
            "-h" | "--help" => return Err(format!("{USAGE}\nbackends: {}", backend::urls())),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    if args.processes == 0 || args.processes > 64 {
        return Err(format!("--processes takes 1 to 64\n{USAGE}"));
    }
    Ok(args)
}

fn print(label: &str, r: &StockReport, locked: bool) {
    let waits = if locked {
        format!(
            "lock wait p50 {:>7.1} ms, max {:>7.1} ms",
            r.wait_p50().as_secs_f64() * 1e3,
            r.wait_max().as_secs_f64() * 1e3
        )
    } else {
        "no lock to wait for".to_owned()
    };
    println!(
        "{label:<12} sold {:>4} | remaining {:>4} | oversold {:>4} | lost updates {:>4} | {:>7.1} ms | {waits}",
        r.sold,
        r.remaining,
        r.oversold,
        r.lost_updates,
        r.elapsed.as_secs_f64() * 1e3,
    );
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let result = match &args.child_store {
        Some(store) => child(&args, Path::new(store)).await,
        None => parent(&args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}

async fn parent(args: &Args) -> Result<(), String> {
    let backend_name = backend::shown(args.backend.as_deref());
    println!(
        "{} concurrent purchase requests against a stock of {}, in {} process{} (backend: {backend_name})",
        args.config.requests,
        args.config.stock,
        args.processes,
        if args.processes == 1 { "" } else { "es" },
    );
    let locked = if args.only_unlocked {
        None
    } else if args.processes > 1 && backend::is_in_process(args.backend.as_deref()) {
        return Err(
            "--processes needs a server backend (--backend redis://..., etcd://..., zk://...): \
             the in-process backend's locks do not reach other processes"
                .to_owned(),
        );
    } else {
        Some(
            run(args, true)
                .await
                .map_err(|e| format!("with lock: {e}"))?,
        )
    };
    if let Some(report) = &locked {
        print("with lock", report, true);
    }
    let unlocked = run(args, false)
        .await
        .map_err(|e| format!("without lock: {e}"))?;
    print("without lock", &unlocked, false);
    Ok(())
}

/// One run, in this process or spread over `args.processes` processes.
async fn run(args: &Args, locked: bool) -> Result<StockReport, String> {
    if args.processes == 1 {
        let locker = match locked {
            true => Some(
                backend::locker(args.backend.as_deref())
                    .await
                    .map_err(|e| e.to_string())?,
            ),
            false => None,
        };
        return stock::run(locker.as_ref(), &args.config)
            .await
            .map_err(|e| e.to_string());
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let file = dir.path().join("stock");
    Store::create_file(&file, args.config.stock)
        .await
        .map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::with_capacity(args.processes);
    for i in 0..args.processes {
        // The requests, split as evenly as they go.
        let share = args.config.requests / args.processes
            + usize::from(i < args.config.requests % args.processes);
        let mut command = Command::new(&exe);
        command
            .arg(CHILD)
            .arg(&file)
            .args(["--requests", &share.to_string()])
            .args(["--think-ms", &args.config.think.as_millis().to_string()])
            .kill_on_drop(true);
        if let Some(url) = &args.backend {
            command.args(["--backend", url]);
        }
        if !locked {
            command.arg("--no-lock");
        }
        children.push(command.output());
    }
    let (mut sold, mut waits, mut served) = (0, Vec::new(), Duration::ZERO);
    for output in futures_util::future::join_all(children).await {
        let output = output.map_err(|e| format!("{}: {e}", exe.display()))?;
        if !output.status.success() {
            return Err(format!(
                "a process failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            match line.split_once(' ') {
                Some(("sold", n)) => sold += n.parse::<u64>().map_err(|e| e.to_string())?,
                Some(("served_us", us)) => {
                    let us = us.parse::<u64>().map_err(|e| e.to_string())?;
                    served = served.max(Duration::from_micros(us));
                }
                Some(("waits", list)) => waits.extend(
                    list.split(',')
                        .filter_map(|us| us.parse().ok())
                        .map(Duration::from_micros),
                ),
                _ => return Err(format!("unexpected output from a process: `{line}`")),
            }
        }
    }
    let remaining = Store::File(file).read().await.map_err(|e| e.to_string())?;
    // The time: the longest a process spent serving (starting the processes
    // and connecting them to the lock service are not counted).
    Ok(StockReport::new(
        args.config.stock,
        sold,
        remaining,
        served,
        waits,
    ))
}

/// A child: serves its share against the shared file, prints `sold N`,
/// `served_us N` (its serving time) and `waits µs,µs,...`.
async fn child(args: &Args, file: &Path) -> Result<(), String> {
    let locker = match args.only_unlocked {
        true => None,
        false => Some(
            backend::locker(args.backend.as_deref())
                .await
                .map_err(|e| e.to_string())?,
        ),
    };
    let store = Arc::new(Store::File(file.to_owned()));
    let start = Instant::now();
    let (sold, waits) = stock::serve(locker.as_ref(), store, &args.config)
        .await
        .map_err(|e| e.to_string())?;
    let served = start.elapsed();
    if let Some(locker) = &locker {
        // The handlers' guards were dropped, which schedules their
        // releases: let them reach the server before this process exits,
        // or the other processes wait for the last lock's lease to end.
        let settle = tokio::time::timeout(Duration::from_secs(10), locker.wait_for_releases());
        if settle.await.is_err() {
            return Err("releases still pending after 10 s".to_owned());
        }
    }
    let waits: Vec<String> = waits.iter().map(|w| w.as_micros().to_string()).collect();
    println!("sold {sold}");
    println!("served_us {}", served.as_micros());
    println!("waits {}", waits.join(","));
    Ok(())
}
