//! `retry_core::Consumer` on the AMQP 1.0 transport against the local RabbitMQ.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use retry_core::headers::{CRASHES, SUSPECT};
use retry_core::{
    Consumer, ConsumerError, HandlerError, HeaderValue, Message, QueueRole, RetryPolicy, RunReport,
    Subscription, Terminal, TopologyPlan, Transport, TransportError,
};
use tokio::sync::Notify;

use common::{broker, transport, unique};

/// What a consumer run sees, as it sees it.
#[derive(Default)]
struct Seen {
    terminals: Mutex<Vec<(Vec<u8>, Terminal, Instant)>>,
    runs: Mutex<Vec<Message>>,
}

/// A consumer run: its report, each terminal with the message's body and when it was
/// reported, and each message as the handler got it.
type Run = (RunReport, Vec<(Vec<u8>, Terminal, Instant)>, Vec<Message>);

/// Runs a consumer on `queue` with a fresh transport until `last` terminals have been
/// reported, or 30 s. The handler records each message and succeeds.
async fn run_until(queue: &str, policy: RetryPolicy, last: usize) -> Run {
    let seen = Arc::new(Seen::default());
    let done = Arc::new(Notify::new());
    let handler = {
        let seen = Arc::clone(&seen);
        move |msg: Message| {
            seen.runs.lock().expect("runs").push(msg);
            async { Ok::<(), HandlerError>(()) }
        }
    };
    let consumer = Consumer::builder(transport().await, queue, policy, handler)
        .with_prefetch(5)
        .with_suspect_poll(Duration::from_millis(200))
        .with_on_terminal({
            let seen = Arc::clone(&seen);
            let done = Arc::clone(&done);
            move |msg, terminal| {
                let mut terminals = seen.terminals.lock().expect("terminals");
                terminals.push((msg.body().to_vec(), *terminal, Instant::now()));
                if terminals.len() == last {
                    done.notify_one();
                }
            }
        })
        .build()
        .expect("consumer");
    let shutdown = async move {
        let _ = tokio::time::timeout(Duration::from_secs(30), done.notified()).await;
    };
    let report = consumer.run(shutdown).await.expect("run");
    let terminals = std::mem::take(&mut *seen.terminals.lock().expect("terminals"));
    let runs = std::mem::take(&mut *seen.runs.lock().expect("runs"));
    (report, terminals, runs)
}

async fn handle(msg: Message) -> Result<(), HandlerError> {
    match msg.body() {
        b"ok" => Ok(()),
        b"flaky" if msg.headers().get("x-retry-attempts").is_none() => {
            Err(HandlerError::transient("first try fails"))
        }
        b"flaky" => Ok(()),
        _ => Err(HandlerError::permanent("unreadable")),
    }
}

#[tokio::test]
async fn the_consumer_runs_every_path_over_amqp10() {
    let Some(b) = broker().await else { return };
    let q = unique("consumer");
    let policy = RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    for body in [&b"ok"[..], b"flaky", b"bad"] {
        b.publish(&q, body, BasicProperties::default()).await;
    }

    let finished = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(Notify::new());
    let consumer = Consumer::builder(transport().await, q.as_str(), policy, handle)
        .with_prefetch(5)
        .with_handler_timeout(Duration::from_secs(5))
        .with_on_terminal({
            let finished = Arc::clone(&finished);
            let done = Arc::clone(&done);
            move |_, terminal| {
                if terminal.is_final() && finished.fetch_add(1, Ordering::SeqCst) + 1 == 3 {
                    done.notify_one();
                }
            }
        })
        .build()
        .expect("consumer");
    let shutdown = async move {
        let _ = tokio::time::timeout(Duration::from_secs(20), done.notified()).await;
    };
    let report = consumer.run(shutdown).await.expect("run");

    assert_eq!(finished.load(Ordering::SeqCst), 3, "{report:?}");
    assert_eq!(report.received, 4, "{report:?}");
    assert_eq!(report.handled, 2, "{report:?}");
    assert_eq!(report.retried, 1, "{report:?}");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(
        report.requeued + report.settle_errors + report.receive_errors,
        0
    );
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 1, Duration::from_secs(3))
            .await,
        1
    );
    assert_eq!(b.ready(&q).await, 0);
}

