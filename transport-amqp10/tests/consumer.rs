//! `retry_core::Consumer` on the AMQP 1.0 transport against the local RabbitMQ.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::BasicProperties;
use retry_core::{
    Consumer, ConsumerError, HandlerError, Message, RetryPolicy, Terminal, TopologyPlan,
    TransportError,
};
use tokio::sync::Notify;

use common::{broker, transport, unique};

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
    let consumer = Consumer::builder(transport().await, policy, handle)
        .queue(q.as_str())
        .prefetch(5)
        .handler_timeout(Duration::from_secs(5))
        .on_terminal({
            let finished = Arc::clone(&finished);
            let done = Arc::clone(&done);
            move |_, terminal| {
                let last = matches!(
                    terminal,
                    Terminal::Handled { .. } | Terminal::DeadLettered { .. }
                );
                if last && finished.fetch_add(1, Ordering::SeqCst) + 1 == 3 {
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
    let consumer = Consumer::builder(transport().await, policy, move |_msg: Message| {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Ok::<(), HandlerError>(()) }
    })
    .queue(q.as_str())
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
