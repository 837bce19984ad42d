//! What a contended run saw, from one process or several, and its row.

use std::time::Duration;

use crate::{
    cpu::CpuTimes,
    report::{micros, Row},
    stats::Samples,
    Target,
};

/// What a contended run saw, from one process or several.
#[derive(Default)]
pub(crate) struct Contention {
    pub(crate) waits: Vec<Duration>,
    pub(crate) holds: Vec<Duration>,
    pub(crate) owner_changes: usize,
    pub(crate) overlaps: usize,
    /// The clients' and the servers' CPU time over the run, where read
    /// (in this process only: not across processes).
    pub(crate) cpu: Option<CpuTimes>,
}

impl Contention {
    /// The row: wait percentiles, owner changes, overlaps, and the wait p99
    /// against `contenders` × (hold + handoff), where hold + handoff is the
    /// measured time per operation.
    pub(crate) fn row(
        self,
        scenario: String,
        target: &Target,
        ops: u64,
        elapsed: Duration,
        requests_per_op: Option<f64>,
        contenders: usize,
    ) -> Row {
        let per_op = elapsed / ops.max(1) as u32;
        let mean_hold = self.holds.iter().sum::<Duration>() / self.holds.len().max(1) as u32;
        let waits = Samples::new(self.waits);
        let turn = per_op * contenders as u32;
        let cpu = self.cpu.map_or(String::new(), |cpu| {
            let (client, servers) = cpu.per_op(ops);
            format!("; CPU client {client:.1} µs/op, servers {servers:.1}")
        });
        Row {
            scenario,
            backend: target.name.into(),
            ops,
            ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
            p50: waits.quantile(0.5),
            p99: waits.quantile(0.99),
            max: waits.max(),
            requests: requests_per_op,
            overlaps: Some(self.overlaps as u64),
            notes: format!(
                "wait times; owner changes {} of {ops}; hold {:.0} µs + handoff {:.0} µs; wait p99 = {:.2} × {contenders}·(hold + handoff){cpu}",
                self.owner_changes,
                micros(mean_hold),
                micros(per_op.saturating_sub(mean_hold)),
                waits.quantile(0.99).as_secs_f64() / turn.as_secs_f64(),
            ),
            ..Row::default()
        }
    }
}
