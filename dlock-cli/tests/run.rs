//! `dlock run` and `dlock status` as a shell uses them, against a real
//! Redis server: a shared counter kept exact by 20 concurrent runs, every
//! documented exit code, the lost-lock kill, and signals. And on the
//! default (file) URL, that the lock covers the whole command: for every
//! user, for what the command leaves running, and past a killed `dlock`.
#![cfg(feature = "redis")]

use std::{path::Path, time::Duration};

use dlock_testkit::fixture::RedisServer;
use tokio::{
    io::{AsyncBufReadExt as _, BufReader},
    process::Command,
    time::Instant,
};

mod common;

use common::{code, dlock, finish, DLOCK};

/// A read-then-write of a counter file, with a pause between: without a
/// lock, concurrent runs lose updates.
const INCREMENT: &str = "n=$(cat \"$1\"); sleep 0.05; echo $((n + 1)) > \"$1\"";

async fn count_with(counter: &Path, runs: usize, locked: Option<&str>) -> u32 {
    std::fs::write(counter, "0").unwrap();
    let mut all = Vec::new();
    for _ in 0..runs {
        let mut command = match locked {
            Some(url) => {
                let mut command = dlock(url);
                command.args(["run", "--key", "counter", "--wait", "60s", "--", "sh", "-c"]);
                command
            }
            None => {
                let mut command = Command::new("sh");
                command.arg("-c").kill_on_drop(true);
                command
            }
        };
        command.args([INCREMENT, "sh"]).arg(counter);
        all.push(tokio::spawn(async move {
            finish(&mut command, Duration::from_secs(90)).await
        }));
    }
    for run in all {
        let output = run.await.unwrap();
        assert!(output.status.success(), "{output:?}");
    }
    std::fs::read_to_string(counter)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_runs_keep_a_shared_counter_exact() {
    let server = RedisServer::start().expect("start redis");
    let dir = tempfile::tempdir().unwrap();
    let counter = dir.path().join("counter");
    // The same workload without the lock loses updates: the check below
    // can fail.
    let unlocked = count_with(&counter, 20, None).await;
    assert!(unlocked < 20, "the workload lost no update without a lock");
    let locked = count_with(&counter, 20, Some(&server.url())).await;
    assert_eq!(locked, 20, "dlock run lost updates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_exit_code() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let limit = Duration::from_secs(30);
    let run = |args: &[&str]| {
        let mut command = dlock(&url);
        command.arg("run").args(args);
        command
    };
    // The command's own code, and 128 + the signal that killed it.
    let own = finish(&mut run(&["--key", "k", "--", "sh", "-c", "exit 3"]), limit).await;
    assert_eq!(code(&own), 3, "{own:?}");
    let killed = finish(
        &mut run(&["--key", "k", "--", "sh", "-c", "kill -TERM $$"]),
        limit,
    )
    .await;
    assert_eq!(code(&killed), 128 + 15, "{killed:?}");
    // The environment: dlock's own, never an outer dlock's inherited.
    let env = finish(
        run(&[
            "--key",
            "env-key",
            "--",
            "sh",
            "-c",
            "echo \"${DLOCK_TERM-unset}\"",
        ])
        .env("DLOCK_TERM", "stale")
        .env("DLOCK_FENCE", "stale"),
        limit,
    )
    .await;
    assert_eq!(
        String::from_utf8_lossy(&env.stdout).trim(),
        "unset",
        "{env:?}"
    );
    let env = finish(
        &mut run(&[
            "--key",
            "env-key",
            "--",
            "sh",
            "-c",
            "echo \"$DLOCK_KEY $DLOCK_FENCE\"",
        ]),
        limit,
    )
    .await;
    let said = String::from_utf8_lossy(&env.stdout);
    let (key, fence) = said.trim().split_once(' ').expect("two words");
    assert_eq!(key, "env-key");
    assert!(fence.parse::<u64>().is_ok(), "DLOCK_FENCE={fence}");
    // A command that is not there, or cannot be run.
    let missing = finish(
        &mut run(&["--key", "k", "--", "/nonexistent/program"]),
        limit,
    )
    .await;
    assert_eq!(code(&missing), 127, "{missing:?}");
    let dir = tempfile::tempdir().unwrap();
    let plain_file = dir.path().join("not-a-program");
    std::fs::write(&plain_file, "just text").unwrap();
    let plain_file = plain_file.to_str().unwrap();
    let not_executable = finish(&mut run(&["--key", "k", "--", plain_file]), limit).await;
    assert_eq!(code(&not_executable), 126, "{not_executable:?}");
    // Not obtained: held by someone else.
    let locker = dlock::connect(&url).await.expect("connect");
    let held = locker.lock("busy").await.expect("lock");
    let started = Instant::now();
    let no_wait = finish(
        &mut run(&["--key", "busy", "--no-wait", "--", "true"]),
        limit,
    )
    .await;
    assert_eq!(code(&no_wait), 75, "{no_wait:?}");
    let waited = finish(
        &mut run(&["--key", "busy", "--wait", "300ms", "--", "true"]),
        limit,
    )
    .await;
    assert_eq!(code(&waited), 75, "{waited:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let own_code = finish(
        &mut run(&[
            "--key",
            "busy",
            "--no-wait",
            "--conflict-exit-code",
            "9",
            "--",
            "true",
        ]),
        limit,
    )
    .await;
    assert_eq!(code(&own_code), 9, "{own_code:?}");
    drop(held);
    // Bad options (a duration, an option clash, an in-process URL), and a
    // server that is not there.
    for bad in [
        &["--key", "k", "--wait", "5x", "--", "true"][..],
        &["--key", "k", "--wait", "1s", "--no-wait", "--", "true"][..],
    ] {
        let refused = finish(&mut run(bad), limit).await;
        assert_eq!(code(&refused), 64, "{bad:?}: {refused:?}");
    }
    let in_process = finish(
        dlock("memory").args(["run", "--key", "k", "--", "true"]),
        limit,
    )
    .await;
    assert_eq!(code(&in_process), 64, "{in_process:?}");
    let bad_url = finish(
        dlock("redis://h:port").args(["run", "--key", "k", "--", "true"]),
        limit,
    )
    .await;
    assert_eq!(code(&bad_url), 64, "{bad_url:?}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let down = finish(
        dlock(&format!("redis://127.0.0.1:{port}/?connect_timeout=300ms"))
            .args(["run", "--key", "k", "--", "true"]),
        limit,
    )
    .await;
    assert_eq!(code(&down), 69, "{down:?}");
}

/// A lock lost while the command runs stops it: SIGTERM at once, SIGKILL
/// after `--kill-after` for a command that ignores SIGTERM, to the whole
/// process group; dlock then exits 76.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_stops_the_command_and_its_group() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    for (what, script, kill_after) in [
        ("stops on SIGTERM", "sleep 30 & wait", "20s"),
        ("ignores SIGTERM", "trap '' TERM; sleep 30", "300ms"),
        (
            "leaves a child that ignores SIGTERM",
            "(trap '' TERM; sleep 30) & sleep 30",
            "300ms",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = format!("echo $$ > {}; {script}", pid_file.display());
        let started = Instant::now();
        let output = finish(
            dlock(&url).args([
                "run",
                "--key",
                "lost",
                "--lease",
                "1s",
                "--kill-after",
                kill_after,
                "--",
                "sh",
                "-c",
                &script,
            ]),
            Duration::from_secs(25),
        )
        .await;
        assert_eq!(code(&output), 76, "{what}: {output:?}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what}: took {:?}",
            started.elapsed()
        );
        // Nothing of the group is left: not the shell, not its sleep
        // (pgrep -g selects by process group; a killed process may be
        // listed a moment longer on a loaded machine).
        let shell: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let group = std::process::Command::new("pgrep")
                .args(["-g", &shell.to_string()])
                .output()
                .expect("pgrep");
            if group.stdout.is_empty() {
                break;
            }
            // Zombies that a container's init leaves unreaped ran their
            // course: only live processes count.
            let live: Vec<String> = String::from_utf8_lossy(&group.stdout)
                .split_whitespace()
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .map(|stat| {
                            !stat
                                .rsplit(')')
                                .next()
                                .unwrap_or("")
                                .trim_start()
                                .starts_with('Z')
                        })
                        .unwrap_or(false)
                })
                .map(str::to_owned)
                .collect();
            if live.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "{what}: left running: {live:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// SIGTERM to dlock while it waits ends the wait at once (143); while the
/// command runs it is passed on, and the lock is released after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_end_the_wait_or_reach_the_command() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let locker = dlock::connect(&url).await.expect("connect");
    let held = locker.lock("signalled").await.expect("lock");
    let mut waiting = dlock(&url)
        .args(["run", "--verbose", "--key", "signalled", "--", "true"])
        .spawn()
        .expect("spawn");
    // It says when it waits.
    let mut stderr = BufReader::new(waiting.stderr.take().unwrap()).lines();
    let said = tokio::time::timeout(Duration::from_secs(10), stderr.next_line())
        .await
        .expect("dlock said something")
        .unwrap();
    assert_eq!(said.as_deref(), Some("dlock: waiting for lock `signalled`"));
    let pid = waiting.id().expect("pid");
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), waiting.wait_with_output())
        .await
        .expect("the wait ended at once")
        .unwrap();
    assert_eq!(code(&ended), 128 + 15, "{ended:?}");
    // Released before the next step looks for dlock's hold (a dropped
    // guard releases in the background, and the test would see its own).
    held.release().await.expect("release");
    // While the command runs: the signal reaches it, and the lock is free
    // afterwards.
    let running = dlock(&url)
        .args(["run", "--key", "signalled", "--", "sleep", "30"])
        .spawn()
        .expect("spawn");
    // Wait until dlock holds the lock (read, not taken: taking it here
    // would race dlock for it).
    let deadline = Instant::now() + Duration::from_secs(10);
    let key = dlock::LockKey::new("signalled").unwrap();
    while locker
        .backend()
        .holder(&key)
        .await
        .expect("holder")
        .is_none()
    {
        assert!(Instant::now() < deadline, "dlock never took the lock");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = running.id().expect("pid");
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), running.wait_with_output())
        .await
        .expect("the command ended")
        .unwrap();
    assert_eq!(
        code(&ended),
        128 + 15,
        "sleep was killed by SIGTERM: {ended:?}"
    );
    let after = locker.try_lock("signalled").await.expect("try");
    assert!(after.is_some(), "the lock was not released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_who_holds_a_key() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let limit = Duration::from_secs(30);
    let free = finish(dlock(&url).args(["status", "--key", "s", "--json"]), limit).await;
    assert_eq!(code(&free), 1, "{free:?}");
    let report: serde_json::Value = serde_json::from_slice(&free.stdout).unwrap();
    assert_eq!(report["held"], false);
    let locker = dlock::connect(&url).await.expect("connect");
    let held = locker.lock("s").await.expect("lock");
    let busy = finish(dlock(&url).args(["status", "--key", "s", "--json"]), limit).await;
    assert_eq!(code(&busy), 0, "{busy:?}");
    let report: serde_json::Value = serde_json::from_slice(&busy.stdout).unwrap();
    assert_eq!(report["held"], true);
    assert_eq!(report["fence"].as_u64(), held.fencing_token());
}

