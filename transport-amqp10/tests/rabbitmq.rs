//! The transport against the local RabbitMQ 3.x through its AMQP 1.0 plugin. The topology of
//! each test is declared over AMQP 0-9-1 under unique names and deleted afterwards.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use retry_core::headers::{ATTEMPTS, DELAY, EngineHeaders};
use retry_core::{
    Confirm, DeadLetterReason, Engine, HeaderValue, Lane, Outcome, ParkedRecord, Publish,
    PublishResult, RetryPolicy, Route, Settlement, Subscription, Terminal, TopologyPlan, Transport,
    TransportError,
};
use transport_amqp10::{Amqp10Subscription, Amqp10Transport};

use common::{broker, drive, transport, unique};

fn plan(queue: &str, delays: &[u64]) -> (RetryPolicy, TopologyPlan) {
    let policy = RetryPolicy::delays(delays.iter().map(|ms| Duration::from_millis(*ms)))
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(queue, &policy).expect("plan");
    (policy, plan)
}

/// Takes one message from `queue` over AMQP 1.0 with a transport of its own.
async fn take(queue: &str, within: Duration) -> Option<retry_core::Message> {
    let reader = transport().await;
    let sub = reader.consume(queue, 1).await.expect("consume");
    let got = match tokio::time::timeout(within, sub.recv()).await {
        Ok(Ok(Some(d))) => {
            reader.settle(&d.tag, Settlement::Ack).await.expect("ack");
            Some(d.message)
        }
        _ => None,
    };
    reader.close().await;
    got
}

#[tokio::test]
async fn a_successful_message_is_accepted_once() {
    let Some(b) = broker().await else { return };
    let q = unique("ok");
    let (policy, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"hello", BasicProperties::default()).await;

    let t = transport().await;
    t.provision(&plan).await.expect("topology verified");
    let sub = t.consume(&q, 4).await.expect("consume");
    let mut engine = Engine::new(policy, &plan).expect("engine");
    let ended = drive(
        &t,
        &sub,
        &mut engine,
        &|_| Outcome::Success,
        1,
        Duration::from_secs(10),
    )
    .await;
    t.close().await;

    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].0, Terminal::Handled { attempt: 1 });
    assert_eq!(ended[0].1.body(), b"hello");
    assert_eq!(b.wait_ready(&q, 0, Duration::from_secs(2)).await, 0);
    assert_eq!(b.ready(plan.parking_queue()).await, 0);
}

#[tokio::test]
async fn a_transient_failure_comes_back_after_the_ttl_and_succeeds() {
    let Some(b) = broker().await else { return };
    let q = unique("transient");
    let (policy, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"flaky", BasicProperties::default()).await;

    let t = transport().await;
    t.provision(&plan).await.expect("verified");
    let sub = t.consume(&q, 4).await.expect("consume");
    let mut engine = Engine::new(policy, &plan).expect("engine");
    let failed_at = std::sync::Mutex::new(None::<Instant>);
    let seen_at = std::sync::Mutex::new(None::<Instant>);
    let handler = |msg: &retry_core::Message| {
        if msg.headers().get(ATTEMPTS).is_none() {
            *failed_at.lock().unwrap() = Some(Instant::now());
            Outcome::Transient("downstream timeout".into())
        } else {
            *seen_at.lock().unwrap() = Some(Instant::now());
            Outcome::Success
        }
    };
    let ended = drive(&t, &sub, &mut engine, &handler, 2, Duration::from_secs(15)).await;
    t.close().await;

    assert_eq!(ended.len(), 2, "{ended:?}");
    assert!(
        matches!(ended[0].0, Terminal::Retried { attempts: 1, .. }),
        "{ended:?}"
    );
    assert_eq!(ended[1].0, Terminal::Handled { attempt: 2 });
    let back = &ended[1].1;
    assert_eq!(back.body(), b"flaky");
    assert_eq!(back.headers().get(ATTEMPTS), Some(&HeaderValue::Int(1)));
    assert_eq!(back.headers().get(DELAY), Some(&HeaderValue::Int(1_000)));
    let waited = seen_at.lock().unwrap().unwrap() - failed_at.lock().unwrap().unwrap();
    assert!(
        waited >= Duration::from_millis(950),
        "came back after {waited:?}, before the 1 s TTL"
    );
    assert_eq!(b.ready(plan.parking_queue()).await, 0);
}

