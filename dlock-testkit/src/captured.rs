//! `CapturedLog`: a writer that keeps what a tracing subscriber prints, for
//! tests that check what dlock logs.

use std::{
    future::Future,
    io,
    sync::{Arc, Mutex},
};

/// A cloneable writer that keeps every byte written to it: run the work
/// under [`block_on`](CapturedLog::block_on) (or give a clone to a
/// subscriber's `with_writer`) and read [`text`](CapturedLog::text).
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
    /// Runs `work` to its end on a new current-thread runtime, with a
    /// subscriber that writes every event at `level` or above, and the close
    /// of every such span, into this log. One test per binary should use
    /// it: tracing caches process-wide which callsites are enabled.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_testkit::CapturedLog;
    ///
    /// let log = CapturedLog::default();
    /// log.block_on(tracing::Level::WARN, async { tracing::warn!("careful") });
    /// assert!(log.text().contains("careful"));
    /// ```
    pub fn block_on<T>(&self, level: tracing::Level, work: impl Future<Output = T>) -> T {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the captured work")
                .block_on(work)
        })
    }

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
