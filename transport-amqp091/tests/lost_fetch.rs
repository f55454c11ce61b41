//! A `basic.get` whose `get-ok` comes too late, on the real RabbitMQ: the transport gives up
//! on its channel, so the message goes back to the queue redelivered at once, and the
//! consumer does not charge it the crash that redelivery seems to show.
//!
//! The tap between the socket and lapin loses the `get-ok`
//! ([`AmqpTransport::lose_get_oks`]), as if it came after the request timeout: the broker
//! has handed the message to the get's channel and holds it there unacknowledged.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::*;
use retry_core::{
    HandlerError, Message, RetryPolicy, Settlement, Terminal, TopologyPlan, Transport,
    TransportError,
};
use test_brokers::LogRecorder;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The process-wide log recorder (warnings and worse): the consumer's tasks log where only
/// the global subscriber sees them.
fn logs() -> &'static LogRecorder {
    static LOGS: OnceLock<LogRecorder> = OnceLock::new();
    LOGS.get_or_init(|| {
        let recorder = LogRecorder::up_to(tracing::Level::WARN);
        tracing::subscriber::set_global_default(recorder.clone()).expect("the only subscriber");
        recorder
    })
}

/// The transport's warnings that a fetch from `queue` was lost in flight.
fn lost_fetches(queue: &str) -> usize {
    logs()
        .containing("lost in flight")
        .iter()
        .filter(|line| line.contains("transport_amqp091::transport") && line.contains(queue))
        .count()
}

/// The request timeout: the lost get-ok never comes, so this only bounds how long a fetch
/// waits for it; a short one would also give up on real answers on a loaded machine.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

fn policy() -> RetryPolicy {
    RetryPolicy::delays([ms(300)])
        .with_crash_delay(ms(200))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_get_whose_get_ok_is_lost_fails_with_fetch_lost_and_its_message_comes_back_redelivered() {
    let Some(config) = broker("lost-get-ok").await else {
        return;
    };
    let config = config.with_request_timeout(REQUEST_TIMEOUT);
    let q = unique("lost-get-ok");
    let plan = TopologyPlan::new(&q, &policy()).unwrap();
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let (_c, ch) = raw().await;
    let suspects = plan.isolation_queue();
    publish(&ch, suspects, b"innocent", "innocent").await;

    t.lose_get_oks(1);
    match t.fetch(suspects).await {
        Err(TransportError::FetchLost { queue, .. }) => assert_eq!(queue, suspects),
        other => panic!("expected FetchLost, got {other:?}"),
    }
    // Back in the queue already, redelivered, for the very next fetch.
    let again = t
        .fetch(suspects)
        .await
        .unwrap()
        .expect("the message is back");
    assert_eq!(again.message.body(), b"innocent");
    assert!(again.facts.redelivered);
    t.settle(&again.tag, Settlement::Ack).await.unwrap();
    assert!(t.fetch(suspects).await.unwrap().is_none());
    t.close().await.unwrap();
    assert_eq!(message_count(&ch, suspects).await.unwrap(), 0);
}

#[tokio::test]
async fn an_innocent_suspect_whose_get_ok_is_late_is_not_charged_a_crash() {
    let Some(config) = broker("late-get-ok").await else {
        return;
    };
    let config = config.with_request_timeout(REQUEST_TIMEOUT);
    let q = unique("late-get-ok");
    let plan = TopologyPlan::new(&q, &policy()).unwrap();
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = Arc::new(transport(&config).await);
    t.provision(&plan).await.unwrap();
    let (_c, ch) = raw().await;
    // A suspect already isolated, as a bystander of a crash is: healthy, and fresh in the
    // isolation queue.
    publish(&ch, plan.isolation_queue(), b"innocent", "innocent").await;
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |_m: Message| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), HandlerError>(()) }
        }
    };
    let handled =
        |t: &[(String, Terminal)]| t.iter().any(|(_, t)| matches!(t, Terminal::Handled { .. }));

    logs();
    t.lose_get_oks(1);
    let first = start(Arc::clone(&t), policy(), handler.clone(), &q, |b| {
        b.with_suspect_poll(ms(100))
    });
    let done = first.until(ms(10_000), handled).await;
    let mut terminals = first.of("innocent");
    first.stop().await;
    (*t).close().await.unwrap();
    if !done {
        // Still held on the first transport's get channel: closing it sent the message back
        // redelivered. A consumer elsewhere takes it from there.
        let second = start(
            Arc::new(transport(&config).await),
            policy(),
            handler,
            &q,
            |b| b.with_suspect_poll(ms(100)),
        );
        assert!(second.until(ms(15_000), handled).await, "handled at last");
        terminals.extend(second.of("innocent"));
        second.stop().await;
    }

    assert!(
        !terminals
            .iter()
            .any(|t| matches!(t, Terminal::Diverted { .. })),
        "an innocent suspect was charged a crash: {terminals:?}"
    );
    assert!(
        done,
        "handled by the consumer that lost the fetch: {terminals:?}"
    );
    assert_eq!(
        lost_fetches(plan.isolation_queue()),
        1,
        "the get-ok was lost, and the transport said so"
    );
    assert_eq!(
        terminals
            .iter()
            .filter(|t| matches!(t, Terminal::Handled { .. }))
            .count(),
        1
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "run once");
    for queue in [
        plan.work_queue(),
        plan.isolation_queue(),
        plan.parking_queue(),
    ] {
        assert_eq!(message_count(&ch, queue).await.unwrap(), 0, "{queue}");
    }
}