/// Two candidates: the first leads and runs its command, the second waits;
/// when the first's command ends, the second takes over. A leadership lost
/// (the server forgot the key) stops the command and campaigns again, and
/// with `--once` exits 76.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elect_runs_one_leader_at_a_time_and_campaigns_again() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let candidate = |name: &str, extra: &[&str]| {
        let script = format!("echo \"{name} $DLOCK_TERM\" >> {}; sleep 30", log.display());
        let mut command = dlock(&url);
        command
            .args(["elect", "--watchdog-lease", "3s", "--key", "leader"])
            .args(["--value", name])
            .args(extra)
            .args(["--", "sh", "-c", &script]);
        command
    };
    let lines = |count: usize| {
        let log = log.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let lines: Vec<String> = text.lines().map(str::to_owned).collect();
                if lines.len() >= count {
                    return lines;
                }
                assert!(Instant::now() < deadline, "only {lines:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let first = candidate("a", &[]).spawn().expect("spawn a");
    let led = lines(1).await;
    assert!(led[0].starts_with("a "), "{led:?}");
    let second = candidate("b", &["--once"]).spawn().expect("spawn b");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let so_far = std::fs::read_to_string(&log).unwrap();
    assert_eq!(so_far.lines().count(), 1, "two leaderships: {so_far}");
    let status = finish(
        dlock(&url).args(["status", "--key", "leader", "--election", "--json"]),
        Duration::from_secs(10),
    )
    .await;
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(report["value"], "a", "{report}");
    // a's command ends (SIGTERM to a is passed on): b leads, in a later term.
    std::process::Command::new("kill")
        .args(["-TERM", &first.id().unwrap().to_string()])
        .status()
        .unwrap();
    let a_ended = tokio::time::timeout(Duration::from_secs(10), first.wait_with_output())
        .await
        .expect("a ended")
        .unwrap();
    assert_eq!(code(&a_ended), 128 + 15, "{a_ended:?}");
    let led = lines(2).await;
    assert!(led[1].starts_with("b "), "{led:?}");
    let term = |line: &str| line.split(' ').nth(1).unwrap().parse::<u64>().unwrap();
    assert!(term(&led[1]) > term(&led[0]), "{led:?}");
    // The server forgets the key: b's leadership is lost, its command
    // stopped, and with --once it exits 76.
    let mut redis = server.connection().await;
    dlock_redis_flush(&mut redis).await;
    let b_ended = tokio::time::timeout(Duration::from_secs(15), second.wait_with_output())
        .await
        .expect("b ended")
        .unwrap();
    assert_eq!(code(&b_ended), 76, "{b_ended:?}");
}

async fn dlock_redis_flush(redis: &mut dlock::redis::redis::aio::MultiplexedConnection) {
    dlock::redis::redis::cmd("FLUSHALL")
        .query_async::<()>(redis)
        .await
        .expect("FLUSHALL");
}

/// `dlock` with no URL: the machine's default lock directory.
fn dlock_default() -> Command {
    let mut command = dlock("");
    command.env_remove("DLOCK_URL");
    command
}

/// A key of this test run's own in the machine-wide default directory,
/// whose files are removed when it is dropped.
struct DefaultKey(String);

impl DefaultKey {
    fn new(name: &str) -> DefaultKey {
        DefaultKey(format!("dlock-test-{name}-{}", std::process::id()))
    }
}

impl Drop for DefaultKey {
    fn drop(&mut self) {
        for entry in std::fs::read_dir("/run/lock")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            // The key's files, and its election's (`election:KEY`).
            let ours = [
                format!("dlock.{}.", self.0),
                format!("dlock.election%3A{}.", self.0),
            ];
            if ours.iter().any(|prefix| name.starts_with(prefix.as_str())) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Waits (bounded) until `path` holds a line, and returns it.
async fn read_when_written(path: &Path) -> String {
    for _ in 0..500 {
        if let Ok(text) = std::fs::read_to_string(path) {
            if text.ends_with('\n') {
                return text.trim().to_owned();
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} was never written", path.display());
}

/// Whether process `pid` runs (a zombie does not).
fn runs(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// A `dlock run --no-wait` of `key` on the default URL, through `user`
/// (a dlock binary, after a `setpriv` prefix, say) or through this test's
/// dlock: its exit code.
async fn try_run(key: &str, user: &[&str]) -> i32 {
    let mut command = match user.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command
                .args(args)
                .env_remove("DLOCK_URL")
                .kill_on_drop(true);
            command
        }
        None => dlock_default(),
    };
    command.args(["run", "--no-wait", "--key", key, "--", "true"]);
    let output = finish(&mut command, Duration::from_secs(30)).await;
    code(&output)
}

/// Root and `nobody` lock in one place by default: a key one holds is
/// refused to the other, both ways (a lock directory per user let both
/// run). CI runs as root; the test needs it to act as two users.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_every_user_shares_one_lock() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test runs as root, to run dlock as root and as nobody"
    );
    // A copy of the binary that `nobody` may run.
    let bin = tempfile::tempdir().unwrap();
    let copy = bin.path().join("dlock");
    std::fs::copy(DLOCK, &copy).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = copy.to_str().unwrap();
    let nobody = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        copy,
    ];
    let root = [copy];
    let key = DefaultKey::new("users");
    // Where either user's command says it runs.
    let markers = bin.path().join("markers");
    std::fs::create_dir(&markers).unwrap();
    std::fs::set_permissions(&markers, std::fs::Permissions::from_mode(0o777)).unwrap();
    let marker = markers.join("held");
    for (holder, other) in [(&nobody[..], &root[..]), (&root[..], &nobody[..])] {
        let _ = std::fs::remove_file(&marker);
        let (program, args) = holder.split_first().unwrap();
        let mut holding = Command::new(program);
        holding
            .args(args)
            .env_remove("DLOCK_URL")
            .args([
                "run",
                "--key",
                &key.0,
                "--",
                "sh",
                "-c",
                "echo held > \"$0\"; sleep 30",
            ])
            .arg(&marker)
            .kill_on_drop(true);
        let mut holding = holding.spawn().unwrap();
        read_when_written(&marker).await;
        assert_eq!(
            try_run(&key.0, other).await,
            75,
            "{holder:?} held, {other:?} tried"
        );
        holding.kill().await.unwrap();
    }
}

/// `sh -c 'job & exit 0'`, and a job that left the command's process
/// group (`setsid`): the lock stays held (a `--no-wait` is refused) until
/// the job exits too, and `dlock run` returns only then. `dlock elect`
/// keeps its leadership the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_is_held_until_every_process_of_the_command_exits() {
    let dir = tempfile::tempdir().unwrap();
    let key = DefaultKey::new("leftovers");
    for (i, job) in ["sleep 3", "setsid sleep 3"].into_iter().enumerate() {
        for elect in [false, true] {
            let pid_file = dir.path().join(format!("job-{i}-{elect}"));
            let script = format!("{job} >/dev/null 2>&1 & echo $! > \"$0\"; exit 0");
            let mut first = dlock_default();
            first.args([if elect { "elect" } else { "run" }, "--key", &key.0]);
            first.args(["--", "sh", "-c", &script]).arg(&pid_file);
            let first = first.spawn().unwrap();
            let job_pid = read_when_written(&pid_file).await;
            assert!(runs(&job_pid), "{job}: the job runs");
            if elect {
                let mut status = dlock_default();
                status.args(["status", "--election", "--key", &key.0]);
                let status = finish(&mut status, Duration::from_secs(30)).await;
                assert_eq!(
                    code(&status),
                    0,
                    "{job}: the leadership was given up: {status:?}"
                );
            } else {
                assert_eq!(
                    try_run(&key.0, &[]).await,
                    75,
                    "{job}: the lock was released"
                );
            }
            let output = tokio::time::timeout(Duration::from_secs(30), first.wait_with_output())
                .await
                .unwrap()
                .unwrap();
            assert!(output.status.success(), "{output:?}");
            assert!(!runs(&job_pid), "{job}: dlock returned while the job ran");
        }
    }
}

