//! Fixtures that start real servers for tests: on a free loopback port, in a
//! temp dir of their own, stopped by their own PID.
//!
//! Conventions every server fixture follows:
//! - binaries come from Debian's packages; a missing binary is a loud
//!   failure that names the package (the README's test command installs
//!   them), never a skipped test;
//! - servers listen on 127.0.0.1 only, on a port from [`free_port`];
//! - data and logs live in the fixture's [`tempfile::TempDir`], removed with
//!   it; the log is quoted when the server fails to start;
//! - the fixture signals only the PID it started ([`ServerProcess::kill`],
//!   [`pause`](ServerProcess::pause), [`resume`](ServerProcess::resume)),
//!   and kills it on drop;
//! - every wait is bounded ([`ServerProcess::start`]'s `ready_within`).

use std::{
    fmt, fs,
    io::{self, Read},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use tempfile::TempDir;

/// Why a fixture could not start its server.
#[derive(Debug)]
#[non_exhaustive]
pub enum FixtureError {
    /// The server binary is not installed.
    MissingBinary {
        /// The binary looked for.
        binary: String,
        /// The Debian package that provides it.
        package: String,
    },
    /// Spawning or preparing the server failed.
    Io(io::Error),
    /// The server exited or never accepted connections in time.
    NotReady {
        /// The server's name.
        name: String,
        /// What happened.
        detail: String,
        /// The end of the server's log.
        log_tail: String,
    },
}

impl fmt::Display for FixtureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FixtureError::MissingBinary { binary, package } => write!(
                f,
                "`{binary}` is not installed: install the Debian package `{package}` \
                 (the README's test command does)"
            ),
            FixtureError::Io(e) => write!(f, "could not start the server: {e}"),
            FixtureError::NotReady {
                name,
                detail,
                log_tail,
            } => {
                write!(
                    f,
                    "{name} did not become ready: {detail}\n--- log tail ---\n{log_tail}"
                )
            }
        }
    }
}

impl std::error::Error for FixtureError {}

impl From<io::Error> for FixtureError {
    fn from(e: io::Error) -> Self {
        FixtureError::Io(e)
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
///
/// The port is found by binding port 0; another process could take it
/// before the server binds, which [`ServerProcess::start`] reports as a
/// server that exited early, so callers retry with a new port.
pub fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// The path of `binary`, from `PATH` or the sbin directories Debian's
/// server packages install into.
///
/// # Errors
///
/// [`FixtureError::MissingBinary`] naming `package`.
pub fn find_binary(binary: &str, package: &str) -> Result<PathBuf, FixtureError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/usr/local/bin"].map(PathBuf::from));
    for dir in dirs {
        let candidate = dir.join(binary);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(FixtureError::MissingBinary {
        binary: binary.to_owned(),
        package: package.to_owned(),
    })
}

/// A server process started by a test, and the temp dir it lives in.
///
/// # Examples
///
/// ```no_run
/// use dlock_testkit::fixture::{free_port, ServerProcess};
/// use std::{process::Command, time::Duration};
///
/// let dir = tempfile::tempdir()?;
/// let port = free_port()?;
/// let mut cmd = Command::new("redis-server");
/// cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", ""]);
/// let server = ServerProcess::start("redis", cmd, dir, port, Duration::from_secs(10))?;
/// println!("redis on {}", server.addr());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ServerProcess {
    name: String,
    child: Child,
    port: u16,
    dir: TempDir,
    log: PathBuf,
}

impl ServerProcess {
    /// Starts `command` with its working directory and log in `dir`, and
    /// waits until it accepts TCP connections on 127.0.0.1:`port`.
    ///
    /// # Errors
    ///
    /// [`FixtureError::NotReady`] with the log's tail if the server exits
    /// or does not listen within `ready_within`; it is killed then.
    pub fn start(
        name: &str,
        mut command: Command,
        dir: TempDir,
        port: u16,
        ready_within: Duration,
    ) -> Result<ServerProcess, FixtureError> {
        let log = dir.path().join(format!("{name}.log"));
        let out = fs::File::create(&log)?;
        let err = out.try_clone()?;
        command
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = command.spawn()?;
        let mut server = ServerProcess {
            name: name.to_owned(),
            child,
            port,
            dir,
            log,
        };
        server.wait_ready(ready_within)?;
        Ok(server)
    }