#[tokio::test]
async fn used_up_attempts_park_the_message_with_its_diagnostics() {
    let Some(b) = broker().await else { return };
    let q = unique("exhausted");
    let (policy, plan) = plan(&q, &[200, 400]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(
        &q,
        b"poison",
        BasicProperties::default().with_message_id("m-1".into()),
    )
    .await;

    let t = transport().await;
    t.provision(&plan).await.expect("verified");
    let sub = t.consume(&q, 4).await.expect("consume");
    let mut engine = Engine::new(policy.clone(), &plan).expect("engine");
    let ended = drive(
        &t,
        &sub,
        &mut engine,
        &|_| Outcome::Transient("still broken".into()),
        3,
        Duration::from_secs(15),
    )
    .await;
    t.close().await;

    let kinds: Vec<_> = ended.iter().map(|(t, _)| *t).collect();
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    assert!(matches!(kinds[0], Terminal::Retried { attempts: 1, .. }));
    assert!(matches!(kinds[1], Terminal::Retried { attempts: 2, .. }));
    assert_eq!(
        kinds[2],
        Terminal::DeadLettered {
            reason: DeadLetterReason::AttemptsExhausted
        }
    );
    assert_eq!(policy.max_attempts(), 3);

    let parked = take(plan.parking_queue(), Duration::from_secs(5))
        .await
        .expect("parked message");
    assert_eq!(parked.body(), b"poison");
    assert_eq!(parked.properties().message_id.as_deref(), Some("m-1"));
    let record = ParkedRecord::decode(parked.headers());
    assert_eq!(record.reason, Some(DeadLetterReason::AttemptsExhausted));
    assert_eq!(record.attempts, 3);
    assert_eq!(record.last_error, Some("still broken"));
    assert_eq!(record.origin_queue, Some(q.as_str()));
    assert!(record.first_failure.is_some() && record.last_failure >= record.first_failure);
    assert!(record.malformed.is_empty(), "{:?}", record.malformed);
    assert_eq!(b.ready(&q).await, 0);
}

#[tokio::test]
async fn a_permanent_failure_is_parked_at_once() {
    let Some(b) = broker().await else { return };
    let q = unique("permanent");
    let (policy, plan) = plan(&q, &[60_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"bad input", BasicProperties::default())
        .await;

    let t = transport().await;
    t.provision(&plan).await.expect("verified");
    let sub = t.consume(&q, 4).await.expect("consume");
    let mut engine = Engine::new(policy, &plan).expect("engine");
    let ended = drive(
        &t,
        &sub,
        &mut engine,
        &|_| Outcome::Permanent("schema violation".into()),
        1,
        Duration::from_secs(10),
    )
    .await;
    t.close().await;

    assert_eq!(
        ended[0].0,
        Terminal::DeadLettered {
            reason: DeadLetterReason::Permanent
        }
    );
    let delay_queue = &plan.queues()[1].name;
    assert_eq!(b.ready(delay_queue).await, 0, "no detour through a delay");
    let parked = take(plan.parking_queue(), Duration::from_secs(5))
        .await
        .expect("parked");
    let record = ParkedRecord::decode(parked.headers());
    assert_eq!(record.reason, Some(DeadLetterReason::Permanent));
    assert_eq!(record.last_error, Some("schema violation"));
}

#[tokio::test]
async fn a_released_delivery_comes_back_redelivered_and_is_isolated() {
    let Some(b) = broker().await else { return };
    let q = unique("released");
    let (policy, plan) = plan(&q, &[60_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"crashy", BasicProperties::default()).await;

    let t = transport().await;
    t.provision(&plan).await.expect("verified");
    let sub = t.consume(&q, 1).await.expect("consume");
    let first = sub.recv().await.expect("recv").expect("delivery");
    assert!(!first.facts.redelivered);
    t.settle(&first.tag, Settlement::Requeue)
        .await
        .expect("release");
    let again = sub.recv().await.expect("recv").expect("delivery");
    assert!(again.facts.redelivered, "released ⇒ first-acquirer false");
    assert_eq!(again.facts.delivery_count, 0, "RabbitMQ 3.x keeps no count");

    let mut engine = Engine::new(policy, &plan).expect("engine");
    let id = engine.handle_delivery(t.now(), Lane::Work, again.facts, ());
    let Some(retry_core::Action::Publish { publish, .. }) = engine.poll_action() else {
        panic!("a redelivered message is isolated without running the handler")
    };
    assert_eq!(&publish.route, plan.isolation_route());
    let result = t.publish(&again.message, &publish).await;
    assert!(matches!(result, PublishResult::Confirmed), "{result:?}");
    engine
        .handle_confirm(t.now(), id, Confirm::Ack)
        .expect("confirm");
    let Some(retry_core::Action::Settle {
        settlement,
        terminal,
        ..
    }) = engine.poll_action()
    else {
        panic!("settle expected")
    };
    assert_eq!(terminal, Terminal::Isolated);
    t.settle(&again.tag, settlement).await.expect("ack");
    t.close().await;
    assert_eq!(
        b.wait_ready(plan.isolation_queue(), 1, Duration::from_secs(3))
            .await,
        1
    );
    assert_eq!(b.ready(&q).await, 0);
    assert_eq!(b.ready(&plan.queues()[1].name).await, 0, "no delay");

    // The suspect in the isolation queue is a fresh clone: no crash so far.
    let reader = transport().await;
    let suspect = reader
        .fetch(plan.isolation_queue())
        .await
        .expect("fetch")
        .expect("the suspect");
    assert_eq!(suspect.message.body(), b"crashy");
    assert!(!suspect.facts.redelivered);
    assert_eq!(suspect.facts.crashes, 0);
    reader
        .settle(&suspect.tag, Settlement::Ack)
        .await
        .expect("ack");
    reader.close().await;
}

#[tokio::test]
async fn a_delivery_held_by_a_dropped_connection_is_isolated_by_the_next_consumer() {
    let Some(b) = broker().await else { return };
    let q = unique("dropped");
    let (policy, plan) = plan(&q, &[60_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"kills its consumer", BasicProperties::default())
        .await;

    // The first consumer takes the message and goes away mid-handler.
    let crashed = transport().await;
    let crashed_sub = crashed.consume(&q, 1).await.expect("consume");
    let held = crashed_sub.recv().await.expect("recv").expect("delivery");
    assert!(!held.facts.redelivered);
    drop(held);
    crashed.close().await;

    let t = transport().await;
    t.provision(&plan).await.expect("verified");
    let sub = t.consume(&q, 1).await.expect("consume");
    let mut engine = Engine::new(policy, &plan).expect("engine");
    let ran = std::sync::atomic::AtomicBool::new(false);
    let handler = |_: &retry_core::Message| {
        ran.store(true, std::sync::atomic::Ordering::SeqCst);
        Outcome::Success
    };
    let ended = drive(&t, &sub, &mut engine, &handler, 1, Duration::from_secs(10)).await;
    t.close().await;
    assert_eq!(ended[0].0, Terminal::Isolated, "{ended:?}");
    assert!(
        !ran.load(std::sync::atomic::Ordering::SeqCst),
        "handler not run"
    );
    assert_eq!(
        b.wait_ready(plan.isolation_queue(), 1, Duration::from_secs(3))
            .await,
        1
    );
}

#[tokio::test]
async fn a_refused_clone_requeues_the_original_and_the_transport_recovers() {
    let Some(b) = broker().await else { return };
    let q = unique("refused");
    let (_, plan) = plan(&q, &[60_000]);
    // No publish retries: each refused send waits out the publish timeout.
    let policy = RetryPolicy::delays([Duration::from_secs(60)])
        .with_publish_retries(0, Duration::from_millis(100))
        .build()
        .expect("policy");
    let delay_queue = plan.queues()[1].name.clone();
    // The delay queue refuses everything: a full queue with reject-publish.
    let extra = test_brokers::rabbitmq::refusing(Default::default())
        .inner()
        .iter()
        .map(|(name, value)| (delay_queue.clone(), name.to_string(), value.clone()))
        .collect();
    let _cleanup = b.declare(&plan, &[], extra).await;
    b.publish(&q, b"must not be lost", BasicProperties::default())
        .await;

    let t = transport().await;
    t.provision(&plan).await.expect("verified");
    let sub = t.consume(&q, 1).await.expect("consume");
    let mut engine = Engine::new(policy, &plan).expect("engine");
    let ended = drive(
        &t,
        &sub,
        &mut engine,
        &|_| Outcome::Transient("try later".into()),
        1,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        ended[0].0,
        Terminal::Requeued {
            cause: Confirm::Failed
        },
        "{ended:?}"
    );

    // The consuming link survived and the original came back, redelivered.
    let back = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("redelivered in time")
        .expect("recv")
        .expect("delivery");
    assert_eq!(back.message.body(), b"must not be lost");
    assert!(back.facts.redelivered);

    // The publishing side reconnects: a clone to a healthy queue goes through.
    let to_parking = Publish {
        route: plan.parking_route().clone(),
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: Some(t.now()),
            last_failure: Some(t.now()),
            last_error: None,
            reason: Some(DeadLetterReason::Permanent),
            delay: None,
            suspect: None,
        },
    };
    let result = t.publish(&back.message, &to_parking).await;
    assert!(matches!(result, PublishResult::Confirmed), "{result:?}");
    t.settle(&back.tag, Settlement::Ack).await.expect("ack");
    t.close().await;
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 1, Duration::from_secs(3))
            .await,
        1
    );
    assert_eq!(b.ready(&q).await, 0);
}

#[tokio::test]
async fn a_body_published_over_091_keeps_every_byte_through_retries_over_10() {
    let Some(b) = broker().await else { return };
    let q = unique("bytes");
    let (policy, plan) = plan(&q, &[200]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let body: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    b.publish(
        &q,
        &body,
        BasicProperties::default().with_content_type("application/octet-stream".into()),
    )
    .await;

    let t = transport().await;
    t.provision(&plan).await.expect("verified");
    let sub = t.consume(&q, 2).await.expect("consume");
    let mut engine = Engine::new(policy, &plan).expect("engine");
    let ended = drive(
        &t,
        &sub,
        &mut engine,
        &|_| Outcome::Transient("no".into()),
        2,
        Duration::from_secs(15),
    )
    .await;
    t.close().await;
    assert_eq!(ended.len(), 2, "{ended:?}");
    for (_, msg) in &ended {
        assert_eq!(msg.body(), &body[..], "body changed on the way");
        assert_eq!(
            msg.properties().content_type.as_deref(),
            Some("application/octet-stream")
        );
    }
    // And the parked copy, read back over AMQP 0-9-1, is the same bytes.
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 1, Duration::from_secs(3))
            .await,
        1
    );
    let (parked, _) = b.get(plan.parking_queue()).await.expect("parked");
    assert_eq!(parked, body);
}