/// A job that ignores SIGTERM, writes its pid to `$0` and runs until
/// killed.
const STUBBORN: &str = "trap '' TERM; echo $$ > \"$0\"; while :; do sleep 0.1; done";

/// `kill -9` of `dlock` while its command (which ignores SIGTERM) runs,
/// and while a job the command left in a session of its own runs after
/// the command exited: each dies with dlock, and only then can the next
/// run have the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_dlock_takes_its_command_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let key = DefaultKey::new("killed");
    // The same job in a session of its own, left running by `sh`.
    let left_alone = "setsid sh -c 'trap \"\" TERM; echo $$ > \"$1\"; \
                      while :; do sleep 0.1; done' job \"$0\" & exit 0";
    for (i, script) in [STUBBORN, left_alone].into_iter().enumerate() {
        let pid_file = dir.path().join(format!("command-{i}"));
        let mut first = dlock_default();
        first.args(["run", "--key", &key.0, "--", "sh", "-c", script]);
        let mut first = first.arg(&pid_file).spawn().unwrap();
        let command = read_when_written(&pid_file).await;
        first.start_kill().unwrap();
        first.wait().await.unwrap();
        let mut gone = false;
        for _ in 0..300 {
            if !runs(&command) {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(gone, "{script}: ran on after dlock was killed");
        assert_eq!(try_run(&key.0, &[]).await, 0);
    }
}

/// A `dlock run` whose stderr is a pipe nobody reads any more (`2>&1 |
/// head`) keeps the lock while the command's job runs: a failed write of
/// its messages must not end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stderr_does_not_end_dlock() {
    let dir = tempfile::tempdir().unwrap();
    let key = DefaultKey::new("stderr");
    let pid_file = dir.path().join("job");
    let mut first = dlock_default();
    first.args(["run", "--key", &key.0, "--", "sh", "-c"]);
    first
        .arg("sleep 3 & echo $! > \"$0\"; exit 0")
        .arg(&pid_file);
    let mut first = first.spawn().unwrap();
    drop(first.stderr.take());
    let job = read_when_written(&pid_file).await;
    // dlock has said (or tried to say) that the job keeps the lock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(runs(&job));
    assert_eq!(
        try_run(&key.0, &[]).await,
        75,
        "the lock was released while the job ran"
    );
    let status = tokio::time::timeout(Duration::from_secs(30), first.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// `--leftovers-timeout`: what the command left running past it is
/// stopped (this job ignores SIGTERM, so it takes the SIGKILL after
/// `--kill-after`), and `dlock` exits 79.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leftovers_past_their_timeout_are_stopped_with_exit_79() {
    let dir = tempfile::tempdir().unwrap();
    let key = DefaultKey::new("stragglers");
    let pid_file = dir.path().join("job");
    let mut first = dlock_default();
    first.args(["run", "--key", &key.0, "--leftovers-timeout", "300ms"]);
    first.args(["--kill-after", "300ms", "--", "sh", "-c"]);
    first
        .arg("sh -c 'trap \"\" TERM; sleep 30' & echo $! > \"$0\"; exit 0")
        .arg(&pid_file);
    let output = finish(&mut first, Duration::from_secs(30)).await;
    assert_eq!(code(&output), 79, "{output:?}");
    let job = std::fs::read_to_string(&pid_file).unwrap();
    assert!(!runs(job.trim()), "the job outlived dlock");
    assert_eq!(try_run(&key.0, &[]).await, 0);
}

/// Three machines' cron fires `dlock run --no-wait --hold-at-least 1500ms`
/// at each of three ticks 2 s apart, each up to 300 ms early or late, with
/// a 50 ms job: every tick's job runs exactly once, and dlock exits as
/// soon as its job does, not after the hold. (Margins of 500 ms or more
/// each way, for processes that start slowly on a loaded machine.) On the file backend (the default), whose
/// locks end with the process, it is refused with the usage code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_at_least_runs_each_tick_once_across_processes() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    let start = tokio::time::Instant::now() + Duration::from_millis(500);
    let mut all = Vec::new();
    for tick in 0..3_u64 {
        for skew in [-300_i64, 0, 300] {
            let at = start + Duration::from_secs(2 * tick);
            let at = if skew < 0 {
                at - Duration::from_millis(skew.unsigned_abs())
            } else {
                at + Duration::from_millis(skew.unsigned_abs())
            };
            let mut command = dlock(&url);
            command
                .args([
                    "run",
                    "--key",
                    "tick",
                    "--no-wait",
                    "--hold-at-least",
                    "1500ms",
                ])
                .args(["--", "sh", "-c", "echo $0 >> \"$1\"; sleep 0.05"])
                .arg(tick.to_string())
                .arg(&runs);
            all.push(tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let fired = tokio::time::Instant::now();
                let output = finish(&mut command, Duration::from_secs(30)).await;
                (output, fired.elapsed())
            }));
        }
    }
    for run in all {
        let (output, took) = run.await.unwrap();
        assert!(matches!(code(&output), 0 | 75), "{output:?}");
        assert!(
            took < Duration::from_millis(1500),
            "dlock stayed {took:?} for the hold"
        );
    }
    let ran = std::fs::read_to_string(&runs).unwrap();
    let mut ran: Vec<&str> = ran.lines().collect();
    ran.sort_unstable();
    assert_eq!(ran, ["0", "1", "2"], "the ticks' jobs ran {ran:?}");

    let key = DefaultKey::new("hold-at-least");
    let mut on_file = dlock_default();
    on_file.args([
        "run",
        "--key",
        &key.0,
        "--hold-at-least",
        "1s",
        "--",
        "true",
    ]);
    let refused = finish(&mut on_file, Duration::from_secs(30)).await;
    assert_eq!(code(&refused), 64, "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("hold_at_least"),
        "{refused:?}"
    );
}

