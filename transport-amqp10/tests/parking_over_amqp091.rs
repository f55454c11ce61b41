//! A message parked by the AMQP 1.0 consumer, read from the parking queue and replayed over
//! AMQP 0-9-1 (as `retryctl` does), then handled by the AMQP 1.0 consumer again.
//!
//! RabbitMQ 3.x hands an AMQP 0-9-1 reader the application properties of a message published
//! over AMQP 1.0 only as one opaque header, `x-amqp-1.0-app-properties`, holding the
//! section's AMQP 1.0 encoding. The engine's record on a parked message lives there, so the
//! AMQP 0-9-1 transport decodes it into headers. And AMQP 0-9-1 headers are not shown to
//! AMQP 1.0 clients, so the replayed copy carries its headers in that section again.

mod common;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Body, Data, Message as AmqpMessage, MessageId, Properties,
};
use fe2o3_amqp::types::primitives::{Binary, Value};
use fe2o3_amqp::{Connection, Sender, Session};
use retry_core::{
    Consumer, DeadLetterReason, Handler, HandlerError, HeaderValue, Message, ParkedFilter,
    ParkedRecord, ParkingLot, ReplayOptions, RetryPolicy, RunReport, Terminal, TopologyPlan,
};
use tokio::sync::Notify;
use transport_amqp091::{AmqpConfig, AmqpTransport};

use common::{amqp_url, amqp10_url, broker, transport, unique};

/// Publishes one message to `queue` over AMQP 1.0, as a producer on that protocol does.
async fn publish10(queue: &str, message: AmqpMessage<Body<Value>>) {
    let mut connection = Connection::open("parking-test", amqp10_url().as_str())
        .await
        .expect("AMQP 1.0 connection");
    let mut session = Session::begin(&mut connection).await.expect("session");
    let mut sender = Sender::attach(&mut session, "producer", format!("/amq/queue/{queue}"))
        .await
        .expect("sender");
    let outcome = sender.send(message).await.expect("send");
    assert!(outcome.is_accepted(), "{outcome:?}");
    // The message is settled; how the link and connection go away is not under test.
    let _ = sender.detach().await;
    let _ = session.end().await;
    let _ = connection.close().await;
}

/// Runs an AMQP 1.0 consumer of `queue` with `handler` until its one delivery ends, which
/// must be with `expected`, or 20 s pass; returns its report.
async fn run_until<H: Handler>(
    queue: &str,
    policy: &RetryPolicy,
    handler: H,
    expected: Terminal,
) -> RunReport {
    let done = Arc::new(Notify::new());
    let consumer = Consumer::builder(transport().await, queue, policy.clone(), handler)
        .with_on_terminal({
            let done = Arc::clone(&done);
            move |_, terminal| {
                assert_eq!(*terminal, expected);
                done.notify_one();
            }
        })
        .build()
        .expect("consumer");
    let shutdown = async move {
        let _ = tokio::time::timeout(Duration::from_secs(20), done.notified()).await;
    };
    consumer.run(shutdown).await.expect("run")
}

#[tokio::test]
async fn a_message_parked_over_amqp10_reads_back_over_amqp091_with_the_engine_record() {
    let Some(b) = broker().await else { return };
    let q = unique("park091");
    let policy = RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let parking = plan.parking_queue().to_owned();

    let message = AmqpMessage::builder()
        .properties(Properties {
            message_id: Some(MessageId::String("order-17".into())),
            ..Properties::default()
        })
        .application_properties(
            ApplicationProperties::builder()
                .insert("tenant", "acme")
                .build(),
        )
        .body(Body::<Value>::Data(
            vec![Data(Binary::from(b"order 17".to_vec()))].into(),
        ))
        .build();
    publish10(&q, message).await;

    let report = run_until(
        &q,
        &policy,
        |_msg: Message| async { Err::<(), _>(HandlerError::permanent("order 17 is unreadable")) },
        Terminal::DeadLettered {
            reason: DeadLetterReason::Permanent,
        },
    )
    .await;
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(
        b.wait_ready(&parking, 1, Duration::from_secs(5)).await,
        1,
        "parked"
    );

    // Over AMQP 0-9-1: the parked message lists with the engine's record.
    let reader = Arc::new(
        AmqpTransport::connect(AmqpConfig::new(amqp_url()))
            .await
            .expect("AMQP 0-9-1 connect"),
    );
    let lot = ParkingLot::new(Arc::clone(&reader), &plan);
    let mut seen = Vec::new();
    lot.browse(&ParkedFilter::all(), |parked| {
        seen.push(parked);
        ControlFlow::Continue(())
    })
    .await
    .expect("browse");
    assert_eq!(seen.len(), 1, "{seen:?}");
    let msg = seen[0].message();
    let headers = msg.headers();
    assert_eq!(
        headers.get("x-amqp-1.0-app-properties"),
        None,
        "decoded into headers: {headers:?}"
    );
    let record = ParkedRecord::decode(headers);
    assert_eq!(
        record.reason,
        Some(DeadLetterReason::Permanent),
        "{headers:?}"
    );
    assert_eq!(record.attempts, 1);
    assert_eq!(record.origin_queue, Some(q.as_str()));
    assert_eq!(record.last_error, Some("order 17 is unreadable"));
    assert!(record.first_failure.is_some() && record.last_failure.is_some());
    assert!(record.malformed.is_empty(), "{:?}", record.malformed);
    assert_eq!(headers.get("tenant"), Some(&HeaderValue::from("acme")));
    assert_eq!(msg.properties().message_id.as_deref(), Some("order-17"));
    assert_eq!(msg.body(), b"order 17");
    assert_eq!(msg.queue(), parking);

    // Replayed over AMQP 0-9-1, the copy reaches the AMQP 1.0 consumer with reset counters,
    // its history and the producer's own application property; it is handled at once.
    let replayed = lot
        .replay(&ParkedFilter::all(), ReplayOptions::default(), |_| {})
        .await
        .expect("replay");
    assert_eq!(replayed.replayed, 1, "{replayed:?}");
    reader.close().await.expect("close");
    let seen_headers = Arc::new(std::sync::Mutex::new(None));
    let handler = {
        let seen_headers = Arc::clone(&seen_headers);
        move |msg: Message| {
            *seen_headers.lock().unwrap() = Some(msg.headers().clone());
            async { Ok::<(), HandlerError>(()) }
        }
    };
    let report = run_until(&q, &policy, handler, Terminal::Handled { attempt: 1 }).await;
    assert_eq!(report.handled, 1, "{report:?}");
    let handled = seen_headers.lock().unwrap().take().expect("handled");
    assert_eq!(
        handled.get("tenant"),
        Some(&HeaderValue::from("acme")),
        "{handled:?}"
    );
    assert_eq!(
        handled.get("x-retry-replays"),
        Some(&HeaderValue::Int(1)),
        "{handled:?}"
    );
    assert_eq!(
        handled.get("x-retry-previous-reason"),
        Some(&HeaderValue::from("permanent")),
        "{handled:?}"
    );
    for reset in [
        "x-retry-reason",
        "x-retry-last-error",
        "x-retry-last-failure",
    ] {
        assert_eq!(handled.get(reset), None, "{reset} kept: {handled:?}");
    }
    assert_eq!(b.ready(&parking).await, 0);
}
