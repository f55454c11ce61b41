//! A message parked by the AMQP 1.0 consumer, read from the parking queue over AMQP 0-9-1.
//!
//! RabbitMQ 3.x hands an AMQP 0-9-1 reader the application properties of a message published
//! over AMQP 1.0 only as one opaque header, `x-amqp-1.0-app-properties`, holding the
//! section's AMQP 1.0 encoding. The engine's record on a parked message lives there, so the
//! AMQP 0-9-1 transport decodes it into headers.

mod common;

use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Body, Data, Message as AmqpMessage, MessageId, Properties,
};
use fe2o3_amqp::types::primitives::{Binary, Value};
use fe2o3_amqp::{Connection, Sender, Session};
use retry_core::{
    Consumer, DeadLetterReason, HandlerError, HeaderValue, Message, ParkedRecord, RetryPolicy,
    Settlement, Terminal, TopologyPlan, Transport,
};
use tokio::sync::Notify;
use transport_amqp091::{AmqpConfig, AmqpTransport};

use common::{broker, transport, unique, url10, url091};

/// Publishes one message to `queue` over AMQP 1.0, as a producer on that protocol does.
async fn publish10(queue: &str, message: AmqpMessage<Body<Value>>) {
    let mut connection = Connection::open("parking-test", url10().as_str())
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

    let done = Arc::new(Notify::new());
    let consumer = Consumer::builder(
        transport().await,
        q.as_str(),
        policy,
        |_msg: Message| async { Err::<(), _>(HandlerError::permanent("order 17 is unreadable")) },
    )
    .with_on_terminal({
        let done = Arc::clone(&done);
        move |_, terminal| {
            assert_eq!(
                *terminal,
                Terminal::DeadLettered {
                    reason: DeadLetterReason::Permanent
                }
            );
            done.notify_one();
        }
    })
    .build()
    .expect("consumer");
    let shutdown = async move {
        let _ = tokio::time::timeout(Duration::from_secs(20), done.notified()).await;
    };
    let report = consumer.run(shutdown).await.expect("run");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(
        b.wait_ready(&parking, 1, Duration::from_secs(5)).await,
        1,
        "parked"
    );

    let reader = AmqpTransport::connect(AmqpConfig::new(url091()))
        .await
        .expect("AMQP 0-9-1 connect");
    let parked = reader
        .fetch(&parking)
        .await
        .expect("fetch")
        .expect("a parked message");
    reader
        .settle(&parked.tag, Settlement::Ack)
        .await
        .expect("ack");
    reader.close().await.expect("close");

    let msg = &parked.message;
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
}
