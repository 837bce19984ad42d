//! `serial` and `distinct`: dlock (or a peer) against the raw client
//! floor, taking turns.

use std::{sync::Arc, time::Duration};

use dlock_core::Token;
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{scenario, Lockable};
use crate::{cpu::CpuTimes, report::Row, stats::Samples, Target};

/// How many turns dlock (or a peer) and the raw floor take in the serial
/// and distinct-key scenarios. On this kind of VM the speed of the whole
/// machine drifts during a run (the floor moves by a third between runs);
/// taking turns, first one side and then the other, makes a drift fall on
/// both alike instead of on whichever ran second.
const TURNS: usize = 8;

/// What one side of a comparison measured, summed over its turns.
struct Side {
    samples: Vec<Duration>,
    elapsed: Duration,
    /// Server requests; `None` once a turn could not count them.
    requests: Option<u64>,
    /// Redis server time on the side's commands, in µs; `None` elsewhere.
    server_usec: Option<u64>,
    /// CPU time of the clients and the servers over the side's turns;
    /// `None` without `/proc`.
    cpu: Option<CpuTimes>,
}

impl Side {
    fn new() -> Side {
        Side {
            samples: Vec::new(),
            elapsed: Duration::ZERO,
            requests: Some(0),
            server_usec: Some(0),
            cpu: Some(CpuTimes::zero()),
        }
    }

    /// Adds a turn's CPU time; none read makes the sum none.
    fn add_cpu(&mut self, turn: Option<CpuTimes>) {
        self.cpu = self.cpu.zip(turn).map(|(sum, t)| sum.add(t));
    }

    /// CPU µs per operation of the clients and of the servers.
    fn cpu_per_op(&self) -> Option<(f64, f64)> {
        Some(self.cpu?.per_op(self.ops()))
    }

    /// One turn: `ops` calls of `op`, one after another.
    async fn serial_turn<F, Fut>(&mut self, target: &Target, commands: &[&str], ops: usize, op: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        // Redis's server time on the side's own commands (a counting pass
        // reads none: its `INFO`s would count as requests).
        let usec = || {
            if target.in_counting_pass() {
                None
            } else {
                target.redis_server_usec(commands)
            }
        };
        let usec_before = usec();
        let requests = target.count_requests();
        let cpu = target.cpu_open();
        let start = Instant::now();
        self.samples.extend(timed(ops, op).await);
        self.elapsed += start.elapsed();
        self.add_cpu(target.cpu_close(cpu));
        self.add_requests(requests.so_far());
        let usec = usec_before
            .zip(usec())
            .map(|(before, after)| after - before);
        self.server_usec = self.server_usec.zip(usec).map(|(a, b)| a + b);
    }

    /// Adds a turn's requests; none counted makes the sum none.
    fn add_requests(&mut self, turn: Option<u64>) {
        self.requests = self.requests.zip(turn).map(|(a, b)| a + b);
    }

    /// Requests per operation over the side's turns.
    fn requests_per_op(&self) -> Option<f64> {
        Some(self.requests? as f64 / self.ops().max(1) as f64)
    }

    fn ops(&self) -> u64 {
        self.samples.len() as u64
    }
}

/// The order of the two sides in turn `turn`: each goes first every other
/// turn. `true` means dlock (or the peer) first.
fn subject_first(turn: usize) -> bool {
    turn.is_multiple_of(2)
}

pub(super) async fn serial(target: &Target, subject: &dyn Lockable, ops: usize) -> Row {
    let raw = target.raw.as_ref();
    let turns = if raw.is_some() { TURNS } else { 1 };
    let per_turn = ops / turns;
    let token = Token::generate().to_string();
    let (mut ours, mut floor) = (Side::new(), Side::new());
    for turn in 0..turns {
        for subject_now in [subject_first(turn), !subject_first(turn)] {
            match raw {
                _ if subject_now => {
                    ours.serial_turn(target, subject.redis_commands(), per_turn, || async {
                        subject.lock(0, "bench:serial").await.unlock().await
                    })
                    .await
                }
                // The floor sends a `SET` and a script.
                Some(raw) => {
                    floor
                        .serial_turn(target, &["set", "evalsha"], per_turn, || {
                            raw.lock_unlock("bench-raw-serial", &token)
                        })
                        .await
                }
                None => {}
            }
        }
    }
    let ops = ours.ops();
    let requests = ours.requests_per_op();
    let cpu = cpu_note(&ours, &floor);
    let samples = Samples::new(ours.samples);
    let mut row = Row {
        scenario: scenario(subject, "serial".into()),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / ours.elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        requests,
        ..Row::default()
    };
    if raw.is_some() {
        let per_op = |usec: Option<u64>, ops: u64| usec.map(|u| u as f64 / ops.max(1) as f64);
        let mut notes = Vec::new();
        if let (Some(dlock), Some(raw)) = (
            per_op(ours.server_usec, ops),
            per_op(floor.server_usec, floor.ops()),
        ) {
            notes.push(format!("Redis busy {dlock:.1} µs/op (raw {raw:.1})"));
        }
        notes.extend(cpu);
        notes.push(format!("{turns} turns each"));
        row.notes = notes.join("; ");
        row.raw_requests = floor.requests_per_op();
        let floor = Samples::new(floor.samples).quantile(0.5);
        row.raw_p50 = Some(floor);
        row.ratio = Some(row.p50.as_secs_f64() / floor.as_secs_f64());
    }
    row
}

