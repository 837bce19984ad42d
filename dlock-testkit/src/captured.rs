//! `CapturedLog`: a writer that keeps what a tracing subscriber prints, for
//! tests that check what dlock logs.

use std::{
    io,
    sync::{Arc, Mutex},
};

/// A cloneable writer that keeps every byte written to it; give a clone to
/// `tracing_subscriber::fmt().with_writer(move || log.clone())` and read
/// [`text`](CapturedLog::text) afterwards.
///
/// # Examples
///
/// ```
/// use dlock_testkit::CapturedLog;
/// use std::io::Write;
///
/// let log = CapturedLog::default();
/// log.clone().write_all(b"dlock lock released").unwrap();
/// assert!(log.text().contains("released"));
/// ```
#[derive(Debug, Clone, Default)]
pub struct CapturedLog(Arc<Mutex<Vec<u8>>>);

impl CapturedLog {
    /// Everything written so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

impl io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
