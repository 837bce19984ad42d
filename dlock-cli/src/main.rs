//! `dlock`: run a shell command under a distributed lock, on any backend
//! dlock has.
//!
//! ```text
//! dlock run --url redis://127.0.0.1:6379 --key nightly-report -- ./report.sh
//! ```
//!
//! The exit codes are in [`exit`]; `dlock run --help` lists them too.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod child;
mod elect;
mod exit;
mod run;
mod status;
mod verify;

/// Run a command under a distributed lock, or as the elected leader
/// (Redis, etcd, ZooKeeper, PostgreSQL, MySQL, or files on this machine).
#[derive(Debug, Parser)]
#[command(name = "dlock", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Run(run::RunArgs),
    Elect(elect::ElectArgs),
    Status(status::StatusArgs),
    Verify(verify::VerifyArgs),
    /// One worker of `dlock verify` (started by it, not by hand).
    #[command(hide = true)]
    VerifyWorker(verify::WorkerArgs),
}

/// The lock server, shared by every subcommand.
#[derive(Debug, Clone, clap::Args)]
struct Server {
    /// The lock server, as a dlock URL: redis://HOST:PORT,
    /// redis+redlock://H1:P1,H2:P2,H3:P3, etcd://HOST:PORT/PREFIX,
    /// zk://HOST:PORT/PATH, postgres://USER:PASSWORD@HOST/DB,
    /// mysql://USER:PASSWORD@HOST/DB (each also over TLS), or
    /// file:///DIR (this machine only). Default: file:// in
    /// $XDG_RUNTIME_DIR/dlock, else /tmp/dlock-UID.
    #[arg(long, env = "DLOCK_URL", hide_env_values = true)]
    url: Option<String>,
    /// How long a lock outlives a dlock that was killed: while dlock runs,
    /// it renews the lock every third of this (500ms, 10s, 1m30s).
    #[arg(long, value_parser = run::duration, default_value = "30s")]
    watchdog_lease: std::time::Duration,
}

impl Server {
    /// The URL given, or the default (said on stderr, since it is one
    /// machine only).
    fn url(&self) -> String {
        if let Some(url) = &self.url {
            return url.clone();
        }
        let dir = std::env::var_os("XDG_RUNTIME_DIR")
            .filter(|dir| !dir.is_empty())
            .map(|dir| std::path::PathBuf::from(dir).join("dlock"))
            .unwrap_or_else(|| {
                std::path::PathBuf::from(format!(
                    "/tmp/dlock-{}",
                    rustix::process::getuid().as_raw()
                ))
            });
        let url = format!("file://{}", dir.display());
        eprintln!("dlock: no --url or DLOCK_URL: using {url} (locks on this machine only)");
        url
    }

    /// A locker on the server, or the exit code and message for why not.
    async fn connect(&self) -> Result<dlock::Locker, ExitCode> {
        self.connect_to(&self.url()).await
    }

    /// A locker on `url` (this server's, resolved by [`Server::url`]).
    async fn connect_to(&self, url: &str) -> Result<dlock::Locker, ExitCode> {
        let locker = async {
            let backend = dlock::connect_backend(url).await?;
            dlock::LockerBuilder::from_arc(backend)
                .watchdog_lease(self.watchdog_lease)
                .build()
        };
        locker.await.map_err(|e| {
            eprintln!("dlock: {e}");
            exit::for_error(&e)
        })
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("dlock: cannot start the async runtime: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            Command::Elect(args) => elect::elect(args).await,
            Command::Status(args) => status::status(args).await,
            Command::Verify(args) => verify::verify(args).await,
            Command::VerifyWorker(args) => verify::worker(args).await,
        }
    });
    // A release still being retried in the background has had its chance
    // (run releases before it returns); do not wait for stragglers.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}
