//! `fetch` against messages that reach the queue while a fetch is under way, on the local
//! RabbitMQ 3.x through its AMQP 1.0 plugin.
//!
//! On RabbitMQ 3.x a message put back in a queue comes back with `first-acquirer = false`,
//! which is the transport's redelivered flag; from the isolation queue the engine reads it as
//! a crash. A message that nobody held when a process died must never come back marked.

mod common;

use std::time::Duration;

use lapin::BasicProperties;
use retry_core::{RetryPolicy, Settlement, TopologyPlan, Transport};
use transport_amqp10::{Amqp10Config, Amqp10Transport};

use common::{amqp10_url, broker, unique};

/// Publishes one message per round while a fetch of the (empty) queue runs, at offsets
/// swept across the end of the fetch wait, where an unanswered credit is taken back; then
/// fetches until that message is in hand. Every message must come back unmarked: each was
/// published once, and no holder of it went away.
#[tokio::test]
async fn a_message_that_arrives_as_a_fetch_gives_up_is_not_marked_redelivered() {
    let Some(b) = broker().await else { return };
    let q = unique("fetch-race");
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;

    let wait = Duration::from_millis(30);
    let t = Amqp10Transport::connect(
        Amqp10Config::new(amqp10_url())
            .with_operation_timeout(Duration::from_secs(10))
            .with_fetch_wait(wait),
    )
    .await
    .expect("connect");

    let rounds = 120u32;
    let mut marked = Vec::new();
    for round in 0..rounds {
        // From 6 ms before the end of the wait to 6 ms after it, in steps of 0.5 ms.
        let step = Duration::from_micros(500) * (round % 25);
        let offset = (wait + step).saturating_sub(Duration::from_millis(6));
        let body = format!("round {round}");
        let publish = async {
            tokio::time::sleep(offset).await;
            b.publish(&q, body.as_bytes(), BasicProperties::default())
                .await;
        };
        let (first, ()) = tokio::join!(t.fetch(&q), publish);
        let mut fetched = first.expect("fetch");
        for _ in 0..50 {
            if fetched.is_some() {
                break;
            }
            fetched = t.fetch(&q).await.expect("fetch");
        }
        let d = fetched.unwrap_or_else(|| panic!("round {round}: the message never came"));
        assert_eq!(d.message.body(), body.as_bytes(), "round {round}");
        if d.facts.redelivered {
            marked.push(round);
        }
        t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    }
    t.close().await;
    assert!(
        marked.is_empty(),
        "{} of {rounds} messages came back marked redelivered though nobody that held them \
         went away (rounds {marked:?})",
        marked.len()
    );
    assert_eq!(b.ready(&q).await, 0);
}

/// A fetch wait far shorter than the broker takes to deliver: a message the broker counted
/// before the grant is still on its way when the wait ends. It must be waited for, not sent
/// back marked redelivered by taking the credit back under it.
#[tokio::test]
async fn a_counted_message_slower_than_the_fetch_wait_is_taken_not_sent_back_marked() {
    let Some(b) = broker().await else { return };
    let q = unique("fetch-slow");
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;

    let t = Amqp10Transport::connect(
        Amqp10Config::new(amqp10_url())
            .with_operation_timeout(Duration::from_secs(10))
            .with_fetch_wait(Duration::from_micros(100)),
    )
    .await
    .expect("connect");

    let rounds = 40u32;
    let mut missed = Vec::new();
    let mut marked = Vec::new();
    for round in 0..rounds {
        let body = format!("round {round}");
        b.publish(&q, body.as_bytes(), BasicProperties::default())
            .await;
        let mut fetched = t.fetch(&q).await.expect("fetch");
        if fetched.is_none() {
            missed.push(round);
            for _ in 0..50 {
                fetched = t.fetch(&q).await.expect("fetch");
                if fetched.is_some() {
                    break;
                }
            }
        }
        let d = fetched.unwrap_or_else(|| panic!("round {round}: the message never came"));
        assert_eq!(d.message.body(), body.as_bytes(), "round {round}");
        if d.facts.redelivered {
            marked.push(round);
        }
        t.settle(&d.tag, Settlement::Ack).await.expect("ack");
    }
    t.close().await;
    assert!(
        missed.is_empty() && marked.is_empty(),
        "of {rounds} messages ready before their fetch, {} were not taken by it (rounds \
         {missed:?}) and {} came back marked redelivered (rounds {marked:?})",
        missed.len(),
        marked.len()
    );
}