/// `dlock release --force KEY` takes a held key from the `dlock run` that
/// holds it, which then stops its command (exit 76); on a free key it says
/// so (exit 1); without `--force` it frees nothing (exit 64).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_force_frees_a_held_key() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let limit = Duration::from_secs(30);
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let mut holder = dlock(&url);
    holder
        .args(["run", "--watchdog-lease", "3s", "--key", "stuck", "--"])
        .args(["sh", "-c", "echo up > \"$1\"; sleep 60", "sh"])
        .arg(&started);
    let holding = tokio::spawn(async move { finish(&mut holder, limit).await });
    read_when_written(&started).await;
    let release = |args: &[&str]| {
        let mut command = dlock(&url);
        command.arg("release").args(args);
        command
    };
    let bare = finish(&mut release(&["stuck"]), limit).await;
    assert_eq!(code(&bare), 64, "{bare:?}");
    let freed = finish(&mut release(&["--force", "stuck"]), limit).await;
    assert_eq!(code(&freed), 0, "{freed:?}");
    assert_eq!(
        String::from_utf8_lossy(&freed.stdout).trim(),
        "stuck: freed"
    );
    let stopped = holding.await.unwrap();
    assert_eq!(code(&stopped), 76, "{stopped:?}");
    let free = finish(&mut release(&["--force", "--json", "stuck"]), limit).await;
    assert_eq!(code(&free), 1, "{free:?}");
    assert_eq!(
        String::from_utf8_lossy(&free.stdout).trim(),
        r#"{"freed":false,"key":"stuck"}"#
    );
}