#[tokio::test]
async fn a_missing_delay_queue_is_reported_before_anything_is_consumed() {
    let Some(b) = broker().await else { return };
    let q = unique("missing");
    let (_, plan) = plan(&q, &[1_000, 5_000]);
    let missing = plan.queues()[2].name.clone();
    let _cleanup = b.declare(&plan, &[&missing], vec![]).await;
    b.publish(&q, b"waiting", BasicProperties::default()).await;

    let t = transport().await;
    let err = t.provision(&plan).await.expect_err("a queue is missing");
    let TransportError::MissingAddress { address, hint } = &err else {
        panic!("{err:?}")
    };
    assert!(address.contains(&missing), "{address}");
    assert!(
        !address.contains(&plan.queues()[1].name),
        "only the missing one: {address}"
    );
    assert!(hint.contains("0-9-1"), "says how to provision: {hint}");
    t.close().await;

    // Nothing was consumed: the message was never delivered to anyone.
    assert_eq!(b.ready(&q).await, 1);
    let (body, redelivered) = b.get(&q).await.expect("still there");
    assert_eq!(body, b"waiting");
    assert!(!redelivered);
}

#[tokio::test]
async fn a_send_to_an_unverified_missing_queue_fails_instead_of_vanishing() {
    let Some(b) = broker().await else { return };
    let q = unique("unverified");
    let (_, plan) = plan(&q, &[1_000]);
    let missing_delay = plan.queues()[1].name.clone();
    let _cleanup = b.declare(&plan, &[&missing_delay], vec![]).await;
    b.publish(&q, b"x", BasicProperties::default()).await;

    let t = transport().await;
    let sub = t.consume(&q, 1).await.expect("consume");
    let d = sub.recv().await.expect("recv").expect("delivery");
    // No plan was provisioned: the route's queue is found by its name, and checked first.
    let publish = Publish {
        route: Route {
            exchange: Arc::from(""),
            routing_key: Arc::from(missing_delay.as_str()),
        },
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: Some(t.now()),
            last_failure: Some(t.now()),
            last_error: None,
            reason: None,
            delay: Some(Duration::from_secs(1)),
            suspect: None,
        },
    };
    let result = t.publish(&d.message, &publish).await;
    let PublishResult::Failed(TransportError::MissingAddress { address, .. }) = &result else {
        panic!("{result:?}")
    };
    assert!(address.contains(&missing_delay));
    t.settle(&d.tag, Settlement::Requeue)
        .await
        .expect("release");
    t.close().await;
    assert_eq!(b.wait_ready(&q, 1, Duration::from_secs(3)).await, 1);
}

