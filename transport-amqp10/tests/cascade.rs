//! A delay cascade over RabbitMQ 3.x's AMQP 1.0 plugin: refused before anything is sent.
//!
//! The plugin can neither declare nor inspect bindings, and a send to an exchange with no
//! matching binding is accepted and dropped: a cascade with one exchange-to-exchange binding
//! missing would lose retries without a word. So the transport refuses a plan with a cascade,
//! and a consumer with one never starts, even when the whole cascade exists.
//!
//! The topology is declared over AMQP 0-9-1 under unique names, with a cascade prefix of its
//! own, and deleted afterwards.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::BasicProperties;
use retry_core::headers::EngineHeaders;
use retry_core::{
    Cascade, CascadePlan, Consumer, ConsumerError, DelayStrategy, HandlerError, Message,
    MessageParts, Publish, PublishResult, RetryPolicy, Terminal, TopologyPlan, Transport,
    TransportError,
};

use common::{Broker, broker, transport, unique};

async fn always_fails(_msg: Message) -> Result<(), HandlerError> {
    Err(HandlerError::transient("downstream unavailable"))
}

/// The transport error a consumer stopped with, and whether it was provisioning.
fn setup_error(err: &ConsumerError) -> (&TransportError, bool) {
    match err {
        ConsumerError::Provision { source, .. } => (source, true),
        ConsumerError::Verify { source, .. } => (source, false),
        other => panic!("the consumer failed otherwise: {other:?}"),
    }
}

/// Checks that `err` is the refusal of `cascade` on RabbitMQ, saying why and what instead.
fn assert_refused(err: &TransportError, cascade: &CascadePlan) {
    let TransportError::Unsupported { what, why } = err else {
        panic!("expected Unsupported, got {err:?}")
    };
    assert!(what.contains(cascade.entry_exchange()), "{what}");
    for says in [
        "can neither declare nor inspect bindings",
        "without a word",
        "DelayStrategy::PerDelayQueue",
        "transport-amqp091",
    ] {
        assert!(why.contains(says), "{says:?} missing from {why}");
    }
}

/// Messages ready in every queue of `plan` and its cascade but the work queue: (queue, count).
async fn ready_elsewhere(b: &Broker, plan: &TopologyPlan) -> Vec<(String, u32)> {
    let cascade = plan.cascade().expect("cascade");
    let mut counts = Vec::new();
    let queues = plan.queues().iter().skip(1).chain(cascade.queues());
    for queue in queues {
        counts.push((queue.name.clone(), b.ready(&queue.name).await));
    }
    counts
}

#[tokio::test]
async fn a_cascade_plan_is_refused_on_rabbitmq_and_nothing_is_sent() {
    let Some(b) = broker().await else { return };
    let q = unique("cascade");
    let settings = Cascade::new().with_prefix(format!("t10.{}", unique("casc")));
    let policy = RetryPolicy::delays([Duration::from_millis(200)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::builder(&q, &policy)
        .with_strategy(DelayStrategy::Cascade(settings.clone()))
        .build()
        .expect("plan");
    let cascade = plan.cascade().expect("cascade").clone();
    // Everything exists, declared over AMQP 0-9-1: the cascade, its bindings, the plan.
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let bodies: Vec<String> = (0..3).map(|i| format!("m{i}")).collect();
    for body in &bodies {
        b.publish(&q, body.as_bytes(), BasicProperties::default())
            .await;
    }

    let t = transport().await;
    assert_refused(&t.verify(&plan).await.expect_err("verify"), &cascade);
    assert_refused(
        &Transport::provision(&t, &plan)
            .await
            .expect_err("provision"),
        &cascade,
    );
    // No route of the refused plan was learned: a clone on its cascade route is not sent.
    let original = Message::new(MessageParts {
        queue: q.clone(),
        routing_key: q.clone(),
        body: b"direct".to_vec(),
        ..MessageParts::default()
    });
    let (route, _) = plan.route_for(Duration::from_millis(200)).expect("route");
    let publish = Publish {
        route,
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: None,
            last_failure: None,
            last_error: Some("boom".into()),
            reason: None,
            delay: Some(Duration::from_millis(200)),
            suspect: None,
        },
    };
    let result = t.publish(&original, &publish).await;
    assert!(
        matches!(
            &result,
            PublishResult::Failed(TransportError::MissingAddress { .. })
        ),
        "{result:?}"
    );
    t.close().await;

    // A consumer with the cascade never starts, provisioning or not.
    for provision in [true, false] {
        let seen = Arc::new(Mutex::new(Vec::<Terminal>::new()));
        let transport = Arc::new(transport().await);
        let strategy = DelayStrategy::Cascade(settings.clone());
        let consumer = Consumer::builder(
            Arc::clone(&transport),
            q.as_str(),
            policy.clone(),
            always_fails,
        )
        .with_prefetch(10)
        .with_provision(provision)
        .with_topology(move |builder| builder.with_strategy(strategy))
        .with_on_terminal({
            let seen = Arc::clone(&seen);
            move |_, terminal| seen.lock().expect("seen").push(*terminal)
        })
        .build()
        .expect("consumer");
        // Were it to start, it would take the messages and send their clones within this.
        let shutdown = tokio::time::sleep(Duration::from_secs(3));
        let outcome = tokio::time::timeout(Duration::from_secs(15), consumer.run(shutdown))
            .await
            .expect("the consumer stops");
        transport.close().await;
        let err = outcome.expect_err("a consumer with a cascade must not start");
        let (source, provisioning) = setup_error(&err);
        assert_eq!(provisioning, provision, "{err:?}");
        assert_refused(source, &cascade);
        let seen = seen.lock().expect("seen").clone();
        assert!(seen.is_empty(), "the consumer handled messages: {seen:?}");
    }

    // Nothing was taken from the work queue and nothing reached any other queue: not the
    // isolation or parking queue, not a cascade level.
    assert_eq!(b.wait_ready(&q, 3, Duration::from_secs(2)).await, 3);
    let elsewhere = ready_elsewhere(&b, &plan).await;
    assert!(elsewhere.iter().all(|(_, n)| *n == 0), "{elsewhere:?}");
    let mut left = Vec::new();
    while let Some((body, redelivered)) = b.get(&q).await {
        assert!(!redelivered, "a message was delivered and given back");
        left.push(String::from_utf8_lossy(&body).into_owned());
    }
    assert_eq!(left, bodies);
}