/// A command that exits on SIGTERM, saying so in `$1`, and says it runs
/// in `$2`.
const ASKABLE: &str = "trap 'echo asked >> \"$1\"; exit 0' TERM; echo up >> \"$2\"; \
                       while :; do sleep 0.05; done";

/// `dlock release --ask KEY` reaches `dlock run`'s command as SIGTERM, and
/// with `--election` an elected command, which exits: its `dlock elect`
/// resigns, and the other candidate's command runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_ask_reaches_the_command_and_a_leader_hands_over() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let limit = Duration::from_secs(30);
    let dir = tempfile::tempdir().unwrap();
    let (asked, up) = (dir.path().join("asked"), dir.path().join("up"));
    let mut holder = dlock(&url);
    holder
        .args(["run", "--key", "asked", "--", "sh", "-c", ASKABLE, "sh"])
        .arg(&asked)
        .arg(&up);
    let holding = tokio::spawn(async move { finish(&mut holder, limit).await });
    read_when_written(&up).await;
    let mut ask = dlock(&url);
    ask.args(["release", "--ask", "asked"]);
    let answer = finish(&mut ask, limit).await;
    assert_eq!(code(&answer), 0, "{answer:?}");
    assert_eq!(
        String::from_utf8_lossy(&answer.stdout).trim(),
        "asked: let go"
    );
    let held = holding.await.unwrap();
    assert_eq!(
        code(&held),
        0,
        "the command did not exit on the request: {held:?}"
    );
    assert_eq!(read_when_written(&asked).await, "asked");

    let (first_up, second_up) = (dir.path().join("first"), dir.path().join("second"));
    let candidate = |up: &Path| {
        let mut command = dlock(&url);
        command
            .args(["elect", "--key", "sched", "--", "sh", "-c", ASKABLE, "sh"])
            .arg(dir.path().join("stepped-down"))
            .arg(up);
        command
    };
    let mut first = candidate(&first_up);
    let leading = tokio::spawn(async move { finish(&mut first, limit).await });
    read_when_written(&first_up).await;
    let mut second = candidate(&second_up);
    let standing_by = tokio::spawn(async move { finish(&mut second, limit).await });
    let mut step_down = dlock(&url);
    step_down.args(["release", "--ask", "--election", "sched"]);
    let answer = finish(&mut step_down, limit).await;
    assert_eq!(code(&answer), 0, "{answer:?}");
    let stepped = leading.await.unwrap();
    assert_eq!(
        code(&stepped),
        0,
        "the leader did not step down: {stepped:?}"
    );
    assert_eq!(
        read_when_written(&second_up).await,
        "up",
        "no candidate led next"
    );
    standing_by.abort();
}