    fn wait_ready(&mut self, within: Duration) -> Result<(), FixtureError> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(self.not_ready(format!("exited with {status}")));
            }
            if TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if start.elapsed() > within {
                self.kill();
                return Err(
                    self.not_ready(format!("no listener on {} after {within:?}", self.addr()))
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn not_ready(&self, detail: String) -> FixtureError {
        FixtureError::NotReady {
            name: self.name.clone(),
            detail,
            log_tail: self.log_tail(4096),
        }
    }

    /// The last `bytes` of the server's log.
    pub fn log_tail(&self, bytes: usize) -> String {
        let mut text = String::new();
        if let Ok(mut f) = fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        let cut = text.len().saturating_sub(bytes);
        let cut = (cut..text.len())
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(text.len());
        text[cut..].to_owned()
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// 127.0.0.1:port.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// The server's temp dir (data, config, log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the server (SIGKILL to its own PID) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops the server (SIGSTOP), as a long pause would.
    pub fn pause(&self) -> io::Result<()> {
        self.signal(libc::SIGSTOP)
    }

    /// Resumes a paused server (SIGCONT).
    pub fn resume(&self) -> io::Result<()> {
        self.signal(libc::SIGCONT)
    }

    fn signal(&self, signal: libc::c_int) -> io::Result<()> {
        let pid = libc::pid_t::try_from(self.pid()).map_err(io::Error::other)?;
        // SAFETY: kill(2) with the PID of our own unreaped child: the PID
        // cannot have been reused by another process.
        if unsafe { libc::kill(pid, signal) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // A paused server ignores nothing but SIGKILL, which works paused.
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A real server for the fixture's own test: Python's HTTP server, which
    /// the test machine has.
    fn http_server() -> ServerProcess {
        let python = find_binary("python3", "python3").expect("python3");
        let dir = tempfile::tempdir().expect("temp dir");
        fs::write(dir.path().join("hello.txt"), "hello from the fixture").expect("write");
        let port = free_port().expect("free port");
        let mut cmd = Command::new(python);
        cmd.args([
            "-m",
            "http.server",
            "--bind",
            "127.0.0.1",
            &port.to_string(),
        ]);
        ServerProcess::start("http", cmd, dir, port, Duration::from_secs(20)).expect("start")
    }

    fn get(addr: SocketAddr) -> io::Result<String> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(b"GET /hello.txt HTTP/1.0\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    }

    #[test]
    fn starts_serves_from_its_dir_and_dies_by_its_pid() {
        let mut server = http_server();
        assert!(server.addr().ip().is_loopback());
        let body = get(server.addr()).expect("GET");
        assert!(body.contains("hello from the fixture"), "{body}");
        let dir = server.dir().to_owned();
        assert!(server.is_running());
        server.kill();
        assert!(!server.is_running());
        assert!(get(server.addr()).is_err(), "still serving after kill");
        drop(server);
        assert!(!dir.exists(), "temp dir left behind");
    }

    #[test]
    fn paused_server_stops_answering_until_resumed() {
        let server = http_server();
        server.pause().expect("SIGSTOP");
        let mut s =
            TcpStream::connect_timeout(&server.addr(), Duration::from_secs(2)).expect("connect");
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        s.write_all(b"GET /hello.txt HTTP/1.0\r\n\r\n").unwrap();
        let mut buf = [0u8; 16];
        assert!(s.read(&mut buf).is_err(), "a paused server answered");
        server.resume().expect("SIGCONT");
        assert!(get(server.addr())
            .expect("GET after resume")
            .contains("hello"));
    }

    #[test]
    fn a_server_that_exits_reports_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port().unwrap();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo bad config line 3 >&2; exit 3"]);
        match ServerProcess::start("broken", cmd, dir, port, Duration::from_secs(5)) {
            Err(FixtureError::NotReady {
                detail, log_tail, ..
            }) => {
                assert!(detail.contains("exited"), "{detail}");
                assert!(log_tail.contains("bad config line 3"), "{log_tail}");
            }
            other => panic!("expected NotReady, got {other:?}"),
        }
    }

    #[test]
    fn missing_binary_names_the_package() {
        let err = find_binary("dlock-no-such-server", "dlock-no-such-package").unwrap_err();
        assert!(err.to_string().contains("dlock-no-such-package"), "{err}");
    }
}