#[tokio::test]
async fn credit_never_exceeds_the_prefetch() {
    let Some(b) = broker().await else { return };
    let q = unique("credit");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    for i in 0..8u8 {
        b.publish(&q, &[i], BasicProperties::default()).await;
    }
    let t = transport().await;
    let sub = t.consume(&q, 3).await.expect("consume");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(sub.recv().await.expect("recv").expect("delivery"));
    }
    let fourth = tokio::time::timeout(Duration::from_millis(700), sub.recv()).await;
    assert!(fourth.is_err(), "a fourth delivery arrived with prefetch 3");
    for d in held.drain(..) {
        t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    }
    let mut rest = 0;
    while rest < 5 {
        let d = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("more deliveries after settling")
            .expect("recv")
            .expect("delivery");
        t.settle(&d.tag, Settlement::Ack).await.expect("ack");
        rest += 1;
    }
    let settled_twice = t
        .settle(&held_tag(&t, &sub, &q, &b).await, Settlement::Ack)
        .await;
    assert!(
        settled_twice.is_err(),
        "a settled delivery cannot be settled again"
    );
    t.close().await;
    assert_eq!(b.ready(&q).await, 0);
}

/// Publishes, receives and acks one more message, returning its (now settled) tag.
async fn held_tag(
    t: &Amqp10Transport,
    sub: &Amqp10Subscription,
    q: &str,
    b: &common::Broker,
) -> transport_amqp10::Amqp10Tag {
    b.publish(q, b"once", BasicProperties::default()).await;
    let d = sub.recv().await.expect("recv").expect("delivery");
    t.settle(&d.tag, Settlement::Ack).await.expect("first ack");
    d.tag
}

