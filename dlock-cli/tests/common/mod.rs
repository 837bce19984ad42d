//! What the CLI's test binaries share: the built `dlock`, run as an
//! operator runs it.
#![allow(dead_code)] // each test binary uses its own part

use std::{
    process::{Output, Stdio},
    time::Duration,
};

use tokio::process::Command;

pub(crate) const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

/// The built `dlock` against `url`, its output captured, killed if the
/// test drops it.
pub(crate) fn dlock(url: &str) -> Command {
    let mut command = Command::new(DLOCK);
    command
        .env("DLOCK_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Runs `command` to its end, within `limit`.
pub(crate) async fn finish(command: &mut Command, limit: Duration) -> Output {
    tokio::time::timeout(limit, command.output())
        .await
        .expect("dlock finished in time")
        .expect("dlock ran")
}

/// The exit code of `output`.
pub(crate) fn code(output: &Output) -> i32 {
    output
        .status
        .code()
        .unwrap_or_else(|| panic!("no exit code: {output:?}"))
}
