//! The order service: `POST /orders/{id}/process` charges an order exactly
//! once across every instance; `GET /stats` shows the counts.
//!
//! ```text
//! cargo run -p dlock-examples --bin orders -- --port 8080 --instance a --backend redis://127.0.0.1:6379 --ledger /tmp/orders
//! cargo run -p dlock-examples --bin orders -- --port 8081 --instance b --backend redis://127.0.0.1:6379 --ledger /tmp/orders
//! curl -X POST localhost:8080/orders/7/process
//! ```

use std::{process::ExitCode, time::Duration};

use dlock_examples::{
    backend,
    orders::{router, AppState, Ledger},
};

const USAGE: &str =
    "usage: orders [--port N] [--instance NAME] [--backend URL] [--ledger DIR] [--charge-ms N]";

struct Args {
    port: u16,
    instance: String,
    backend: Option<String>,
    ledger: std::path::PathBuf,
    charge: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        port: 8080,
        instance: "a".to_owned(),
        backend: None,
        ledger: std::env::temp_dir().join("dlock-orders"),
        charge: Duration::from_millis(50),
    };
    let mut argv = std::env::args().skip(1);
    while let Some(arg) = argv.next() {
        if arg == "-h" || arg == "--help" {
            return Err(format!("{USAGE}\nbackends: {}", backend::urls()));
        }
        let value = argv.next().ok_or(format!("{arg} needs a value\n{USAGE}"))?;
        let number = |value: &str| -> Result<u64, String> {
            value
                .parse()
                .map_err(|_| format!("{arg}: `{value}` is not a number\n{USAGE}"))
        };
        match arg.as_str() {
            "--port" => {
                args.port = u16::try_from(number(&value)?)
                    .map_err(|_| format!("--port: `{value}` is not a port"))?
            }
            "--instance" => args.instance = value,
            "--backend" => args.backend = Some(value),
            "--ledger" => args.ledger = value.into(),
            "--charge-ms" => args.charge = Duration::from_millis(number(&value)?),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_target(false).init();
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let locker = match backend::locker(args.backend.as_deref()).await {
        Ok(locker) => locker,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let ledger = match Ledger::open(&args.ledger) {
        Ok(ledger) => ledger,
        Err(e) => {
            eprintln!("{}: {e}", args.ledger.display());
            return ExitCode::FAILURE;
        }
    };
    let listener = match tokio::net::TcpListener::bind(("127.0.0.1", args.port)).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("127.0.0.1:{}: {e}", args.port);
            return ExitCode::FAILURE;
        }
    };
    let addr = match listener.local_addr() {
        Ok(addr) => addr,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let state = AppState::new(locker.clone(), &args.instance, ledger, args.charge);
    println!("instance {} listening on http://{addr}", args.instance);
    // Ctrl-C: finish the requests in flight, then let their lock releases
    // reach the server before exiting.
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let served = axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await;
    if tokio::time::timeout(Duration::from_secs(10), locker.wait_for_releases())
        .await
        .is_err()
    {
        eprintln!("lock releases still pending after 10 s; their leases will end them");
    }
    if let Err(e) = served {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
