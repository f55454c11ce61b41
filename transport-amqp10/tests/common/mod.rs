//! This crate's glue for its broker tests: finding the broker over both protocols,
//! provisioning topology over AMQP 0-9-1 as a deployment does, the transport under test, and
//! a small loop that drives the engine over a subscription. Everything broker-level (the
//! lapin side connection, unique names, cleanup) comes from test-brokers.

#![allow(dead_code, unused_imports)]

use std::time::{Duration, Instant};

use lapin::options::QueueDeleteOptions;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel};
use retry_core::{
    Action, Delivery, Engine, Lane, Message, Outcome, Subscription, Terminal, TopologyPlan,
    Transport, TransportError,
};
use test_brokers::rabbitmq::{self, Cleanup, redeclare};
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

pub use test_brokers::{amqp_url, amqp10_url, unique};

/// The one place that decides whether a broker test runs: with a broker it runs; without
/// one it is skipped loudly, unless `REQUIRE_BROKER` is set (CI), where it fails.
pub async fn broker() -> Option<Broker> {
    let attempt = async {
        let broker = broker_at(&amqp_url()).await?;
        let probe = Amqp10Transport::connect(Amqp10Config::new(amqp10_url()))
            .await
            .map_err(|e| format!("AMQP 1.0: {e} (is rabbitmq_amqp1_0 enabled?)"))?;
        probe.close().await;
        Ok::<_, String>(broker)
    };
    match tokio::time::timeout(Duration::from_secs(15), attempt).await {
        Ok(Ok(broker)) => Some(broker),
        outcome => {
            let why = match outcome {
                Ok(Err(e)) => e,
                _ => "no answer within 15 s".into(),
            };
            test_brokers::no_broker("a RabbitMQ test over AMQP 1.0", &why);
            None
        }
    }
}

/// The broker at the AMQP 0-9-1 `url`, for setup and inspection (the TLS tests' node).
pub async fn broker_at(url: &str) -> Result<Broker, String> {
    let setup = AmqpTransport::connect(AmqpConfig::new(url))
        .await
        .map_err(|e| format!("AMQP 0-9-1: {e}"))?;
    let channel = rabbitmq::confirm_channel(&setup.connection())
        .await
        .map_err(|e| format!("a confirm channel: {e}"))?;
    Ok(Broker {
        setup,
        channel,
        url: url.to_owned(),
    })
}

/// The broker seen over AMQP 0-9-1: the 0-9-1 transport provisions, a raw channel inspects.
pub struct Broker {
    setup: AmqpTransport,
    pub channel: Channel,
    url: String,
}

/// Extra queue arguments a test adds to one queue of a plan: (queue, argument, value).
pub type Extra = Vec<(String, String, AMQPValue)>;