#[tokio::test]
/// A cancel stops the grants; what the broker sends on the credit it still has comes, then
/// nothing more. Released instead, it would come back marked redelivered and cost the next
/// consumer a solo run (the chaos test's graceful shutdown saw 2 of 1,000 come back).
async fn cancel_stops_deliveries_but_held_ones_can_still_be_settled() {
    let Some(b) = broker().await else { return };
    let q = unique("cancel");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    for i in 0..4u8 {
        b.publish(&q, &[i], BasicProperties::default()).await;
    }
    let t = transport().await;
    let sub = t.consume(&q, 2).await.expect("consume");
    let d = sub.recv().await.expect("recv").expect("delivery");
    sub.cancel().await.expect("cancel");
    let second = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("the credit's second transfer comes")
        .expect("recv")
        .expect("the second delivery, sent on the credit of 2");
    assert!(!second.facts.redelivered);
    assert!(
        sub.recv().await.expect("recv").is_none(),
        "no more after the credit's last"
    );
    for held in [&d, &second] {
        t.settle(&held.tag, Settlement::Ack)
            .await
            .expect("settle after cancel");
    }
    sub.flush().await.expect("flush on a live link");
    t.close().await;
    sub.flush().await.expect("nothing left to send after close");
    assert_eq!(b.wait_ready(&q, 2, Duration::from_secs(3)).await, 2);
}

