//! The exit codes of `dlock`, besides the command's own.
//!
//! | code | meaning |
//! |---|---|
//! | the command's | the command ran under the lock and exited |
//! | 128 + N | the command was killed by signal N (as shells report it), or `dlock` was, while it waited |
//! | 75 | the lock was not obtained: held by another owner past `--wait`, or at once with `--no-wait` (`--conflict-exit-code`) |
//! | 76 | the lock was lost while the command ran: the command was stopped (`--lost-exit-code`) |
//! | 64 | bad options: a malformed URL, key or duration |
//! | 69 | the lock server failed or could not be reached |
//! | 77 | the lock server refused for want of a right (a ZooKeeper node whose ACL does not admit the URL's credentials) |
//! | 79 | the command exited, but processes it started outlived `--leftovers-timeout` and were stopped (`--leftovers-exit-code`) |
//! | 126 / 127 | the command could not be run / was not found (as shells report it) |
//! | 70 | an internal error |
//!
//! 75 and 76 are the BSD `sysexits` codes for a temporary failure and a
//! protocol error; like `flock -E`, each can be set to a code the command
//! itself never uses.

use std::process::ExitCode;

use dlock::LockError;

/// The lock was not obtained (`EX_TEMPFAIL`).
pub(crate) const CONFLICT: u8 = 75;
/// The lock was lost while the command ran.
pub(crate) const LOST: u8 = 76;
/// Processes the command left outlived `--leftovers-timeout`.
pub(crate) const STRAGGLERS: u8 = 79;
/// Bad options (`EX_USAGE`).
pub(crate) const USAGE: u8 = 64;
/// The lock server failed (`EX_UNAVAILABLE`).
pub(crate) const UNAVAILABLE: u8 = 69;
/// The server refused for want of a right (`EX_NOPERM`).
pub(crate) const PERMISSION: u8 = 77;
/// An internal error (`EX_SOFTWARE`).
pub(crate) const SOFTWARE: u8 = 70;
/// The command was found but could not be run.
pub(crate) const CANNOT_RUN: u8 = 126;
/// The command was not found.
pub(crate) const NOT_FOUND: u8 = 127;

/// The exit code for an error of dlock's.
pub(crate) fn for_error(error: &LockError) -> ExitCode {
    ExitCode::from(match error {
        LockError::InvalidOptions { .. } | LockError::InvalidKey { .. } => USAGE,
        LockError::Unsupported { .. } => USAGE,
        LockError::PermissionDenied { .. } => PERMISSION,
        _ => UNAVAILABLE,
    })
}

/// The code a shell reports for a process killed by signal `signal`.
pub(crate) fn for_signal(signal: i32) -> ExitCode {
    ExitCode::from(u8::try_from(128 + signal).unwrap_or(u8::MAX))
}
