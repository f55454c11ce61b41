//! The retry engine inside a lapin consumer of your own: plain `basic_consume`,
//! `basic_publish` with confirms and `basic_ack`, with retry-proto's `Engine`, `TopologyPlan`
//! and header helpers deciding what a failure means. No `Consumer` driver, no
//! `AmqpTransport`.
//!
//! Three comments go to a fresh queue: one is handled, one fails once and comes back through
//! the delay queue, one always fails and is parked with its diagnostics.
//!
//! ```sh
//! cargo run -p examples --example 06_embedded
//! ```
//!
//! `AMQP_URL` overrides the broker (default `amqp://guest:guest@127.0.0.1:5672/%2f`). This
//! consumer runs one delivery at a time, so a suspect from the isolation queue always runs
//! alone. One that runs several at once must stop starting work deliveries while a suspect
//! runs, as `retry_core::Consumer` does.

use std::error::Error;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use lapin::options::{BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use retry_proto::{
    Action, Delivery, Engine, HandlerError, Lane, Message, ParkedRecord, RetryPolicy, Settlement,
    Timestamp, TopologyPlan,
};
use transport_amqp091::embed;

/// The handler, as it was before retries came along.
async fn handle(msg: &Message) -> Result<(), HandlerError> {
    match msg.body() {
        b"flaky" if msg.attempt() == 1 => Err(HandlerError::transient("db timeout")),
        b"broken" => Err(HandlerError::transient("cannot render comment")),
        _ => Ok(()),
    }
}

fn now() -> Timestamp {
    Timestamp::from_system_time(SystemTime::now())
}

/// Declares the retry topology of `queue`, publishes three comments to it, consumes until
/// each has been handled or parked, telling `say` what happened, reads the parking queue,
/// and deletes the queue and its retry topology.
async fn run(url: &str, queue: &str, mut say: impl FnMut(String)) -> Result<(), Box<dyn Error>> {
    let conn = Connection::connect(url, Default::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    // One delay of 200 ms, then the parking queue.
    let policy = RetryPolicy::delays([Duration::from_millis(200)]).build()?;
    let plan = TopologyPlan::new(queue, &policy)?;
    embed::provision(&conn, &plan).await?;
    for body in ["ok", "flaky", "broken"] {
        let persistent = BasicProperties::default().with_delivery_mode(2);
        let options = BasicPublishOptions::default();
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                options,
                body.as_bytes(),
                persistent,
            )
            .await?
            .await?;
    }
    let consumed = consume(&channel, Engine::new(policy, &plan)?, 3, &mut say).await;
    // A parked message carries its diagnostics in headers.
    let parking = plan.parking_queue();
    while let Some(got) = channel
        .basic_get(parking.into(), Default::default())
        .await?
    {
        let parked = embed::delivery(got.delivery, parking);
        let record = ParkedRecord::decode(parked.message.headers());
        let reason = record.reason.map_or("unknown", |r| r.as_str());
        let (runs, error) = (record.attempts, record.last_error.unwrap_or(""));
        let body = String::from_utf8_lossy(parked.message.body());
        say(format!(
            "in {parking}: {body} ({reason} after {runs} failed runs: {error})"
        ));
        channel.basic_ack(parked.tag, Default::default()).await?;
    }
    embed::teardown(&conn, &plan).await?;
    consumed
}

/// Takes deliveries from both of the plan's queues, one at a time, until `messages` of them
/// have been handled or parked.
async fn consume(
    channel: &Channel,
    mut engine: Engine<Delivery<u64>>,
    mut messages: usize,
    say: &mut impl FnMut(String),
) -> Result<(), Box<dyn Error>> {
    let plan = &engine.plan().clone();
    // The work queue, and the isolation queue where redelivered messages wait to run alone.
    let subscribe = |lane| async move {
        let queue = plan.lane_queue(lane).into();
        let consumer =
            channel.basic_consume(queue, "".into(), Default::default(), Default::default());
        Ok::<_, lapin::Error>(consumer.await?.map(move |d| (lane, d)))
    };
    let work = subscribe(Lane::Work).await?;
    let mut intake = futures::stream::select(work, subscribe(Lane::Isolation).await?);
    while messages > 0 {
        let Some((lane, delivery)) = intake.next().await else {
            break;
        };
        let delivery = embed::delivery(delivery?, plan.lane_queue(lane));
        engine.handle_delivery(now(), lane, delivery.facts, delivery);
        // Carry out what the engine asks, in order, until it is done with this delivery.
        loop {
            let Some(action) = engine.poll_action() else {
                // Nothing to do now; an immediate retry may be waiting for its moment.
                let Some(due) = engine.poll_timeout() else {
                    break;
                };
                tokio::time::sleep(due.saturating_duration_since(now())).await;
                engine.handle_timeout(now());
                continue;
            };
            match action {
                Action::RunHandler { delivery, attempt } => {
                    let msg = &engine.data(delivery).ok_or("not in flight")?.message;
                    let outcome = handle(&msg.with_attempt(attempt)).await.into();
                    engine.handle_outcome(now(), delivery, outcome)?;
                }
                // A clone, to a delay queue or the parking queue: publish it, await its confirm.
                // One at a time on this channel, so lapin's confirm carries this clone's own
                // return; with several in flight, publish with `embed::Publisher` instead.
                Action::Publish { delivery, publish } => {
                    let original = &engine.data(delivery).ok_or("not in flight")?.message;
                    let (exchange, key) = (&*publish.route.exchange, &*publish.route.routing_key);
                    let mandatory = BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    };
                    let properties = embed::clone_properties(original, &publish);
                    let body = original.body();
                    let sent = channel.basic_publish(
                        exchange.into(),
                        key.into(),
                        mandatory,
                        body,
                        properties,
                    );
                    engine.handle_confirm(now(), delivery, embed::confirm(sent.await?.await))?;
                }
                // The original, once its clone is confirmed (or back to the queue if not).
                Action::Settle {
                    settlement,
                    terminal,
                    data,
                    ..
                } => {
                    let tag = data.tag;
                    if settlement == Settlement::Ack {
                        channel.basic_ack(tag, Default::default()).await?;
                    } else {
                        let requeue = settlement == Settlement::Requeue;
                        channel
                            .basic_nack(
                                tag,
                                BasicNackOptions {
                                    requeue,
                                    multiple: false,
                                },
                            )
                            .await?;
                    }
                    let body = String::from_utf8_lossy(data.message.body());
                    say(format!("{body:<7} {terminal}"));
                    messages -= usize::from(terminal.is_final());
                }
            }
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    run(&url(), "embedded-comments", |line| println!("{line}")).await
}

/// The broker: `AMQP_URL`, or the local one.
fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

#[cfg(test)]
mod tests {
    /// Runs the example on the local broker, on a queue of its own, and checks what it printed.
    #[tokio::test]
    async fn handles_retries_and_parks_on_the_broker() {
        let url = super::url();
        if let Err(e) = lapin::Connection::connect(&url, Default::default()).await {
            test_brokers::no_broker("the embedded example", &e.to_string());
            return;
        }
        let queue = format!("embedded-test-{}", std::process::id());
        let mut printed = Vec::new();
        let run = super::run(&url, &queue, |line| printed.push(line));
        // A message that never ends would keep the example waiting: fail instead.
        let limit = std::time::Duration::from_secs(60);
        tokio::time::timeout(limit, run)
            .await
            .expect("ran past a minute")
            .unwrap();
        let parked = format!(
            "in {queue}.parking: broken (attempts-exhausted after 2 failed runs: cannot render comment)"
        );
        assert_eq!(
            printed,
            [
                "ok      handled on attempt 1",
                "flaky   retried in 200ms",
                "broken  retried in 200ms",
                "flaky   handled on attempt 2",
                "broken  parked (attempts-exhausted)",
                &parked,
            ]
        );
        // The guide's embedding chapter shows what `cargo run` prints, on the queue `main` uses.
        let shown = printed.join("\n").replace(&queue, "embedded-comments");
        assert!(
            include_str!("../docs/embedding.md").contains(&shown),
            "{shown}"
        );
    }
}