#[tokio::test]
async fn the_consumer_reports_a_missing_delay_queue_before_consuming() {
    let Some(b) = broker().await else { return };
    let q = unique("consumer-missing");
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let delay_queue = plan.queues()[1].name.clone();
    let _cleanup = b.declare(&plan, &[&delay_queue], vec![]).await;
    b.publish(&q, b"ok", BasicProperties::default()).await;

    let handled = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&handled);
    let consumer = Consumer::builder(
        transport().await,
        q.as_str(),
        policy,
        move |_msg: Message| {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), HandlerError>(()) }
        },
    )
    .build()
    .expect("consumer");
    let err = tokio::time::timeout(
        Duration::from_secs(20),
        consumer.run(std::future::pending()),
    )
    .await
    .expect("fails promptly")
    .expect_err("the delay queue is missing");
    let ConsumerError::Provision {
        source: TransportError::MissingAddress { address, .. },
        ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert!(address.contains(&delay_queue), "{address}");
    assert_eq!(handled.load(Ordering::SeqCst), 0);
    let (body, redelivered) = b.get(&q).await.expect("still queued");
    assert_eq!(body, b"ok");
    assert!(!redelivered, "never delivered to anyone");
}

#[tokio::test]
async fn a_redelivered_message_is_isolated_then_run_alone_from_the_isolation_queue() {
    let Some(b) = broker().await else { return };
    let q = unique("consumer-suspect");
    let policy = RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"suspect", BasicProperties::default()).await;

    // A consumer takes it and dies before settling: it comes back redelivered.
    let crashed = transport().await;
    let sub = crashed.consume(&q, 1).await.expect("consume");
    let held = sub.recv().await.expect("recv").expect("delivery");
    assert!(!held.facts.redelivered);
    crashed.close().await;

    let (report, terminals, runs) = run_until(&q, policy, 2).await;

    let kinds: Vec<_> = terminals.iter().map(|(_, t, _)| *t).collect();
    assert_eq!(
        kinds,
        [Terminal::Isolated, Terminal::Handled { attempt: 1 }],
        "{report:?}"
    );
    assert!(terminals.iter().all(|(body, _, _)| body == b"suspect"));
    assert_eq!(
        runs.len(),
        1,
        "the handler ran once, on the fetched suspect"
    );
    assert_eq!(runs[0].body(), b"suspect");
    // Isolating counts no crash (and a count of 0 is not written).
    assert_eq!(runs[0].headers().get(CRASHES), None);
    assert!(
        runs[0].headers().get(SUSPECT).is_some(),
        "the suspect's copy"
    );
    assert_eq!(report.received, 2, "{report:?}");
    assert_eq!(
        report.suspects, 1,
        "taken from the isolation queue: {report:?}"
    );
    assert_eq!(
        (report.isolated, report.handled, report.diverted),
        (1, 1, 0)
    );
    assert_eq!(
        report.settle_errors + report.receive_errors,
        0,
        "{report:?}"
    );
    assert_eq!(b.ready(&q).await, 0);
    assert_eq!(b.ready(plan.isolation_queue()).await, 0);
    assert_eq!(b.ready(plan.parking_queue()).await, 0);
}

#[tokio::test]
async fn a_suspect_whose_consumer_dies_counts_a_crash_and_returns_through_the_crash_delay() {
    let Some(b) = broker().await else { return };
    let q = unique("consumer-crash");
    let policy = RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let (crash_delay, _) = plan.crash_route().expect("a crash-delay queue");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(
        plan.isolation_queue(),
        b"poison",
        BasicProperties::default(),
    )
    .await;

    // A consumer fetches the suspect to run it alone, and dies.
    let crashed = transport().await;
    let suspect = crashed
        .fetch(plan.isolation_queue())
        .await
        .expect("fetch")
        .expect("the suspect");
    assert!(!suspect.facts.redelivered);
    crashed.close().await;

    // The diverted clone is published after this, so it cannot be back before `started` plus
    // the crash delay. (Its Diverted terminal is reported only once the original's
    // settlement completes, which can come after the clone was published.)
    let started = Instant::now();
    let (report, terminals, runs) = run_until(&q, policy, 2).await;

    let kinds: Vec<_> = terminals.iter().map(|(_, t, _)| *t).collect();
    assert_eq!(
        kinds,
        [
            Terminal::Diverted {
                crashes: 1,
                delay: crash_delay
            },
            Terminal::Handled { attempt: 1 }
        ],
        "{report:?}"
    );
    let waited = terminals[1].2 - started;
    assert!(
        waited >= crash_delay,
        "back from the crash delay after {waited:?}"
    );
    assert_eq!(runs.len(), 1, "not run when it came back redelivered");
    assert_eq!(runs[0].body(), b"poison");
    assert_eq!(runs[0].headers().get(CRASHES), Some(&HeaderValue::Int(1)));
    assert_eq!(
        report.suspects, 2,
        "both times from the isolation queue: {report:?}"
    );
    assert_eq!((report.diverted, report.handled), (1, 1), "{report:?}");
    assert_eq!(b.ready(plan.isolation_queue()).await, 0);
    let crash_queue = plan
        .queues()
        .iter()
        .find(|q| matches!(q.role, QueueRole::CrashDelay { .. }))
        .expect("crash-delay queue");
    assert_eq!(b.ready(&crash_queue.name).await, 0);
    assert_eq!(b.ready(plan.parking_queue()).await, 0);
}