/// The CPU µs per operation of the clients and the servers, the floor's
/// beside each.
fn cpu_note(ours: &Side, floor: &Side) -> Option<String> {
    let ((client, servers), (raw_client, raw_servers)) =
        ours.cpu_per_op().zip(floor.cpu_per_op())?;
    let writes = |side: &Side| {
        let writes = side.cpu?.client_writes?;
        Some(writes as f64 / side.ops().max(1) as f64)
    };
    let writes = writes(ours)
        .zip(writes(floor))
        .map_or(String::new(), |(ours, raw)| {
            format!("; client writes {ours:.2}/op (raw {raw:.2})")
        });
    Some(format!(
        "CPU client {client:.1} µs/op (raw {raw_client:.1}), servers {servers:.1} (raw {raw_servers:.1}){writes}"
    ))
}

/// Runs `task(i)` for `i` in `0..tasks`, each spawned (as a service's
/// handlers are: futures joined in one task would share its wake-ups and
/// writes); adds their samples to `side`, and the time they all took.
async fn spawn_each<F>(target: &Target, side: &mut Side, tasks: usize, task: F)
where
    F: Fn(usize) -> BoxFuture<'static, Vec<Duration>>,
{
    let requests = target.count_requests();
    let cpu = target.cpu_open();
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks).map(|i| tokio::spawn(task(i))).collect();
    for h in handles {
        side.samples.extend(h.await.expect("task"));
    }
    side.elapsed += start.elapsed();
    side.add_cpu(target.cpu_close(cpu));
    side.add_requests(requests.so_far());
}

/// The latency of each of `ops` calls of `op`, one after another.
async fn timed<F, Fut>(ops: usize, mut op: F) -> Vec<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut samples = Vec::with_capacity(ops);
    for _ in 0..ops {
        let t = Instant::now();
        op().await;
        samples.push(t.elapsed());
    }
    samples
}

pub(super) async fn distinct(
    target: &Target,
    subject: Arc<dyn Lockable>,
    tasks: usize,
    per_task: usize,
) -> Row {
    let raw = target.raw.clone();
    let turns = if raw.is_some() {
        TURNS.min(per_task)
    } else {
        1
    };
    let per_turn = per_task / turns;
    let (mut ours, mut floor) = (Side::new(), Side::new());
    for turn in 0..turns {
        for subject_now in [subject_first(turn), !subject_first(turn)] {
            match &raw {
                _ if subject_now => {
                    spawn_each(target, &mut ours, tasks, |i| {
                        let subject = subject.clone();
                        Box::pin(async move {
                            let key = format!("bench:distinct:{i}");
                            timed(per_turn, || async {
                                subject.lock(i, &key).await.unlock().await
                            })
                            .await
                        })
                    })
                    .await
                }
                Some(raw) => {
                    spawn_each(target, &mut floor, tasks, |i| {
                        let raw = raw.clone();
                        Box::pin(async move {
                            let key = format!("bench-raw-distinct-{i}");
                            let token = Token::generate().to_string();
                            timed(per_turn, || raw.lock_unlock(&key, &token)).await
                        })
                    })
                    .await
                }
                None => {}
            }
        }
    }
    let ops = ours.ops();
    let requests = ours.requests_per_op();
    let cpu = cpu_note(&ours, &floor);
    let samples = Samples::new(ours.samples);
    let mut row = Row {
        scenario: scenario(&*subject, format!("distinct-{tasks}")),
        backend: target.name.into(),
        ops,
        ops_per_sec: ops as f64 / ours.elapsed.as_secs_f64(),
        p50: samples.quantile(0.5),
        p99: samples.quantile(0.99),
        max: samples.max(),
        requests,
        ..Row::default()
    };
    if raw.is_some() {
        let raw_ops = floor.ops() as f64 / floor.elapsed.as_secs_f64();
        row.raw_ops_per_sec = Some(raw_ops);
        row.ratio = Some(raw_ops / row.ops_per_sec);
        row.raw_requests = floor.requests_per_op();
        let mut notes: Vec<String> = cpu.into_iter().collect();
        notes.push(format!("{turns} turns each"));
        row.notes = notes.join("; ");
    }
    row
}
