//! Messages that cannot be decoded as AMQP 1.0, on the local RabbitMQ 3.x through its AMQP
//! 1.0 plugin: each must leave the work (or isolation) queue once, for the parking queue,
//! while the consumer goes on with the messages around it; and the process must not abort.
//!
//! RabbitMQ hands an AMQP 0-9-1 message of type `amqp-1.0` to AMQP 1.0 consumers with its
//! body as the message's sections, byte for byte, so any bytes at all can reach the
//! transport that way (as can the `x-amqp-1.0-*` headers, which it copies into sections).

mod common;

use std::collections::BTreeSet;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use retry_core::{
    Consumer, HandlerError, Message, ParkedFilter, ParkingLot, ReplayOptions, RetryPolicy,
    RunReport, TopologyPlan,
};
use transport_amqp10::UNDECODABLE_HEADER;

use common::{Broker, broker, transport, unique};

/// An `amqp-value` body section holding lists nested `depth` deep: far past anything a
/// decoder that recurses once per level survives on a thread's stack.
fn nested_value_section(depth: usize) -> Vec<u8> {
    let mut section = vec![0x00, 0x53, 0x77]; // amqp-value
    for level in 0..depth {
        // list32 with one element: its count, the levels inside it, then the empty list.
        let size = u32::try_from(4 + 9 * (depth - level - 1) + 1).expect("fits");
        section.push(0xd0);
        section.extend_from_slice(&size.to_be_bytes());
        section.extend_from_slice(&1u32.to_be_bytes());
    }
    section.push(0x45); // list0
    section
}

/// Bytes that are no AMQP encoding at all: a `data` section whose binary claims 4 GiB.
fn not_amqp() -> Vec<u8> {
    let mut bytes = vec![0x00, 0x53, 0x75, 0xb0, 0xff, 0xff, 0xff, 0xff];
    bytes.extend_from_slice(b"not an AMQP 1.0 message");
    bytes
}

/// Properties that make RabbitMQ hand the body to AMQP 1.0 consumers as the sections.
fn raw_sections() -> BasicProperties {
    BasicProperties::default().with_type("amqp-1.0".into())
}

fn policy() -> RetryPolicy {
    RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy")
}

/// Runs a consumer of `plan`'s work queue whose handler records each body and succeeds,
/// until it has handled every one of `healthy` and `parked` messages are in the parking
/// queue, or 30 s pass. Returns its report and the bodies it handled.
async fn run_until(
    b: &Broker,
    plan: &TopologyPlan,
    healthy: &[&[u8]],
    parked: u32,
) -> (RunReport, Vec<Vec<u8>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let seen = Arc::clone(&seen);
        move |msg: Message| {
            seen.lock().expect("seen").push(msg.body().to_vec());
            async { Ok::<(), HandlerError>(()) }
        }
    };
    let consumer = Consumer::builder(transport().await, plan.work_queue(), policy(), handler)
        .with_prefetch(5)
        .with_suspect_poll(Duration::from_millis(100))
        .build()
        .expect("consumer");
    let wanted: BTreeSet<Vec<u8>> = healthy.iter().map(|h| h.to_vec()).collect();
    let done = {
        let seen = Arc::clone(&seen);
        let parking = plan.parking_queue().to_owned();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                let handled: BTreeSet<Vec<u8>> =
                    seen.lock().expect("seen").iter().cloned().collect();
                if handled.is_superset(&wanted) && b.ready(&parking).await >= parked {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let report = consumer.run(done).await.expect("run");
    let handled = std::mem::take(&mut *seen.lock().expect("seen"));
    (report, handled)
}

/// Asserts that the parking queue holds exactly `expected` (read over AMQP 0-9-1, which
/// shows the body as published) and that the work and isolation queues are empty.
async fn assert_parked(b: &Broker, plan: &TopologyPlan, expected: &[u8]) {
    assert_eq!(b.ready(plan.work_queue()).await, 0, "work queue");
    assert_eq!(b.ready(plan.isolation_queue()).await, 0, "isolation queue");
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 1, Duration::from_secs(3))
            .await,
        1,
        "parking queue"
    );
    let (body, _) = b
        .get(plan.parking_queue())
        .await
        .expect("the parked message");
    assert_eq!(body, expected, "parked byte for byte");
}

#[tokio::test]
async fn a_value_nested_thousands_deep_is_parked_and_the_consumer_goes_on() {
    let Some(b) = broker().await else { return };
    let q = unique("malformed-deep");
    let plan = TopologyPlan::new(&q, &policy()).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let deep = nested_value_section(20_000);
    b.publish(&q, b"before", BasicProperties::default()).await;
    b.publish(&q, &deep, raw_sections()).await;
    b.publish(&q, b"after", BasicProperties::default()).await;

    let (report, handled) = run_until(&b, &plan, &[b"before", b"after"], 1).await;

    assert_eq!(
        handled,
        [b"before".to_vec(), b"after".to_vec()],
        "{report:?}"
    );
    assert_eq!(
        report.received, 2,
        "the deep one never reached the engine: {report:?}"
    );
    assert_eq!(report.receive_errors, 0, "{report:?}");
    assert_parked(&b, &plan, &deep).await;
}

