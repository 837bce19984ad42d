//! A rate-limited worker pool (`DistSemaphore`) and a config cache
//! (`DistRwLock`), across several clients.
//!
//! ```text
//! cargo run -p dlock-examples --bin limits
//! cargo run -p dlock-examples --features postgres --bin limits -- --backend postgres://...
//! ```

use std::process::ExitCode;

use dlock::{LockError, Locker};
use dlock_examples::{
    backend,
    limits::{run_config, run_pool},
};

const USAGE: &str = "usage: limits [--backend URL] [--clients N] [--permits N]";

#[tokio::main]
async fn main() -> ExitCode {
    let (mut url, mut clients, mut permits) = (None, 3_usize, 3_u32);
    let mut argv = std::env::args().skip(1);
    while let Some(arg) = argv.next() {
        let value = argv.next();
        let parsed = match (arg.as_str(), value) {
            ("--backend", Some(v)) => {
                url = Some(v);
                Ok(())
            }
            ("--clients", Some(v)) => v.parse().map(|n| clients = n).map_err(drop),
            ("--permits", Some(v)) => v.parse().map(|n| permits = n).map_err(drop),
            _ => Err(()),
        };
        if parsed.is_err() || !(1..=16).contains(&clients) {
            eprintln!("{USAGE}\nbackends: {}", backend::urls());
            return ExitCode::from(2);
        }
    }
    let mut lockers: Vec<Locker> = Vec::new();
    let shared = match backend::locker(url.as_deref()).await {
        Ok(locker) => locker,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    for i in 0..clients {
        // The in-process backend is one server: every client shares it.
        if i == 0 || backend::is_in_process(url.as_deref()) {
            lockers.push(shared.clone());
        } else {
            match backend::locker(url.as_deref()).await {
                Ok(locker) => lockers.push(locker),
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let backend_name = backend::shown(url.as_deref());
    let mut failed = false;
    match run_pool(&lockers, "limits:partner-api", permits, 4, 10).await {
        Ok(report) => {
            println!(
                "worker pool: {} calls from {clients} clients x 4 workers, at most {} at once (limit {permits})",
                report.calls, report.most_at_once
            );
            failed |= report.most_at_once > permits as usize;
        }
        Err(e @ LockError::Unsupported { .. }) => {
            println!("worker pool: skipped on {backend_name}: {e}")
        }
        Err(e) => {
            eprintln!("worker pool: {e}");
            failed = true;
        }
    }
    match run_config(&lockers, "limits:config", 4, 20, 10).await {
        Ok(report) => {
            println!(
                "config cache: {} reads, {} refreshes, {} reads saw a refresh half-way",
                report.reads, report.refreshes, report.torn
            );
            failed |= report.torn > 0;
        }
        Err(e @ LockError::Unsupported { .. }) => {
            println!("config cache: skipped on {backend_name}: {e}")
        }
        Err(e) => {
            eprintln!("config cache: {e}");
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
