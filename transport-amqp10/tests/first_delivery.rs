//! What a consumer's start prepares ahead, against the local RabbitMQ 3.x: verifying a plan
//! (what `Consumer::run` does first) attaches the isolation queue's fetch link and opens a
//! consuming link on the work queue, both without taking a message, and a consumer still
//! runs the suspects a previous run left before its first work delivery.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::BasicProperties;
use retry_core::{
    Consumer, HandlerError, Message, RetryPolicy, Settlement, Subscription, TopologyPlan, Transport,
};

use common::{broker, transport, unique};

fn plan(queue: &str) -> (RetryPolicy, TopologyPlan) {
    let policy = RetryPolicy::delays([Duration::from_secs(60)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(queue, &policy).expect("plan");
    (policy, plan)
}

/// Publishes `work` to the plan's work queue and one message, `suspect`, to its isolation
/// queue.
async fn seed(b: &common::Broker, plan: &TopologyPlan, work: &[&[u8]]) {
    for body in work {
        b.publish(plan.work_queue(), body, BasicProperties::default())
            .await;
    }
    b.publish(
        plan.isolation_queue(),
        b"suspect",
        BasicProperties::default(),
    )
    .await;
}

#[tokio::test]
async fn verifying_takes_nothing_from_the_queues_it_prepares() {
    let Some(b) = broker().await else { return };
    let q = unique("ahead");
    let (_, plan) = plan(&q);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    seed(&b, &plan, &[b"one", b"two", b"three"]).await;

    let t = transport().await;
    Transport::verify(&t, &plan).await.expect("verified");
    // Long enough for the links opened ahead to be attached, and for a credit, had one
    // been granted, to take messages.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(b.ready(&q).await, 3, "nothing taken from the work queue");
    assert_eq!(
        b.ready(plan.isolation_queue()).await,
        1,
        "nothing taken from the isolation queue"
    );

    // The fetch link takes one suspect; the consuming link then delivers, in order.
    let suspect = t
        .fetch(plan.isolation_queue())
        .await
        .expect("fetch")
        .expect("the suspect");
    assert_eq!(suspect.message.body(), b"suspect");
    assert!(!suspect.facts.redelivered, "never delivered before");
    t.settle(&suspect.tag, Settlement::Ack).await.expect("ack");
    let sub = t.consume(&q, 10).await.expect("consume");
    for body in [b"one".as_slice(), b"two", b"three"] {
        let d = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("delivered in time")
            .expect("recv")
            .expect("delivery");
        assert_eq!(d.message.body(), body);
        assert!(!d.facts.redelivered, "never delivered before");
        t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    }
    t.close().await;
    assert_eq!(b.wait_ready(&q, 0, Duration::from_secs(3)).await, 0);
}

#[tokio::test]
async fn a_consume_long_after_verifying_opens_its_own_link() {
    let Some(b) = broker().await else { return };
    let q = unique("ahead-late");
    let (_, plan) = plan(&q);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    b.publish(&q, b"late", BasicProperties::default()).await;
    // A short operation timeout: the link opened ahead is closed unused after it.
    let t = transport_amqp10::Amqp10Transport::connect(
        transport_amqp10::Amqp10Config::new(common::amqp10_url())
            .with_operation_timeout(Duration::from_millis(300)),
    )
    .await
    .expect("connect");
    Transport::verify(&t, &plan).await.expect("verified");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(b.ready(&q).await, 1, "nothing taken");
    let sub = t.consume(&q, 1).await.expect("consume");
    let d = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("delivered in time")
        .expect("recv")
        .expect("delivery");
    assert_eq!(d.message.body(), b"late");
    t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    t.close().await;
}

#[tokio::test]
async fn a_consumer_runs_the_suspects_left_before_its_first_work_delivery() {
    let Some(b) = broker().await else { return };
    let q = unique("ahead-order");
    let (policy, plan) = plan(&q);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    seed(&b, &plan, &[b"work-1", b"work-2"]).await;

    let t = Arc::new(transport().await);
    let runs = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (runs, done) = (Arc::clone(&runs), Arc::clone(&done));
        move |msg: Message| {
            let (runs, done) = (Arc::clone(&runs), Arc::clone(&done));
            async move {
                let mut runs = runs.lock().expect("runs");
                runs.push(msg.body().to_vec());
                if runs.len() == 3 {
                    done.notify_one();
                }
                Ok::<(), HandlerError>(())
            }
        }
    };
    let consumer = Consumer::builder(Arc::clone(&t), &q, policy, handler)
        .with_prefetch(10)
        .with_provision(false)
        .build()
        .expect("consumer");
    let shutdown = {
        let done = Arc::clone(&done);
        async move {
            let _ = tokio::time::timeout(Duration::from_secs(20), done.notified()).await;
        }
    };
    let report = consumer.run(shutdown).await.expect("run");
    t.close().await;
    let runs = runs.lock().expect("runs").clone();
    assert_eq!(
        runs,
        [b"suspect".to_vec(), b"work-1".to_vec(), b"work-2".to_vec()],
        "{report:?}"
    );
    assert_eq!(report.suspects, 1, "{report:?}");
    assert_eq!(b.wait_ready(&q, 0, Duration::from_secs(3)).await, 0);
    assert_eq!(b.ready(plan.isolation_queue()).await, 0);
}