impl Broker {
    /// Provisions `plan` through the AMQP 0-9-1 transport, then removes the queues in `skip`
    /// and redeclares any queue named in `extra` with those arguments added. The returned
    /// guard deletes the plan's objects when dropped.
    pub async fn declare(&self, plan: &TopologyPlan, skip: &[&str], extra: Extra) -> Cleanup {
        // A test's cascade has a prefix of its own: it goes with the plan.
        let cleanup = Cleanup::new(self.url.as_str()).with_plan(plan);
        self.setup.provision(plan).await.expect("0-9-1 provision");
        for queue in plan.queues() {
            let skipped = skip.contains(&queue.name.as_str());
            let tweaks: Vec<_> = extra.iter().filter(|(q, _, _)| *q == queue.name).collect();
            if !skipped && tweaks.is_empty() {
                continue;
            }
            if skipped {
                self.channel
                    .queue_delete(queue.name.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .expect("queue_delete");
                continue;
            }
            let tweak = |mut args: FieldTable| {
                for (_, arg, value) in &tweaks {
                    args.insert(ShortString::from(arg.as_str()), value.clone());
                }
                args
            };
            redeclare(&self.channel, plan, &queue.name, tweak)
                .await
                .expect("redeclare the queue");
        }
        cleanup
    }

    /// Publishes over AMQP 0-9-1 to `queue` through the default exchange, with a confirm.
    pub async fn publish(&self, queue: &str, body: &[u8], properties: BasicProperties) {
        rabbitmq::publish_with(&self.channel, queue, body, properties).await;
    }

    /// Messages ready in `queue`.
    pub async fn ready(&self, queue: &str) -> u32 {
        let count = rabbitmq::message_count(&self.channel, queue).await;
        count.expect("passive declare")
    }

    /// Waits until `queue` holds `n` ready messages, at most `within`.
    pub async fn wait_ready(&self, queue: &str, n: u32, within: Duration) -> u32 {
        let count = rabbitmq::wait_for_count(&self.channel, queue, n, within).await;
        count.expect("passive declare")
    }

    /// Deletes `queue` over AMQP 0-9-1 under `sub`, which takes its link away, and waits
    /// until `sub` reports the loss as a connection error.
    pub async fn take_link_away<S: Subscription>(&self, queue: &str, sub: &S) {
        self.channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await
            .expect("delete");
        let lost = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("reported in time");
        assert!(
            matches!(lost, Err(TransportError::Connection { .. })),
            "{:?}",
            lost.map(|d| d.is_some())
        );
    }

    /// Takes one message from `queue` over AMQP 0-9-1: body and redelivered flag.
    pub async fn get(&self, queue: &str) -> Option<(Vec<u8>, bool)> {
        let got = rabbitmq::get(&self.channel, queue).await;
        got.map(|d| (d.data, d.redelivered))
    }
}

/// A transport with short timeouts, for tests.
pub async fn transport() -> Amqp10Transport {
    Amqp10Transport::connect(
        Amqp10Config::new(amqp10_url())
            .with_publish_timeout(Duration::from_secs(2))
            .with_operation_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("AMQP 1.0 connect")
}

/// Drives `engine` over the work-queue `subscription` of `transport` until `terminals`
/// deliveries have ended or `within` passes, running `handler` inline. Each delivery rides
/// in the engine as its data, so no map of its own is kept. Returns how each delivery
/// ended, with its message.
pub async fn drive<T: Transport>(
    transport: &T,
    subscription: &T::Subscription,
    engine: &mut Engine<Delivery<T::Tag>>,
    handler: &impl Fn(&Message) -> Outcome,
    terminals: usize,
    within: Duration,
) -> Vec<(Terminal, Message)> {
    let deadline = Instant::now() + within;
    let mut ended = Vec::new();
    while ended.len() < terminals {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let delivery = match tokio::time::timeout(left, subscription.recv()).await {
            Ok(Ok(Some(d))) => d,
            Ok(Ok(None)) => break,
            Ok(Err(e)) => panic!("recv failed: {e}"),
            Err(_) => break,
        };
        let facts = delivery.facts;
        engine.handle_delivery(transport.now(), Lane::Work, facts, delivery);
        loop {
            let Some(action) = engine.poll_action() else {
                match engine.poll_timeout() {
                    Some(due) => {
                        let now = transport.now();
                        tokio::time::sleep(due.saturating_duration_since(now)).await;
                        engine.handle_timeout(transport.now());
                        continue;
                    }
                    None => break,
                }
            };
            match action {
                Action::RunHandler { delivery, attempt } => {
                    let held = engine.data(delivery).expect("action for a held delivery");
                    let outcome = handler(&held.message.with_attempt(attempt));
                    engine
                        .handle_outcome(transport.now(), delivery, outcome)
                        .expect("outcome");
                }
                Action::Publish { delivery, publish } => {
                    let held = engine.data(delivery).expect("action for a held delivery");
                    let result = transport.publish(&held.message, &publish).await;
                    engine
                        .handle_confirm(transport.now(), delivery, result.confirm())
                        .expect("confirm");
                }
                Action::Settle {
                    settlement,
                    terminal,
                    data,
                    ..
                } => {
                    transport
                        .settle(&data.tag, settlement)
                        .await
                        .expect("settle");
                    ended.push((terminal, data.message));
                }
            }
        }
    }
    ended
}
