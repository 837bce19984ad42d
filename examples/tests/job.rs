//! The run-once job: exactly one instance runs each tick, and a stalled
//! holder's late write is refused by its fencing token.

use std::{process::Command, sync::Arc, time::Duration};

use dlock::{BackendExt, Locker, MemoryBackend};
use dlock_examples::job::{run_instance, Event, FencedStore, JobConfig, JobError, Outcome};
use dlock_testkit::fixture::{RedisServer, ZooKeeperServer};
use tokio::time::Instant;

/// Runs one instance per locker; with `stall`, whoever runs tick 0 stalls.
async fn run(
    lockers: Vec<Locker>,
    config: &JobConfig,
    stall: bool,
) -> (Vec<Event>, Arc<FencedStore>) {
    let store = Arc::new(FencedStore::default());
    let epoch = Instant::now() + Duration::from_millis(50);
    let tasks: Vec<_> = lockers
        .into_iter()
        .enumerate()
        .map(|(i, locker)| {
            let (store, config) = (store.clone(), config.clone());
            tokio::spawn(async move {
                let name = ((b'a' + i as u8) as char).to_string();
                let stall = stall.then_some(0);
                run_instance(&locker, &name, &store, &config, epoch, stall).await
            })
        })
        .collect();
    let mut events = Vec::new();
    for task in tasks {
        events.extend(task.await.expect("instance task").expect("instance"));
    }
    (events, store)
}

/// The default schedule with a lease no run can outlive on a busy test
/// machine (a run that outlives its lease may be run again by another
/// instance: the fence orders the writes, it cannot undo the work).
fn unhurried() -> JobConfig {
    JobConfig {
        lease: Duration::from_secs(2),
        ..JobConfig::default()
    }
}

fn ran(events: &[Event], tick: u64) -> Vec<&Event> {
    events
        .iter()
        .filter(|e| e.tick == tick && matches!(e.outcome, Outcome::Ran { .. }))
        .collect()
}

