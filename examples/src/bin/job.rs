//! The run-once job: several instances on one schedule, exactly one runs
//! the job per tick, and a fencing token guards its write.
//!
//! ```text
//! cargo run -p dlock-examples --bin job
//! cargo run -p dlock-examples --bin job -- --backend redis://127.0.0.1:6379 --stall
//! ```

use std::{process::ExitCode, sync::Arc, time::Duration};

use dlock_examples::{
    backend,
    job::{run_instance, Event, FencedStore, JobConfig, Outcome},
};
use tokio::time::Instant;

const USAGE: &str =
    "usage: job [--backend URL] [--instances N] [--ticks N] [--period-ms N] [--lease-ms N] [--stall]";

struct Args {
    backend: Option<String>,
    instances: usize,
    config: JobConfig,
    stall: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        backend: None,
        instances: 3,
        config: JobConfig::default(),
        stall: false,
    };
    let mut argv = std::env::args().skip(1);
    while let Some(arg) = argv.next() {
        let mut number = |name: &str| -> Result<u64, String> {
            let value = argv
                .next()
                .ok_or(format!("{name} needs a value\n{USAGE}"))?;
            value
                .parse()
                .map_err(|_| format!("{name}: `{value}` is not a number\n{USAGE}"))
        };
        match arg.as_str() {
            "--backend" => {
                args.backend = Some(
                    argv.next()
                        .ok_or(format!("--backend needs a URL\n{USAGE}"))?,
                )
            }
            "--instances" => args.instances = number("--instances")? as usize,
            "--ticks" => args.config.ticks = number("--ticks")?,
            "--period-ms" => args.config.period = Duration::from_millis(number("--period-ms")?),
            "--lease-ms" => args.config.lease = Duration::from_millis(number("--lease-ms")?),
            "--stall" => args.stall = true,
            "-h" | "--help" => return Err(format!("{USAGE}\nbackends: {}", backend::urls())),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    if !(1..=26).contains(&args.instances) {
        return Err(format!(
            "--instances takes 1 to 26 (instances a to z)\n{USAGE}"
        ));
    }
    Ok(args)
}

fn describe(event: &Event) -> String {
    let what = match &event.outcome {
        Outcome::Ran { fence } => {
            format!("ran the job, wrote its report with fencing token {fence}")
        }
        Outcome::Skipped => "skipped: another instance holds the job".to_owned(),
        Outcome::Following {
            leader: Some(leader),
        } => format!("following instance {leader}"),
        Outcome::Following { leader: None } => "following: nobody leads now".to_owned(),
        Outcome::AlreadyDone => "skipped: this tick's report is already written".to_owned(),
        Outcome::Rejected(stale) => {
            format!("stalled past its lease; its late write was refused ({stale})")
        }
    };
    format!("tick {}  instance {}  {what}", event.tick, event.instance)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    println!(
        "{} instances, {} ticks every {:?}, lease {:?} (backend: {}){}",
        args.instances,
        args.config.ticks,
        args.config.period,
        args.config.lease,
        backend::shown(args.backend.as_deref()),
        if args.stall {
            "; whoever runs tick 0 stalls past its lease"
        } else {
            ""
        },
    );
    // One client per instance, as separate services would have; the
    // in-process backend is shared, or the instances would not see each
    // other.
    let shared = match backend::locker(args.backend.as_deref()).await {
        Ok(locker) => locker,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let store = Arc::new(FencedStore::default());
    let epoch = Instant::now() + Duration::from_millis(50);
    let mut instances = Vec::new();
    for i in 0..args.instances {
        let name = ((b'a' + i as u8) as char).to_string();
        let locker = if i == 0 || backend::is_in_process(args.backend.as_deref()) {
            shared.clone()
        } else {
            match backend::locker(args.backend.as_deref()).await {
                Ok(locker) => locker,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            }
        };
        let (store, config) = (store.clone(), args.config.clone());
        let stall = args.stall.then_some(0);
        instances.push(tokio::spawn(async move {
            run_instance(&locker, &name, &store, &config, epoch, stall).await
        }));
    }
    let mut events = Vec::new();
    for instance in instances {
        match instance.await {
            Ok(Ok(e)) => events.extend(e),
            Ok(Err(e)) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("an instance panicked: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    events.sort_by(|a, b| (a.tick, &a.instance).cmp(&(b.tick, &b.instance)));
    for event in &events {
        println!("{}", describe(event));
    }
    let reports = store.reports();
    let mut ticks: Vec<u64> = reports.iter().map(|r| r.tick).collect();
    ticks.sort_unstable();
    ticks.dedup();
    let twice = reports.len() - ticks.len();
    println!(
        "{} reports written for {} ticks; ticks run twice: {twice}",
        reports.len(),
        args.config.ticks
    );
    if twice > 0 {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
