//! Address verification against the local RabbitMQ 3.x: the plugin accepts a send to a
//! missing queue and drops it, so the transport must never send anywhere it has not
//! verified. With provisioning off the consumer still verifies before it takes a message;
//! a queue deleted while the consumer runs is noticed within the re-verification age.
//!
//! The topology of each test is declared over AMQP 0-9-1 under unique names and deleted
//! afterwards.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::options::QueueDeleteOptions;
use lapin::types::FieldTable;
use retry_core::headers::{ATTEMPTS, EngineHeaders};
use retry_core::{
    Confirm, Consumer, ConsumerError, HandlerError, Message, MessageParts, Publish, PublishResult,
    QueueRole, RetryPolicy, RunReport, Terminal, TopologyPlan, Transport, TransportError,
};
use tokio::sync::{Notify, oneshot};
use transport_amqp10::{Amqp10Config, Amqp10Transport};

use common::{Broker, amqp10_url, broker, transport, unique};

/// Every terminal the consumer reported, with the message's body.
type Seen = Arc<Mutex<Vec<(String, Terminal)>>>;

fn record(seen: &Seen) -> impl Fn(&Message, &Terminal) + Send + Sync + 'static {
    let seen = Arc::clone(seen);
    move |msg, terminal| {
        let body = String::from_utf8_lossy(msg.body()).into_owned();
        seen.lock().expect("seen").push((body, *terminal));
    }
}

fn terminals_of(seen: &Seen, body: &str) -> Vec<Terminal> {
    seen.lock()
        .expect("seen")
        .iter()
        .filter(|(b, _)| b == body)
        .map(|(_, t)| *t)
        .collect()
}

