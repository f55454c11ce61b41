//! A real crash loop: a consumer process that aborts on a poison message, restarted each
//! time it dies, against the local RabbitMQ.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::panic::AssertUnwindSafe;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use conformance::TestMessage;
use conformance::drive::human;
use conformance::process::{self, Event, Line, ProcessArgs};
use conformance::rabbitmq::{Admin, BrokerEnv, runtime, unique_name};
use conformance::scenarios::int_header;
use conformance::suite::print_uncaptured;
use futures::FutureExt;
use retry_core::headers::CRASHES;
use retry_core::{DeadLetterReason, ParkedRecord, TopologyPlan};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

const SIGABRT: i32 = 6;
const MESSAGES: usize = 20;
const POISON: &str = "poison";

#[test]
fn a_consumer_process_aborting_on_a_poison_message_is_restarted_until_the_poison_is_parked() {
    runtime().block_on(async {
        let Some(env) = BrokerEnv::detect("the crash-loop process test", false).await else {
            return;
        };
        let admin = Admin::connect(&env.amqp091_url).await;
        let queue = unique_name("proc");
        let record = std::env::temp_dir().join(format!("{queue}.record"));
        let args = ProcessArgs {
            queue: queue.clone(),
            poison: POISON.to_owned(),
            record: record.clone(),
            crash_limit: 3,
            delay: Duration::from_millis(300),
        };
        let plan = TopologyPlan::new(&queue, &args.policy()).expect("plan");
        admin.provision(&plan, &Default::default()).await;

        let outcome = AssertUnwindSafe(crash_loop(&env, &admin, &args, &plan))
            .catch_unwind()
            .await;
        admin.cleanup().await;
        let _ = std::fs::remove_file(&record);
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    });
}

fn messages() -> Vec<TestMessage> {
    (0..MESSAGES)
        .map(|i| {
            if i == 4 {
                TestMessage::new(POISON)
            } else {
                TestMessage::new(format!("m-{i:02}"))
            }
        })
        .collect()
}

/// The messages with a `handled` terminal in the record, and how many times each.
fn handled(lines: &[Line]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in lines {
        if let Event::Terminal { id, outcome } = &line.event
            && outcome.starts_with("handled")
        {
            *out.entry(id.clone()).or_default() += 1;
        }
    }
    out
}

enum Turn {
    Exited(ExitStatus),
    Finished,
}

async fn start(env: &BrokerEnv, args: &ProcessArgs) -> Child {
    // Through a shell that turns core dumps off: each abort would otherwise leave a core
    // file wherever the machine's core pattern says. `exec` keeps the pid, so the exit
    // status is the consumer's own.
    Command::new("sh")
        .arg("-c")
        .arg("ulimit -c 0 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_crashing_consumer"))
        .args(args.to_args())
        .env("AMQP_URL", &env.amqp091_url)
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

async fn crash_loop(env: &BrokerEnv, admin: &Admin, args: &ProcessArgs, plan: &TopologyPlan) {
    let messages = messages();
    for m in &messages {
        admin.publish(&args.queue, m).await;
    }
    let innocent: BTreeSet<String> = messages
        .iter()
        .map(|m| m.id.clone())
        .filter(|id| id != POISON)
        .collect();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(90);
    // The poison's handler runs once, then once more after each of crash_limit diverts; the
    // process after that parks it without running it.
    let max_starts = args.crash_limit + 3;
    let mut starts = 0;
    let mut aborts = 0;
    loop {
        starts += 1;
        assert!(
            starts <= max_starts,
            "{starts} processes started; the loop should end after {}",
            args.crash_limit + 2
        );
        let mut child = start(env, args).await;
        let turn = loop {
            if let Some(status) = child.try_wait().expect("wait on the consumer") {
                break Turn::Exited(status);
            }
            let lines = process::read(&args.record);
            let all_handled = handled(&lines).keys().cloned().collect::<BTreeSet<_>>() == innocent;
            if all_handled && admin.ready(plan.parking_queue()).await == 1 {
                break Turn::Finished;
            }
            assert!(
                Instant::now() < deadline,
                "no end to the crash loop after {starts} processes: {lines:?}"
            );
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

    let limit = args.crash_limit;
    assert_eq!(aborts, limit + 1, "one abort per poison run");
    assert_eq!(
        starts,
        limit + 2,
        "every abort restarted, then one clean run"
    );

    let lines = process::read(&args.record);
    let poison_runs: Vec<u32> = lines
        .iter()
        .filter_map(|l| match &l.event {
            Event::Run { id, .. } if id == POISON => Some(l.pid),
            _ => None,
        })
        .collect();
    assert_eq!(poison_runs.len() as u32, limit + 1, "{lines:?}");
    let dying: BTreeSet<u32> = poison_runs.iter().copied().collect();
    assert_eq!(
        dying.len(),
        poison_runs.len(),
        "each run in a process of its own"
    );
    let poison_terminals: Vec<String> = lines
        .iter()
        .filter_map(|l| match &l.event {
            Event::Terminal { id, outcome } if id == POISON => Some(outcome.clone()),
            _ => None,
        })
        .collect();
    let delay_ms = args.delay.as_millis();
    let expected: Vec<String> = (1..=limit)
        .map(|crashes| format!("diverted {crashes} {delay_ms}"))
        .chain(["parked crash-loop".to_owned()])
        .collect();
    assert_eq!(poison_terminals, expected);

    let parked = admin.take_all(plan.parking_queue()).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].id.as_deref(), Some(POISON));
    let record = ParkedRecord::decode(&parked[0].headers);
    assert_eq!(record.reason, Some(DeadLetterReason::CrashLoop));
    assert_eq!((record.crashes, record.attempts), (limit + 1, 0));
    assert_eq!(
        int_header(&parked[0].headers, CRASHES),
        Some(i64::from(limit + 1))
    );

    let handled = handled(&lines);
    assert_eq!(
        handled.keys().cloned().collect::<BTreeSet<_>>(),
        innocent,
        "every other message handled"
    );
    assert_eq!(
        handled.len() + parked.len(),
        messages.len(),
        "handled + parked = published"
    );
    let duplicates: usize = handled.values().map(|n| n - 1).sum();
    for q in plan.queues() {
        assert_eq!(admin.ready(&q.name).await, 0, "messages left in {}", q.name);
    }
    print_uncaptured(&format!(
        "\n== crash loop with real processes: {} published = {} handled + {} parked (crash-loop, {} crashes, limit {limit}); {aborts} aborts, {starts} processes, {duplicates} duplicates, {}\n",
        messages.len(),
        handled.len(),
        parked.len(),
        record.crashes,
        human(took)
    ));
}