/// `dlock run --lock-delay 2s` killed with `kill -9` (its command dies
/// with it): the next run gets the key no sooner than two thirds of the
/// 1 s watchdog lease plus the delay after the kill (the last renewal
/// came at most a third before it). One that exits normally frees the
/// key at once. On the file backend it is refused with the usage code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_delay_keeps_a_killed_runs_key_past_its_lease() {
    let server = RedisServer::start().expect("start redis");
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let delayed = ["--watchdog-lease", "1s", "--lock-delay", "2s"];
    let mut holder = dlock(&url);
    holder
        .args(["run", "--key", "delayed"])
        .args(delayed)
        .args(["--", "sh", "-c", "echo $$ > \"$0\"; sleep 30"])
        .arg(&started);
    let mut holder = holder.spawn().unwrap();
    read_when_written(&started).await;
    holder.start_kill().unwrap();
    holder.wait().await.unwrap();
    let killed = tokio::time::Instant::now();
    let mut next = dlock(&url);
    next.args(["run", "--key", "delayed", "--wait", "10s", "--", "true"]);
    let output = finish(&mut next, Duration::from_secs(30)).await;
    let took = killed.elapsed();
    assert_eq!(code(&output), 0, "{output:?}");
    assert!(
        took >= Duration::from_millis(2600),
        "the next run had the key {took:?} after the holder was killed"
    );

    let mut clean = dlock(&url);
    clean
        .args(["run", "--key", "clean"])
        .args(delayed)
        .args(["--", "true"]);
    assert_eq!(code(&finish(&mut clean, Duration::from_secs(30)).await), 0);
    let mut after = dlock(&url);
    after.args(["run", "--key", "clean", "--no-wait", "--", "true"]);
    let output = finish(&mut after, Duration::from_secs(30)).await;
    assert_eq!(code(&output), 0, "a clean exit kept the key: {output:?}");

    let key = DefaultKey::new("lock-delay");
    let mut on_file = dlock_default();
    on_file.args(["run", "--key", &key.0, "--lock-delay", "1s", "--", "true"]);
    let refused = finish(&mut on_file, Duration::from_secs(30)).await;
    assert_eq!(code(&refused), 64, "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("lock_delay"),
        "{refused:?}"
    );
}
