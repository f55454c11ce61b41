//! Settling a subscription's deliveries from the caller's task (fe2o3's `ReceiverDisposer`)
//! while the link task keeps the credit, against the local RabbitMQ 3.x: every accept that
//! frees the credit brings the next grant, concurrent settlements never let more than the
//! prefetch be held (RabbitMQ 3.10 over-sent would fail the link with
//! `TransferLimitExceeded`), and a tag of a lost link settles nothing.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lapin::BasicProperties;
use retry_core::{RetryPolicy, Settlement, Subscription, TopologyPlan, Transport, TransportError};

use common::{broker, transport, unique};

fn plan(queue: &str) -> TopologyPlan {
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("policy");
    TopologyPlan::new(queue, &policy).expect("plan")
}

#[tokio::test]
async fn each_accept_from_the_callers_task_brings_the_next_grant() {
    let Some(b) = broker().await else { return };
    let q = unique("settle-grant");
    let plan = plan(&q);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    for i in 0..5u8 {
        b.publish(&q, &[i], BasicProperties::default()).await;
    }
    let t = transport().await;
    // A credit of 1: every next delivery needs the grant the last accept made due.
    let sub = t.consume(&q, 1).await.expect("consume");
    for i in 0..5u8 {
        let d = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .unwrap_or_else(|_| panic!("delivery {i} came: the accept before it granted again"))
            .expect("recv")
            .expect("delivery");
        assert_eq!(d.message.body(), [i]);
        t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    }
    t.close().await;
    assert_eq!(b.wait_ready(&q, 0, Duration::from_secs(3)).await, 0);
}

#[tokio::test]
async fn settling_from_many_tasks_at_once_never_lets_more_than_the_prefetch_in() {
    let Some(b) = broker().await else { return };
    let q = unique("settle-concurrent");
    let plan = plan(&q);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    const N: u64 = 300;
    const PREFETCH: u16 = 4;
    for i in 0..N {
        b.publish(&q, &i.to_be_bytes(), BasicProperties::default())
            .await;
    }
    let t = Arc::new(transport().await);
    let sub = t.consume(&q, PREFETCH).await.expect("consume");
    // Settlements started: a grant can only follow the start of the settlement that freed
    // its credit, so deliveries in hand less those never exceed the prefetch.
    let started = Arc::new(AtomicU64::new(0));
    let mut settling = Vec::new();
    for received in 1..=N {
        // A link failed by a transfer beyond its credit reports it here.
        let d = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("the next delivery came")
            .expect("no transfer beyond the credit")
            .expect("delivery");
        let held = received - started.load(Ordering::SeqCst);
        assert!(
            held <= u64::from(PREFETCH),
            "{held} deliveries held with a prefetch of {PREFETCH}"
        );
        let (t, started) = (Arc::clone(&t), Arc::clone(&started));
        settling.push(tokio::spawn(async move {
            // Settle out of order, some at once, some a little later.
            for _ in 0..(received % 5) {
                tokio::task::yield_now().await;
            }
            started.fetch_add(1, Ordering::SeqCst);
            t.settle(&d.tag, Settlement::Ack).await
        }));
    }
    for s in settling {
        s.await.expect("task").expect("ack");
    }
    sub.flush().await.expect("flush");
    t.close().await;
    assert_eq!(b.wait_ready(&q, 0, Duration::from_secs(3)).await, 0);
}

#[tokio::test]
async fn a_delivery_of_a_lost_link_cannot_be_settled() {
    let Some(b) = broker().await else { return };
    let q = unique("settle-lost");
    let plan = plan(&q);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let t = transport().await;
    let sub = t.consume(&q, 2).await.expect("consume");
    b.publish(&q, b"held", BasicProperties::default()).await;
    let held = sub.recv().await.expect("recv").expect("delivery");

    // Deleting the queue under the consumer takes its link away.
    b.take_link_away(&q, &sub).await;
    for settlement in [Settlement::Ack, Settlement::Requeue, Settlement::Reject] {
        let settled = t.settle(&held.tag, settlement).await;
        assert!(
            matches!(settled, Err(TransportError::Connection { .. })),
            "{settlement:?} on a lost link: {settled:?}"
        );
    }
    t.close().await;
}

#[tokio::test]
async fn a_release_requeues_and_a_reject_dead_letters_beside_direct_accepts() {
    let Some(b) = broker().await else { return };
    let q = unique("settle-kinds");
    let plan = plan(&q);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    for body in [b"released".as_slice(), b"rejected", b"accepted"] {
        b.publish(&q, body, BasicProperties::default()).await;
    }
    let t = transport().await;
    let sub = t.consume(&q, 3).await.expect("consume");
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(sub.recv().await.expect("recv").expect("delivery"));
    }
    // Cancelled first, so that the released one is not sent straight back to this link.
    sub.cancel().await.expect("cancel");
    for d in &held {
        let settlement = match d.message.body() {
            b"released" => Settlement::Requeue,
            b"rejected" => Settlement::Reject,
            _ => Settlement::Ack,
        };
        t.settle(&d.tag, settlement).await.expect("settle");
        let again = t.settle(&d.tag, settlement).await;
        assert!(again.is_err(), "{settlement:?} twice: {again:?}");
    }
    sub.flush().await.expect("flush");
    assert_eq!(b.wait_ready(&q, 1, Duration::from_secs(3)).await, 1);
    let (body, redelivered) = b.get(&q).await.expect("the released one");
    assert_eq!(body, b"released");
    assert!(redelivered);
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 1, Duration::from_secs(3))
            .await,
        1,
        "the rejected one is dead-lettered"
    );
    t.close().await;
}
