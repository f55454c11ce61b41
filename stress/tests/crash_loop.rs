//! A real crash loop against the local RabbitMQ, and against the local NATS server:
//! consumer processes at prefetch 20 that abort on any of three poison messages among 300,
//! restarted each time they die. Only the poison messages are blamed; everything else is
//! handled.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::panic::AssertUnwindSafe;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use conformance::rabbitmq::{Admin, BrokerEnv, runtime, unique_name};
use conformance::suite::print_uncaptured;
use conformance::{ParkedMessage, TestMessage};
use futures::FutureExt;
use retry_core::headers::CRASHES;
use retry_core::{DeadLetterReason, HeaderValue, ParkedRecord, TopologyPlan, Transport};
use stress::process::{self, Event, Line, ProcessArgs};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use transport_nats::NatsTransport;

const SIGABRT: i32 = 6;
const MESSAGES: usize = 300;
const PREFETCH: u16 = 20;

fn is_poison(i: usize) -> bool {
    [37, 150, 263].contains(&i)
}

fn id(i: usize) -> String {
    if is_poison(i) {
        format!("poison-{i:03}")
    } else {
        format!("m-{i:03}")
    }
}

/// The broker the processes run on, and the test's own connection to it: to publish, count
/// and read what was parked.
enum Side {
    RabbitMq { env: BrokerEnv, admin: Box<Admin> },
    Nats { url: String, admin: NatsTransport },
}

impl Side {
    async fn publish(&self, queue: &str, m: &TestMessage) {
        match self {
            Side::RabbitMq { admin, .. } => admin.publish(queue, m).await,
            Side::Nats { admin, .. } => {
                conformance::nats::publish_test_message(admin.client(), queue, m).await;
            }
        }
    }

    async fn ready(&self, queue: &str) -> usize {
        match self {
            Side::RabbitMq { admin, .. } => admin.ready(queue).await,
            Side::Nats { admin, .. } => admin.count(queue).await.expect("count") as usize,
        }
    }

    async fn take_all(&self, queue: &str) -> Vec<ParkedMessage> {
        match self {
            Side::RabbitMq { admin, .. } => admin.take_all(queue).await,
            Side::Nats { admin, .. } => conformance::nats::take_all(admin, queue).await,
        }
    }

    fn command(&self) -> Command {
        let mut command = Command::new("sh");
        match self {
            Side::RabbitMq { env, .. } => command.env("AMQP_URL", &env.amqp091_url),
            Side::Nats { url, .. } => command
                .env("CRASHING_TRANSPORT", "nats")
                .env("NATS_URL", url),
        };
        command
    }

    async fn cleanup(&self, plan: &TopologyPlan) {
        match self {
            Side::RabbitMq { admin, .. } => admin.cleanup().await,
            Side::Nats { admin, .. } => {
                conformance::nats::delete_plan(admin.client(), plan).await;
                admin.close().await;
            }
        }
    }
}

fn args_for(queue: &str) -> ProcessArgs {
    ProcessArgs {
        queue: queue.to_owned(),
        poison: (0..MESSAGES).filter(|&i| is_poison(i)).map(id).collect(),
        record: std::env::temp_dir().join(format!("{queue}.record")),
        crash_limit: 3,
        delay: Duration::from_millis(300),
        prefetch: PREFETCH,
    }
}

/// Runs the crash loop on `side`, whose plan `provision` declares, and cleans up.
async fn run_on(side: Side, provision: impl AsyncFnOnce(&Side, &TopologyPlan)) {
    let queue = unique_name("proc");
    let args = args_for(&queue);
    let plan = TopologyPlan::new(&queue, &args.policy()).expect("plan");
    provision(&side, &plan).await;
    let outcome = AssertUnwindSafe(crash_loop(&side, &args, &plan))
        .catch_unwind()
        .await;
    side.cleanup(&plan).await;
    let _ = std::fs::remove_file(&args.record);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn consumer_processes_aborting_on_poison_messages_blame_only_the_poison() {
    runtime().block_on(async {
        let Some(env) = BrokerEnv::detect("the crash-loop process test", false).await else {
            return;
        };
        let admin = Admin::connect(&env.amqp091_url).await;
        run_on(
            Side::RabbitMq {
                env,
                admin: Box::new(admin),
            },
            async |side, plan| {
                let Side::RabbitMq { admin, .. } = side else {
                    unreachable!()
                };
                admin.provision(plan, &Default::default()).await;
            },
        )
        .await;
    });
}

#[test]
fn consumer_processes_aborting_on_poison_messages_blame_only_the_poison_on_nats() {
    runtime().block_on(async {
        let url = conformance::nats::nats_url();
        let what = "the crash-loop process test on NATS";
        let Some(admin) = conformance::nats::detect(what, &url).await else {
            return;
        };
        run_on(Side::Nats { url, admin }, async |side, plan| {
            let Side::Nats { admin, .. } = side else {
                unreachable!()
            };
            admin.provision(plan).await.expect("provision over NATS");
        })
        .await;
    });
}

fn messages() -> Vec<TestMessage> {
    (0..MESSAGES).map(|i| TestMessage::new(id(i))).collect()
}

/// The messages whose handler succeeded, and how many times each. A success whose ack was
/// sent just before its process died has no `terminal` line: successes are what count.
fn handled(lines: &[Line]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in lines {
        if let Event::Succeeded { id, .. } = &line.event {
            *out.entry(id.clone()).or_default() += 1;
        }
    }
    out
}

/// Each message's terminals, in record order.
fn terminals(lines: &[Line]) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in lines {
        if let Event::Terminal { id, outcome } = &line.event {
            out.entry(id.clone()).or_default().push(outcome.clone());
        }
    }
    out
}