#[tokio::test]
async fn reject_dead_letters_through_the_work_queues_exchange() {
    let Some(b) = broker().await else { return };
    let q = unique("reject");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"rejected", BasicProperties::default()).await;
    let t = transport().await;
    let sub = t.consume(&q, 1).await.expect("consume");
    let d = sub.recv().await.expect("recv").expect("delivery");
    t.settle(&d.tag, Settlement::Reject).await.expect("reject");
    t.close().await;
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 1, Duration::from_secs(3))
            .await,
        1
    );
}

#[tokio::test]
async fn a_wrong_password_fails_without_showing_it() {
    let Some(_b) = broker().await else { return };
    let url = common::amqp10_url().replace("guest:guest@", "guest:Wr0ngPassw0rd@");
    let err = Amqp10Transport::connect(transport_amqp10::Amqp10Config::new(url))
        .await
        .expect_err("refused");
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("Wr0ngPassw0rd"), "{shown}");
}

#[tokio::test]
async fn a_lost_consuming_link_is_reported_and_attached_again() {
    let Some(b) = broker().await else { return };
    let q = unique("relink");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let t = transport().await;
    let sub = t.consume(&q, 2).await.expect("consume");
    // A delivery first, so the broker has surely registered the consumer.
    b.publish(&q, b"before", BasicProperties::default()).await;
    let d = sub.recv().await.expect("recv").expect("delivery");
    t.settle(&d.tag, Settlement::Ack).await.expect("ack");

    // Deleting the queue under the consumer takes its link away.
    b.take_link_away(&q, &sub).await;
    let flushed = sub.flush().await;
    assert!(
        matches!(flushed, Err(TransportError::Connection { .. })),
        "a flush reports the lost link: {flushed:?}"
    );

    // While the queue is gone, attaching again says so.
    let missing = sub.recv().await;
    assert!(
        matches!(missing, Err(TransportError::MissingAddress { .. })),
        "{:?}",
        missing.map(|d| d.is_some())
    );

    // Once it is back, the next recv attaches a new link and delivers.
    let _again = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"after", BasicProperties::default()).await;
    let d = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("delivered in time")
        .expect("recv")
        .expect("delivery");
    assert_eq!(d.message.body(), b"after");
    assert_eq!(d.tag.generation(), 2, "the third link of this transport");
    t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    t.close().await;
}

#[tokio::test]
async fn two_subscriptions_of_one_transport_receive_and_settle_independently() {
    let Some(b) = broker().await else { return };
    let q = unique("two-subs");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"first", BasicProperties::default()).await;
    b.publish(&q, b"second", BasicProperties::default()).await;

    let t = transport().await;
    let one = t.consume(&q, 1).await.expect("consume");
    let two = t.consume(&q, 1).await.expect("consume again");
    // Each holds its own credit of 1: the two messages are split between them.
    let within = Duration::from_secs(5);
    let a = tokio::time::timeout(within, one.recv())
        .await
        .expect("the first subscription receives")
        .expect("recv")
        .expect("delivery");
    let b_delivery = tokio::time::timeout(within, two.recv())
        .await
        .expect("the second subscription receives")
        .expect("recv")
        .expect("delivery");
    assert_ne!(a.message.body(), b_delivery.message.body());
    // Both links number their deliveries from 0: a tag routed by id alone would settle both.
    assert_eq!(a.tag.delivery_id(), b_delivery.tag.delivery_id());

    t.settle(&a.tag, Settlement::Ack).await.expect("ack");
    // The first subscription's credit comes back; the second still holds its delivery.
    b.publish(&q, b"third", BasicProperties::default()).await;
    let c = tokio::time::timeout(within, one.recv())
        .await
        .expect("a new grant after the ack")
        .expect("recv")
        .expect("delivery");
    assert_eq!(c.message.body(), b"third");
    t.settle(&c.tag, Settlement::Ack).await.expect("ack");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), two.recv())
            .await
            .is_err(),
        "the second subscription got credit from the first one's acks"
    );
    one.cancel().await.expect("cancel");
    assert!(one.recv().await.expect("recv").is_none());
    t.close().await;
    assert!(
        two.recv().await.expect("recv after close").is_none(),
        "closed with its transport"
    );

    // Only the second subscription's delivery was left unsettled, and it came back.
    assert_eq!(b.wait_ready(&q, 1, Duration::from_secs(3)).await, 1);
    let (body, redelivered) = b.get(&q).await.expect("the unsettled one");
    assert_eq!(body, b_delivery.message.body());
    assert!(redelivered);
}