/// Polls `done` every 20 ms until it holds or `within` passes; whether it held.
async fn eventually(within: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

fn delay_queue(plan: &TopologyPlan) -> String {
    plan.queues()
        .iter()
        .find(|q| matches!(q.role, QueueRole::Delay { .. }))
        .expect("a delay queue")
        .name
        .clone()
}

/// Takes every message left in `queues` over AMQP 0-9-1 and returns their bodies, sorted.
/// Call it once no AMQP 1.0 connection holds any of them: a message held unsettled is
/// neither ready nor taken.
async fn drain(b: &Broker, queues: &[&str]) -> Vec<String> {
    let mut bodies = Vec::new();
    for queue in queues {
        // A release reaches the queue a moment after the link is gone.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match b.get(queue).await {
                Some((body, _)) => bodies.push(String::from_utf8_lossy(&body).into_owned()),
                None if Instant::now() >= deadline => break,
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    bodies.sort();
    bodies
}

async fn always_fails(_msg: Message) -> Result<(), HandlerError> {
    Err(HandlerError::transient("downstream unavailable"))
}

/// Runs a consumer of `queue` with provisioning off until `last` terminals were reported or
/// `within` passed, then closes its transport, so that nothing it held stays unsettled.
async fn run_unprovisioned<H: retry_core::Handler>(
    queue: &str,
    policy: RetryPolicy,
    handler: H,
    seen: &Seen,
    last: usize,
    within: Duration,
) -> Result<RunReport, ConsumerError> {
    let transport = Arc::new(transport().await);
    let done = Arc::new(Notify::new());
    let consumer = Consumer::builder(Arc::clone(&transport), queue, policy, handler)
        .with_prefetch(10)
        .with_provision(false)
        .with_on_terminal({
            let record = record(seen);
            let seen = Arc::clone(seen);
            let done = Arc::clone(&done);
            move |msg, terminal| {
                record(msg, terminal);
                if seen.lock().expect("seen").len() >= last {
                    done.notify_one();
                }
            }
        })
        .build()
        .expect("consumer");
    let shutdown = async move {
        let _ = tokio::time::timeout(within, done.notified()).await;
    };
    let outcome = tokio::time::timeout(within + Duration::from_secs(10), consumer.run(shutdown))
        .await
        .expect("the consumer stops");
    transport.close().await;
    outcome
}

#[tokio::test]
async fn without_provisioning_a_deleted_delay_queue_stops_the_consumer_before_it_takes_anything() {
    let Some(b) = broker().await else { return };
    let q = unique("noprov-deleted");
    let policy = RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let deleted = delay_queue(&plan);
    // Declared over 0-9-1, then the delay queue deleted: the exchange it was bound to
    // remains, so a send through `/exchange/X/KEY` is accepted and dropped.
    let _cleanup = b.declare(&plan, &[&deleted], vec![]).await;
    let bodies: Vec<String> = (0..5).map(|i| format!("m{i}")).collect();
    for body in &bodies {
        b.publish(&q, body.as_bytes(), BasicProperties::default())
            .await;
    }

    let seen = Seen::default();
    let outcome = run_unprovisioned(
        &q,
        policy,
        always_fails,
        &seen,
        bodies.len(),
        Duration::from_secs(8),
    )
    .await;

    // Every message is still in the work queue, and none was ever delivered: the
    // transport is closed, so nothing is held unacknowledged either.
    let left = drain(&b, &[q.as_str()]).await;
    let terminals = seen.lock().expect("seen").clone();
    assert_eq!(
        left, bodies,
        "messages lost from the work queue; the consumer ran: {outcome:?}, terminals {terminals:?}"
    );
    assert!(terminals.is_empty(), "{terminals:?}");
    let err = outcome.expect_err("the consumer must refuse to start");
    assert!(err.to_string().contains("verifying the topology"), "{err}");
    let source = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<TransportError>())
        .unwrap_or_else(|| panic!("no transport error in {err:?}"));
    let TransportError::MissingAddress { address, .. } = source else {
        panic!("{err:?}")
    };
    assert!(
        address.contains(&deleted),
        "names the missing queue: {address}"
    );
}

#[tokio::test]
async fn without_provisioning_an_unbound_delay_queue_still_gets_every_clone() {
    let Some(b) = broker().await else { return };
    let q = unique("noprov-unbound");
    let policy = RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let unbound = delay_queue(&plan);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let binding = plan
        .bindings()
        .iter()
        .find(|binding| binding.queue == unbound)
        .expect("the delay queue's binding");
    b.channel
        .queue_unbind(
            unbound.as_str().into(),
            binding.exchange.as_str().into(),
            binding.routing_key.as_str().into(),
            FieldTable::default(),
        )
        .await
        .expect("queue_unbind");
    let bodies: Vec<String> = (0..5).map(|i| format!("m{i}")).collect();
    for body in &bodies {
        b.publish(&q, body.as_bytes(), BasicProperties::default())
            .await;
    }

    // Each message fails once, goes through the delay queue and succeeds on its way back.
    let seen = Seen::default();
    let flaky = |msg: Message| async move {
        if msg.headers().get(ATTEMPTS).is_none() {
            return Err(HandlerError::transient("first try fails"));
        }
        Ok(())
    };
    let report = run_unprovisioned(
        &q,
        policy,
        flaky,
        &seen,
        2 * bodies.len(),
        Duration::from_secs(15),
    )
    .await
    .expect("bindings cannot be seen over AMQP 1.0: an unbound queue verifies");

    for body in &bodies {
        let terminals = terminals_of(&seen, body);
        assert!(
            matches!(
                terminals.as_slice(),
                [
                    Terminal::Retried { attempts: 1, .. },
                    Terminal::Handled { attempt: 2 }
                ]
            ),
            "{body}: {terminals:?} (a clone sent through the unbound exchange route is lost); {report:?}"
        );
    }
    assert_eq!((report.retried, report.handled), (5, 5), "{report:?}");
    let left = drain(&b, &[q.as_str(), unbound.as_str(), plan.parking_queue()]).await;
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn a_delay_queue_deleted_while_the_consumer_runs_is_refused_within_the_reverify_age() {
    let Some(b) = broker().await else { return };
    let q = unique("reverify");
    // A long delay: a clone stays in the delay queue for the whole test.
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let deleted = delay_queue(&plan);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let age = Duration::from_millis(300);
    let transport = Arc::new(
        Amqp10Transport::connect(
            Amqp10Config::new(amqp10_url())
                .with_publish_timeout(Duration::from_secs(2))
                .with_reverify_after(age),
        )
        .await
        .expect("AMQP 1.0 connect"),
    );

    let seen = Seen::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let consumer = Consumer::builder(Arc::clone(&transport), q.as_str(), policy, always_fails)
        .with_prefetch(10)
        // Requeued originals come back redelivered and are isolated; they stay in the
        // isolation queue for the test.
        .with_suspect_poll(Duration::from_secs(120))
        .with_on_terminal(record(&seen))
        .build()
        .expect("consumer");
    let after: Vec<String> = (0..3).map(|i| format!("after-{i}")).collect();

    let script = async {
        // Before the deletion a clone reaches the delay queue and its original is acked.
        b.publish(&q, b"before", BasicProperties::default()).await;
        let retried = eventually(Duration::from_secs(10), || {
            matches!(
                terminals_of(&seen, "before").as_slice(),
                [Terminal::Retried { .. }]
            )
        })
        .await;
        let in_delay = b.wait_ready(&deleted, 1, Duration::from_secs(3)).await;
        // An operator deletes the delay queue (a conflict fix deletes and recreates).
        b.channel
            .queue_delete(deleted.as_str().into(), QueueDeleteOptions::default())
            .await
            .expect("queue_delete");
        tokio::time::sleep(3 * age).await;
        for body in &after {
            b.publish(&q, body.as_bytes(), BasicProperties::default())
                .await;
        }
        // Each is requeued after its clone is refused, comes back redelivered and is
        // isolated.
        let requeued = eventually(Duration::from_secs(15), || {
            after.iter().all(|body| {
                let terminals = terminals_of(&seen, body);
                terminals
                    .iter()
                    .any(|t| matches!(t, Terminal::Requeued { .. }))
                    && terminals.contains(&Terminal::Isolated)
            })
        })
        .await;
        let _ = stop.send(());
        (retried, in_delay, requeued)
    };
    let shutdown = async move {
        let _ = stopped.await;
    };
    let (report, (retried, in_delay, requeued)) = tokio::join!(consumer.run(shutdown), script);
    let report = report.expect("run");

    // The transport itself: a clone for the deleted queue is refused, naming it.
    let original = Message::new(MessageParts {
        queue: q.clone(),
        routing_key: q.clone(),
        body: b"direct".to_vec(),
        ..MessageParts::default()
    });
    let (delay, route) = plan.delay_routes()[0].clone();
    let publish = Publish {
        route,
        expiration: Some(delay),
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: Some(transport.now()),
            last_failure: Some(transport.now()),
            last_error: None,
            reason: None,
            delay: Some(delay),
            suspect: None,
        },
    };
    tokio::time::sleep(2 * age).await;
    let direct = transport.publish(&original, &publish).await;
    transport.close().await;

    let seen_all = seen.lock().expect("seen").clone();
    assert!(retried, "the first clone was confirmed: {seen_all:?}");
    assert_eq!(in_delay, 1, "the first clone reached the delay queue");
    // Nothing was lost: every original is back with the broker.
    let others: Vec<String> = plan
        .queues()
        .iter()
        .map(|queue| queue.name.clone())
        .filter(|name| *name != deleted)
        .collect();
    let others: Vec<&str> = others.iter().map(String::as_str).collect();
    let left = drain(&b, &others).await;
    assert_eq!(
        left, after,
        "originals acked after their clones were dropped; terminals {seen_all:?}, {report:?}"
    );
    for body in &after {
        let terminals = terminals_of(&seen, body);
        assert!(
            !terminals
                .iter()
                .any(|t| matches!(t, Terminal::Retried { .. })),
            "{body}: acked after a clone the broker dropped: {terminals:?}"
        );
        assert!(
            terminals.contains(&Terminal::Requeued {
                cause: Confirm::Failed
            }),
            "{body}: {terminals:?}"
        );
    }
    assert!(requeued, "{seen_all:?}");
    assert_eq!(report.retried, 1, "{report:?}");
    let PublishResult::Failed(TransportError::MissingAddress { address, .. }) = &direct else {
        panic!("a send to the deleted queue: {direct:?}")
    };
    assert!(address.contains(&deleted), "{address}");
}