/// Each message's runs as (pid, alone), in record order.
fn runs(lines: &[Line]) -> BTreeMap<String, Vec<(u32, bool)>> {
    let mut out: BTreeMap<String, Vec<(u32, bool)>> = BTreeMap::new();
    for line in lines {
        if let Event::Run { id, alone, .. } = &line.event {
            out.entry(id.clone()).or_default().push((line.pid, *alone));
        }
    }
    out
}

enum Turn {
    Exited(ExitStatus),
    Finished,
}

async fn start(side: &Side, args: &ProcessArgs) -> Child {
    // Through a shell that turns core dumps off: each abort would otherwise leave a core
    // file wherever the machine's core pattern says. `exec` keeps the pid, so the exit
    // status is the consumer's own.
    side.command()
        .arg("-c")
        .arg("ulimit -c 0 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_crashing_consumer"))
        .args(args.to_args())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // A failing test must not leave a consumer behind.
        .kill_on_drop(true)
        .spawn()
        .expect("the crashing consumer starts")
}

async fn stderr_of(child: &mut Child) -> String {
    let mut text = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut text).await;
    }
    text
}

async fn crash_loop(side: &Side, args: &ProcessArgs, plan: &TopologyPlan) {
    let messages = messages();
    for m in &messages {
        side.publish(&args.queue, m).await;
    }
    let innocent: BTreeSet<String> = messages
        .iter()
        .map(|m| m.id.clone())
        .filter(|id| !args.poison.contains(id))
        .collect();
    let poison_count = args.poison.len();
    let limit = args.crash_limit;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(150);
    // Each poison message runs alone crash_limit + 1 times, and at most once beside others
    // before that.
    let max_aborts = poison_count as u32 * (limit + 2);
    let mut starts = 0;
    let mut aborts = 0;
    loop {
        starts += 1;
        assert!(
            aborts <= max_aborts,
            "{aborts} aborts; the loop should end after at most {max_aborts}"
        );
        let mut child = start(side, args).await;
        let turn = loop {
            if let Some(status) = child.try_wait().expect("wait on the consumer") {
                break Turn::Exited(status);
            }
            let lines = process::read(&args.record);
            let all_handled = handled(&lines).keys().cloned().collect::<BTreeSet<_>>() == innocent;
            if all_handled && side.ready(plan.parking_queue()).await == poison_count {
                break Turn::Finished;
            }
            if Instant::now() >= deadline {
                let done = handled(&lines);
                let missing: Vec<&String> = innocent
                    .iter()
                    .filter(|id| !done.contains_key(*id))
                    .collect();
                let mut depths = Vec::new();
                for q in plan.queues() {
                    depths.push(format!("{} {}", q.name, side.ready(&q.name).await));
                }
                let record: Vec<&Line> = lines
                    .iter()
                    .filter(|l| match &l.event {
                        Event::Run { id, .. }
                        | Event::Succeeded { id, .. }
                        | Event::Terminal { id, .. } => missing.contains(&id),
                    })
                    .collect();
                let _ = child.start_kill();
                panic!(
                    "no end to the crash loop after {starts} processes, {aborts} aborts: not handled {missing:?}; ready: {depths:?}; their record: {record:?}; stderr: {}",
                    stderr_of(&mut child).await
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        match turn {
            Turn::Exited(status) if status.signal() == Some(SIGABRT) => aborts += 1,
            Turn::Exited(status) => {
                panic!(
                    "the consumer exited on its own ({status}): {}",
                    stderr_of(&mut child).await
                )
            }
            Turn::Finished => {
                drop(child.stdin.take());
                let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
                    .await
                    .expect("the consumer stops when its input closes")
                    .expect("wait on the consumer");
                assert!(
                    status.success(),
                    "the last consumer failed ({status}): {}",
                    stderr_of(&mut child).await
                );
                break;
            }
        }
    }
    let took = started.elapsed();
    assert_eq!(
        starts,
        aborts + 1,
        "every abort restarted, then one clean run"
    );

    let lines = process::read(&args.record);
    let runs = runs(&lines);
    let terminals = terminals(&lines);
    let delay_ms = args.delay.as_millis();
    let parked = side.take_all(plan.parking_queue()).await;
    for p in &parked {
        assert!(
            args.poison.contains(p.id.as_ref().unwrap()),
            "an innocent message was parked: {p:?}"
        );
        let record = ParkedRecord::decode(&p.headers);
        assert_eq!(record.reason, Some(DeadLetterReason::CrashLoop));
        assert_eq!((record.crashes, record.attempts), (limit + 1, 0));
        assert_eq!(
            p.headers.get(CRASHES).and_then(HeaderValue::as_u64),
            Some(u64::from(limit + 1))
        );
    }
    let mut poison_runs = 0;
    for p in &args.poison {
        // At-least-once: a process that dies between isolating a message and sending that
        // ack leaves two copies of it. Each copy is counted on its own.
        let copies = parked
            .iter()
            .filter(|m| m.id.as_deref() == Some(p.as_str()))
            .count() as u32;
        assert!(copies >= 1, "{p} was not parked");
        let runs = &runs[p];
        // Every run of a poison message aborted its process.
        let pids: BTreeSet<u32> = runs.iter().map(|(pid, _)| *pid).collect();
        assert_eq!(
            pids.len(),
            runs.len(),
            "{p}: each run in a process of its own"
        );
        let alone = runs.iter().filter(|(_, alone)| *alone).count() as u32;
        assert_eq!(alone, copies * (limit + 1), "{p}: runs {runs:?}");
        poison_runs += runs.len() as u32;
        let got = &terminals[p];
        let count = |prefix: &str| got.iter().filter(|t| t.starts_with(prefix)).count() as u32;
        assert_eq!(count("diverted"), copies * limit, "{p}: {got:?}");
        assert_eq!(count("parked crash-loop"), copies, "{p}: {got:?}");
        for crashes in 1..=limit {
            let diverted = format!("diverted {crashes} {delay_ms}");
            assert!(got.contains(&diverted), "{p}: no {diverted:?} in {got:?}");
        }
    }
    assert_eq!(aborts, poison_runs, "one abort per poison run");

    let handled = handled(&lines);
    assert_eq!(
        handled.keys().cloned().collect::<BTreeSet<_>>(),
        innocent,
        "every other message handled"
    );
    let mut innocent_runs = 0;
    let mut suspects = 0;
    for id in &innocent {
        let got = terminals.get(id).map_or(&[][..], Vec::as_slice);
        assert!(
            got.iter()
                .all(|t| t == "isolated" || t.starts_with("handled")),
            "{id} was blamed: {got:?}"
        );
        suspects += got.iter().filter(|t| *t == "isolated").count();
        innocent_runs += runs.get(id).map_or(0, Vec::len);
    }
    let parked_ids: BTreeSet<&str> = parked.iter().filter_map(|p| p.id.as_deref()).collect();
    assert_eq!(
        handled.len() + parked_ids.len(),
        messages.len(),
        "handled + parked = published: nothing lost"
    );
    let duplicates: usize =
        handled.values().map(|n| n - 1).sum::<usize>() + parked.len() - parked_ids.len();
    for q in plan.queues() {
        assert_eq!(side.ready(&q.name).await, 0, "messages left in {}", q.name);
    }
    print_uncaptured(&format!(
        "\n== crash loop with real processes at prefetch {PREFETCH}: {} published = {} handled + {} parked (all poison, crash-loop, {} crashes each, limit {limit}); {aborts} aborts attributed to {poison_count} poison messages, 0 innocents parked, 0 lost; {} healthy messages ran {innocent_runs} times ({:.3} per message), {suspects} isolations, {duplicates} duplicates; {starts} processes, {took:.1?}\n",
        messages.len(),
        handled.len(),
        parked_ids.len(),
        limit + 1,
        innocent.len(),
        innocent_runs as f64 / innocent.len() as f64,
    ));
}
