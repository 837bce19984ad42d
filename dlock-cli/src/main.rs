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
    /// redis+cluster://H1:P1,H2:P2, redis+sentinel://S1:P1,S2:P2/MASTER,
    /// mysql://USER:PASSWORD@HOST/DB (and rediss://, etcds://, zks:// over
    /// TLS), or file:///DIR (this machine
    /// only). Default: file:///tmp/dlock-UID.
    #[arg(long, env = "DLOCK_URL", hide_env_values = true)]
    url: Option<String>,
    /// How long a lock outlives a dlock that was killed: while dlock runs,
    /// it renews the lock every third of this (500ms, 10s, 1m30s).
    #[arg(long, value_parser = run::duration, default_value = "30s")]
    watchdog_lease: std::time::Duration,
}

impl Server {
    /// The URL given, or the default (said on stderr, since it is one
    /// machine only): `/tmp/dlock-UID`, made private to this user.
    fn url(&self) -> Result<String, ExitCode> {
        if let Some(url) = &self.url {
            return Ok(url.clone());
        }
        let dir =
            std::path::PathBuf::from(format!("/tmp/dlock-{}", rustix::process::getuid().as_raw()));
        private_dir(&dir).map_err(|why| {
            eprintln!("dlock: the default lock directory {}: {why}", dir.display());
            ExitCode::from(exit::USAGE)
        })?;
        let url = format!("file://{}", dir.display());
        eprintln!("dlock: no --url or DLOCK_URL: using {url} (locks on this machine only)");
        Ok(url)
    }

    /// A locker on the server, or the exit code and message for why not.
    async fn connect(&self) -> Result<dlock::Locker, ExitCode> {
        self.connect_to(&self.url()?).await
    }

    /// A locker on `url` (this server's, resolved by [`Server::url`]).
    async fn connect_to(&self, url: &str) -> Result<dlock::Locker, ExitCode> {
        if url == "memory" || url.starts_with("memory:") {
            // Each dlock process would have a lock server of its own.
            eprintln!("dlock: `{url}` locks within one process only: use a server, or file:///DIR");
            return Err(ExitCode::from(exit::USAGE));
        }
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

/// Makes `dir` if it is not there, private to this user; refuses one
/// that another user owns or can write to (who could delete lock files
/// under their holders).
fn private_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.to_string()),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| e.to_string())?;
    if !meta.is_dir() {
        return Err("not a directory".to_owned());
    }
    if meta.uid() != rustix::process::getuid().as_raw() {
        return Err("owned by another user".to_owned());
    }
    if meta.mode() & 0o022 != 0 {
        return Err("others can write to it".to_owned());
    }
    Ok(())
}

fn main() -> ExitCode {
    // Bad arguments exit 64 (as every other bad option), not clap's 2.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { exit::USAGE } else { 0 });
        }
    };
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::private_dir;

    #[test]
    fn the_default_directory_is_made_private_and_a_shared_one_refused() {
        let root = tempfile::tempdir().unwrap();
        let made = root.path().join("dlock-test");
        private_dir(&made).unwrap();
        let mode = std::fs::metadata(&made).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        std::fs::set_permissions(&made, std::fs::Permissions::from_mode(0o777)).unwrap();
        let why = private_dir(&made).unwrap_err();
        assert!(why.contains("others can write"), "{why}");
        let file = root.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        assert!(private_dir(&file).is_err());
    }
}
