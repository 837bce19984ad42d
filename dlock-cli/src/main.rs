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

/// `eprintln!` that cannot panic: a closed or broken stderr (`2>&1 | head`,
/// a log reader that died, a terminal gone) must never stop dlock between
/// a grant and its release, or its guard before it kills the command.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `println!` that cannot panic (a reader of stdout that went away).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod child;
mod elect;
mod exit;
mod guard;
mod list;
mod release;
mod run;
mod status;
mod tree;
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
    List(list::ListArgs),
    Release(release::ReleaseArgs),
    Verify(verify::VerifyArgs),
    /// One worker of `dlock verify` (started by it, not by hand).
    #[command(hide = true)]
    VerifyWorker(verify::WorkerArgs),
    /// Kills a command if the `dlock` that runs it dies (started by it,
    /// not by hand).
    #[command(hide = true)]
    Guard(guard::GuardArgs),
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
    /// only). Default: file:///run/lock?prefix=dlock. (or /var/lock): every
    /// user's dlock on this machine, and every service with a private /tmp,
    /// shares it.
    #[arg(long, env = "DLOCK_URL", hide_env_values = true)]
    url: Option<String>,
    /// How long a lock outlives a dlock that was killed: while dlock runs,
    /// it renews the lock every third of this (500ms, 10s, 1m30s).
    #[arg(long, value_parser = run::duration, default_value = "30s")]
    watchdog_lease: std::time::Duration,
}

impl Server {
    /// The URL given, or the default (said on stderr, since it is one
    /// machine only): [`default_url`].
    fn url(&self) -> Result<String, ExitCode> {
        if let Some(url) = &self.url {
            return Ok(url.clone());
        }
        let url = default_url().map_err(|why| {
            say!("dlock: no --url or DLOCK_URL, and {why}: name a lock directory with --url file:///DIR");
            ExitCode::from(exit::USAGE)
        })?;
        say!("dlock: no --url or DLOCK_URL: using {url} (locks on this machine only)");
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
            say!("dlock: `{url}` locks within one process only: use a server, or file:///DIR");
            return Err(ExitCode::from(exit::USAGE));
        }
        let locker = async {
            let backend = dlock::connect_backend(url).await?;
            dlock::LockerBuilder::from_arc(backend)
                .watchdog_lease(self.watchdog_lease)
                .build()
        };
        locker.await.map_err(|e| {
            say!("dlock: {e}");
            exit::for_error(&e)
        })
    }
}

/// The machine's lock directories, as `flock(1)` users share them, in
/// the order tried: every user, and every service with a private `/tmp`,
/// sees the same one.
const SHARED_LOCK_DIRS: [&str; 2] = ["/run/lock", "/var/lock"];

/// The default URL: the first of [`SHARED_LOCK_DIRS`] that is a shared
/// lock directory (see [`shared_lock_dir`]), with the lock files' names
/// starting `dlock.`; or why there is none.
fn default_url() -> Result<String, String> {
    let mut why = String::new();
    for dir in SHARED_LOCK_DIRS.map(std::path::Path::new) {
        match shared_lock_dir(dir) {
            Ok(()) => return Ok(format!("file://{}?prefix=dlock.", dir.display())),
            Err(e) => why = format!("{}: {e}", dir.display()),
        }
    }
    Err(why)
}

/// Whether `dir` is a directory every user may lock in and none may take
/// another's lock files from: root's, writable by all, with the sticky
/// bit (mode 1777, as `/run/lock` is).
fn shared_lock_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(dir).map_err(|e| e.to_string())?;
    if !meta.is_dir() {
        return Err("not a directory".to_owned());
    }
    if meta.uid() != 0 || meta.mode() & 0o1777 != 0o1777 {
        return Err(format!(
            "not root's with mode 1777 (owner {}, mode {:o}), so another user could delete a held lock's file",
            meta.uid(),
            meta.mode() & 0o7777
        ));
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
            say!("dlock: cannot start the async runtime: {e}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            Command::Elect(args) => elect::elect(args).await,
            Command::Status(args) => status::status(args).await,
            Command::List(args) => list::list(args).await,
            Command::Release(args) => release::release(args).await,
            Command::Verify(args) => verify::verify(args).await,
            Command::VerifyWorker(args) => verify::worker(args).await,
            Command::Guard(args) => guard::guard(args).await,
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

    use super::shared_lock_dir;

    #[test]
    fn the_default_directory_is_roots_sticky_and_shared() {
        // This machine's own (as every Debian machine has it).
        assert_eq!(
            super::default_url().unwrap(),
            "file:///run/lock?prefix=dlock."
        );
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("locks");
        std::fs::create_dir(&dir).unwrap();
        for mode in [0o777, 0o1755, 0o700] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            let why = shared_lock_dir(&dir).unwrap_err();
            assert!(why.contains("mode 1777"), "{mode:o}: {why}");
        }
        let file = root.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        assert!(shared_lock_dir(&file).is_err());
        assert!(shared_lock_dir(&root.path().join("missing")).is_err());
    }
}