#[tokio::test]
async fn close_ends_a_subscription_dropped_without_cancelling() {
    let Some(b) = broker().await else { return };
    let q = unique("dropped-sub");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"held", BasicProperties::default()).await;

    let t = transport().await;
    let sub = t.consume(&q, 1).await.expect("consume");
    let d = sub.recv().await.expect("recv").expect("delivery");
    // The tag alone keeps the link's task alive; the transport still reaches it.
    drop(sub);
    t.close().await;
    assert_eq!(b.wait_ready(&q, 1, Duration::from_secs(3)).await, 1);
    let (body, redelivered) = b.get(&q).await.expect("back in the queue");
    assert_eq!(body, b"held");
    assert!(redelivered);
    assert!(
        t.settle(&d.tag, Settlement::Ack).await.is_err(),
        "its link is gone"
    );
}

#[tokio::test]
async fn fetch_takes_one_message_at_a_time_and_leaves_the_rest_ready() {
    let Some(b) = broker().await else { return };
    let q = unique("fetch");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    for body in [&b"m0"[..], b"m1", b"m2"] {
        b.publish(&q, body, BasicProperties::default()).await;
    }

    let t = transport().await;
    let first = t.fetch(&q).await.expect("fetch").expect("a message");
    assert_eq!(first.message.body(), b"m0");
    assert!(!first.facts.redelivered);
    // Held unsettled: exactly one left the queue.
    assert_eq!(b.ready(&q).await, 2);
    // A second fetch while the first is unsettled takes the next one (a parking-lot walk
    // holds every message it leaves).
    let second = t.fetch(&q).await.expect("fetch").expect("a second message");
    assert_eq!(second.message.body(), b"m1");
    assert_eq!(b.ready(&q).await, 1);
    t.settle(&first.tag, Settlement::Ack).await.expect("ack");
    assert!(
        t.settle(&first.tag, Settlement::Ack).await.is_err(),
        "settled once"
    );
    // Released, the second goes back to the head of the queue.
    t.settle(&second.tag, Settlement::Requeue)
        .await
        .expect("release");

    for (expected, left) in [(&b"m1"[..], 1), (b"m2", 0)] {
        let d = t.fetch(&q).await.expect("fetch").expect("a message");
        assert_eq!(d.message.body(), expected);
        assert_eq!(b.ready(&q).await, left);
        t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    }

    let asked = Instant::now();
    let empty = t.fetch(&q).await.expect("fetch");
    assert!(empty.is_none(), "{:?}", empty.map(|d| d.message));
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "an empty fetch waits only the fetch wait: {took:?}"
    );

    // After an empty answer the credit is back with this side: a new message stays ready
    // until the next fetch, which takes it.
    b.publish(&q, b"m3", BasicProperties::default()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(b.ready(&q).await, 1, "no credit was left outstanding");
    let d = t.fetch(&q).await.expect("fetch").expect("the new message");
    assert_eq!(d.message.body(), b"m3");
    assert!(!d.facts.redelivered);
    t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    t.close().await;
    assert_eq!(b.ready(&q).await, 0);
}