fn assert_exactly_once_per_tick(
    events: &[Event],
    store: &FencedStore,
    config: &JobConfig,
    instances: usize,
) {
    assert_eq!(
        events.len() as u64,
        config.ticks * instances as u64,
        "{events:#?}"
    );
    for tick in 0..config.ticks {
        assert_eq!(ran(events, tick).len(), 1, "tick {tick}: {events:#?}");
    }
    let reports = store.reports();
    assert_eq!(
        reports.iter().map(|r| r.tick).collect::<Vec<_>>(),
        (0..config.ticks).collect::<Vec<_>>(),
        "{reports:?}"
    );
    assert!(
        reports.windows(2).all(|w| w[0].fence < w[1].fence),
        "fences grow: {reports:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_instance_runs_each_tick_in_process() {
    let backend = MemoryBackend::new();
    let lockers = (0..3).map(|_| backend.clone().into_locker()).collect();
    let config = unhurried();
    let (events, store) = run(lockers, &config, false).await;
    assert_exactly_once_per_tick(&events, &store, &config, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_instance_runs_each_tick_through_zookeeper() {
    let server = ZooKeeperServer::start().expect("zookeeper");
    let url = format!("zk://{}/job", server.endpoint());
    let mut lockers = Vec::new();
    for _ in 0..3 {
        lockers.push(
            dlock_examples::backend::locker(Some(&url))
                .await
                .expect("connect"),
        );
    }
    let config = unhurried();
    let (events, store) = run(lockers, &config, false).await;
    assert_exactly_once_per_tick(&events, &store, &config, 3);
}

async fn a_stalled_holders_write_is_refused(lockers: Vec<Locker>) {
    let config = JobConfig::default();
    let (events, store) = run(lockers, &config, true).await;
    let stalled: Vec<&Event> = events
        .iter()
        .filter(|e| e.tick == 0 && matches!(e.outcome, Outcome::Rejected(_)))
        .collect();
    let [stalled] = stalled[..] else {
        panic!("one instance ran tick 0 and stalled past its lease, yet: {events:#?}");
    };
    let Outcome::Rejected(stale) = &stalled.outcome else {
        unreachable!("filtered")
    };
    assert!(stale.fence < stale.newest, "{stale:?}");
    // Another instance took over on tick 1 during the stall, and its
    // report stands; tick 0 has none (it can be run again, safely).
    let tick1 = ran(&events, 1);
    assert_eq!(tick1.len(), 1, "{events:#?}");
    assert_ne!(tick1[0].instance, stalled.instance);
    let reports = store.reports();
    assert!(!reports.iter().any(|r| r.tick == 0), "{reports:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_holders_write_is_refused_in_process() {
    let backend = MemoryBackend::new();
    a_stalled_holders_write_is_refused((0..3).map(|_| backend.clone().into_locker()).collect())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_holders_write_is_refused_through_redis() {
    let server = RedisServer::start().expect("redis-server");
    let mut lockers = Vec::new();
    for _ in 0..3 {
        lockers.push(
            dlock_examples::backend::locker(Some(&server.url()))
                .await
                .expect("connect"),
        );
    }
    a_stalled_holders_write_is_refused(lockers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_is_refused_for_want_of_fencing_tokens() {
    let servers: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start().expect("redis-server"))
        .collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::host_port).collect();
    let url = format!("redis+redlock://{}", hosts.join(","));
    let locker = dlock_examples::backend::locker(Some(&url))
        .await
        .expect("connect");
    let store = Arc::new(FencedStore::default());
    let result = run_instance(
        &locker,
        "a",
        &store,
        &JobConfig::default(),
        Instant::now(),
        None,
    )
    .await;
    assert!(matches!(result, Err(JobError::NoFencing)), "{result:?}");
    assert!(store.reports().is_empty());
}

#[test]
fn the_job_binary_shows_the_refused_write() {
    let out = Command::new(env!("CARGO_BIN_EXE_job"))
        .args(["--stall", "--ticks", "3"])
        .output()
        .expect("run the job demo");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("stalled past its lease; its late write was refused"),
        "{text}"
    );
    assert!(text.contains("ticks run twice: 0"), "{text}");
}

/// The leader-elected scheduler on three instances: the leader of tick 1
/// resigns after it, a follower takes over for the next tick, and every
/// tick's report is written exactly once, with terms that never go back
/// and a new term after the handover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elected_scheduler_hands_over_and_runs_every_tick_once() {
    use dlock_examples::job::run_scheduler;
    let backend = MemoryBackend::new();
    let store = Arc::new(FencedStore::default());
    let config = JobConfig {
        ticks: 5,
        period: Duration::from_millis(200),
        ..JobConfig::default()
    };
    // Time for every instance to campaign before the first tick.
    let epoch = tokio::time::Instant::now() + Duration::from_millis(300);
    let instances: Vec<_> = ["a", "b", "c"]
        .into_iter()
        .map(|name| {
            let (locker, store, config) =
                (backend.clone().into_locker(), store.clone(), config.clone());
            tokio::spawn(async move {
                run_scheduler(&locker, name, &store, &config, epoch, Some(1)).await
            })
        })
        .collect();
    let mut events = Vec::new();
    for instance in instances {
        events.extend(instance.await.expect("an instance").expect("its schedule"));
    }
    let reports = store.reports();
    let ticks: Vec<u64> = reports.iter().map(|r| r.tick).collect();
    assert_eq!(
        ticks,
        [0, 1, 2, 3, 4],
        "each tick exactly once: {reports:?}"
    );
    assert!(
        reports.windows(2).all(|w| w[0].fence <= w[1].fence),
        "a term went back: {reports:?}"
    );
    assert_ne!(reports[1].instance, reports[2].instance, "no handover");
    assert!(
        reports[2].fence > reports[1].fence,
        "the same term after a handover"
    );
    // Away from the handover (after tick 1), every follower names the
    // instance that wrote the tick.
    let following: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.outcome {
            Outcome::Following { leader } if e.tick != 1 => Some((e.tick, leader.clone())),
            _ => None,
        })
        .collect();
    // Two followers at tick 0, one at each of ticks 2 to 4.
    assert_eq!(following.len(), 5, "follower ticks: {events:?}");
    for (tick, leader) in following {
        let wrote = &reports[tick as usize].instance;
        assert_eq!(leader.as_ref(), Some(wrote), "tick {tick}: {events:?}");
    }
}
