//! The stock demo: 500 concurrent purchases against a stock of 300, with the
//! lock (nothing oversold) and without it (oversold).
//!
//! ```text
//! cargo run -p dlock-examples --bin stock [-- --requests 500 --stock 300 --no-lock]
//! ```

use std::process::ExitCode;

use dlock_core::{BackendExt, MemoryBackend};
use dlock_examples::stock::{self, StockConfig, StockReport};

const USAGE: &str = "usage: stock [--requests N] [--stock N] [--think-ms N] [--no-lock]";

fn parse_args() -> Result<(StockConfig, bool), String> {
    let mut config = StockConfig::default();
    let mut only_unlocked = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<u64, String> {
            let value = args.next().ok_or(format!("{name} needs a value"))?;
            value
                .parse()
                .map_err(|_| format!("{name}: `{value}` is not a number"))
        };
        match arg.as_str() {
            "--requests" => config.requests = number("--requests")? as usize,
            "--stock" => config.stock = number("--stock")?,
            "--think-ms" => config.think = std::time::Duration::from_millis(number("--think-ms")?),
            "--no-lock" => only_unlocked = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    Ok((config, only_unlocked))
}

fn print(label: &str, r: &StockReport) {
    println!(
        "{label:<12} sold {:>4} | remaining {:>4} | oversold {:>4} | lost updates {:>4} | {:>7.1} ms | lock wait p50 {:>7.1} ms, max {:>7.1} ms",
        r.sold,
        r.remaining,
        r.oversold,
        r.lost_updates,
        r.elapsed.as_secs_f64() * 1e3,
        r.wait_p50.as_secs_f64() * 1e3,
        r.wait_max.as_secs_f64() * 1e3,
    );
}

#[tokio::main]
async fn main() -> ExitCode {
    let (config, only_unlocked) = match parse_args() {
        Ok(parsed) => parsed,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    println!(
        "{} concurrent purchases against a stock of {} (backend: memory)",
        config.requests, config.stock
    );
    let locker = MemoryBackend::new().into_locker();
    if !only_unlocked {
        match stock::run(Some(&locker), &config).await {
            Ok(report) => print("with lock", &report),
            Err(e) => {
                eprintln!("with lock: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    match stock::run(None, &config).await {
        Ok(report) => print("without lock", &report),
        Err(e) => {
            eprintln!("without lock: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