#[tokio::test]
async fn a_fetched_delivery_that_is_released_comes_back_redelivered() {
    let Some(b) = broker().await else { return };
    let q = unique("fetch-release");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"suspect", BasicProperties::default()).await;

    let t = transport().await;
    let d = t.fetch(&q).await.expect("fetch").expect("a message");
    assert!(!d.facts.redelivered);
    t.settle(&d.tag, Settlement::Requeue)
        .await
        .expect("release");
    let again = t
        .fetch(&q)
        .await
        .expect("fetch")
        .expect("back in the queue");
    assert_eq!(again.message.body(), b"suspect");
    assert!(again.facts.redelivered, "released ⇒ first-acquirer false");
    t.settle(&again.tag, Settlement::Ack).await.expect("ack");
    t.close().await;
    assert_eq!(b.ready(&q).await, 0);
}

#[tokio::test]
async fn a_fetched_delivery_left_unsettled_at_close_comes_back_redelivered() {
    let Some(b) = broker().await else { return };
    let q = unique("fetch-close");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"running alone", BasicProperties::default())
        .await;

    let crashed = transport().await;
    let d = crashed.fetch(&q).await.expect("fetch").expect("a message");
    assert!(!d.facts.redelivered);
    crashed.close().await;
    let late = crashed.settle(&d.tag, Settlement::Ack).await;
    assert!(
        matches!(late, Err(TransportError::Connection { .. })),
        "the link is gone: {late:?}"
    );
    assert!(matches!(
        crashed.fetch(&q).await,
        Err(TransportError::Closed)
    ));

    let t = transport().await;
    let again = tokio::time::timeout(Duration::from_secs(10), t.fetch(&q))
        .await
        .expect("in time")
        .expect("fetch")
        .expect("back in the queue");
    assert_eq!(again.message.body(), b"running alone");
    assert!(again.facts.redelivered, "its holder went away");
    t.settle(&again.tag, Settlement::Ack).await.expect("ack");
    t.close().await;
}

#[tokio::test]
async fn fetch_on_a_missing_queue_fails_naming_it() {
    let Some(b) = broker().await else { return };
    let q = unique("fetch-present");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"here", BasicProperties::default()).await;
    let missing = unique("fetch-missing");

    let t = transport().await;
    let err = t.fetch(&missing).await.expect_err("no such queue");
    let TransportError::MissingAddress { address, hint } = &err else {
        panic!("{err:?}")
    };
    assert!(address.contains(&missing), "{address}");
    assert!(hint.contains("0-9-1"), "says how to provision: {hint}");
    // Still missing on a second look, and other queues are unaffected.
    assert!(matches!(
        t.fetch(&missing).await,
        Err(TransportError::MissingAddress { .. })
    ));
    let d = t.fetch(&q).await.expect("fetch").expect("a message");
    t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    t.close().await;
}

#[tokio::test]
async fn ready_resolves_once_the_queue_has_a_message_and_takes_none() {
    let Some(b) = broker().await else { return };
    let q = unique("ready");
    let (_, plan) = plan(&q, &[1_000]);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let t = transport().await;
    let poll = Duration::from_millis(50);

    // Empty: it keeps looking, however many polls go by.
    let watch = tokio::time::timeout(Duration::from_millis(600), t.ready(&q, poll)).await;
    assert!(watch.is_err(), "resolved with the queue empty: {watch:?}");

    // A watch under way sees a message that arrives.
    let watch = tokio::spawn({
        let t = Arc::new(t);
        let q = q.clone();
        async move {
            let seen = tokio::time::timeout(Duration::from_secs(10), t.ready(&q, poll)).await;
            (t, seen)
        }
    });
    b.publish(&q, b"waiting", BasicProperties::default()).await;
    let (t, seen) = watch.await.expect("watch");
    seen.expect("resolves once a message is ready")
        .expect("ready");
    // At once, with one there.
    tokio::time::timeout(Duration::from_secs(10), t.ready(&q, poll))
        .await
        .expect("resolves at once")
        .expect("ready");
    assert_eq!(b.ready(&q).await, 1, "ready takes nothing");
    t.close().await;
}