#[tokio::test]
async fn a_message_that_is_not_amqp_encoding_is_parked_and_the_consumer_goes_on() {
    let Some(b) = broker().await else { return };
    let q = unique("malformed-bytes");
    let plan = TopologyPlan::new(&q, &policy()).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"before", BasicProperties::default()).await;
    b.publish(&q, &not_amqp(), raw_sections()).await;
    b.publish(&q, b"after", BasicProperties::default()).await;

    let (report, handled) = run_until(&b, &plan, &[b"before", b"after"], 1).await;

    assert_eq!(
        handled,
        [b"before".to_vec(), b"after".to_vec()],
        "{report:?}"
    );
    assert_eq!(report.received, 2, "{report:?}");
    assert_eq!(report.receive_errors, 0, "{report:?}");
    assert_parked(&b, &plan, &not_amqp()).await;
}

#[tokio::test]
async fn undecodable_suspects_are_parked_from_the_isolation_queue() {
    let Some(b) = broker().await else { return };
    let q = unique("malformed-suspect");
    let plan = TopologyPlan::new(&q, &policy()).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let suspects = plan.isolation_queue();
    let deep = nested_value_section(20_000);
    b.publish(suspects, &deep, raw_sections()).await;
    b.publish(suspects, b"suspect", BasicProperties::default())
        .await;
    b.publish(suspects, &not_amqp(), raw_sections()).await;

    let (report, handled) = run_until(&b, &plan, &[b"suspect"], 2).await;

    assert_eq!(handled, [b"suspect".to_vec()], "{report:?}");
    assert_eq!(report.suspects, 1, "{report:?}");
    assert_eq!(report.receive_errors, 0, "{report:?}");
    assert_eq!(b.ready(plan.work_queue()).await, 0, "work queue");
    assert_eq!(b.ready(suspects).await, 0, "isolation queue");
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 2, Duration::from_secs(3))
            .await,
        2
    );
    let mut parked = Vec::new();
    while let Some((body, _)) = b.get(plan.parking_queue()).await {
        parked.push(body);
    }
    parked.sort();
    let mut expected = vec![deep, not_amqp()];
    expected.sort();
    assert_eq!(parked, expected);
}

/// The parking lot reads its queue over AMQP 1.0 with a walk: an undecodable message there
/// has nowhere to be rejected to, so the walk shows it, marked, and leaves it where it is.
/// No copy of it can be replayed; it can be purged.
#[tokio::test]
async fn a_walk_of_the_parking_queue_shows_undecodable_messages_and_leaves_them() {
    let Some(b) = broker().await else { return };
    let q = unique("malformed-walk");
    let plan = TopologyPlan::new(&q, &policy()).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let parking = plan.parking_queue();
    let deep = nested_value_section(20_000);
    b.publish(parking, b"parked", BasicProperties::default())
        .await;
    b.publish(parking, &deep, raw_sections()).await;
    b.publish(parking, &not_amqp(), raw_sections()).await;

    let lot = ParkingLot::new(transport().await, &plan);
    let mut listed = Vec::new();
    let report = lot
        .browse(&ParkedFilter::all(), |parked| {
            listed.push(parked.message().clone());
            ControlFlow::Continue(())
        })
        .await
        .expect("browse");
    assert_eq!(listed.len(), 3, "{report:?}");
    assert_eq!(listed[0].body(), b"parked");
    assert!(listed[0].headers().get(UNDECODABLE_HEADER).is_none());
    for (undecodable, sent, why) in [
        (&listed[1], &deep, "nested deeper than"),
        (&listed[2], &not_amqp(), "ends early"),
    ] {
        let said = undecodable
            .headers()
            .get(UNDECODABLE_HEADER)
            .and_then(|v| v.as_str())
            .unwrap_or_else(|| panic!("says why: {:?}", undecodable.headers()));
        assert!(said.contains(why), "{said}");
        // Its sections as RabbitMQ sent them: a header section, then the bytes published.
        assert!(
            undecodable.body().ends_with(sent),
            "the sections as they came"
        );
    }
    assert_eq!(
        b.wait_ready(parking, 3, Duration::from_secs(3)).await,
        3,
        "all left in place"
    );

    // The healthy one is replayed; no copy of an undecodable one can be made, so each
    // stays parked and the replay goes on past it.
    let report = lot
        .replay(&ParkedFilter::all(), ReplayOptions::default(), |_| {})
        .await
        .expect("a replay that passes over what it cannot copy");
    assert_eq!(
        (report.replayed, report.uncopyable, report.left),
        (1, 2, 2),
        "{report:?}"
    );
    assert_eq!(
        b.wait_ready(&q, 1, Duration::from_secs(3)).await,
        1,
        "replayed"
    );
    assert_eq!(b.wait_ready(parking, 2, Duration::from_secs(3)).await, 2);

    let purged = lot
        .purge(&ParkedFilter::all(), |_| {})
        .await
        .expect("purge");
    lot.transport().close().await;
    assert_eq!(
        b.wait_ready(parking, 0, Duration::from_secs(3)).await,
        0,
        "{purged:?}"
    );
}
