//! Shared setup for the broker tests: finding the broker, naming and provisioning topology
//! over AMQP 0-9-1, and a small loop that drives the engine over a subscription.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel};
use retry_core::{
    Action, Delivery, Engine, Lane, Message, Outcome, Subscription, Terminal, TopologyPlan,
    Transport, TransportError,
};
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::testing::redeclare;
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// The AMQP 1.0 URL of the broker under test.
pub fn url10() -> String {
    std::env::var("AMQP10_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into())
}

/// The AMQP 0-9-1 URL of the same broker, for setup.
pub fn url091() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The one place that decides whether a broker test runs: with a broker it runs; without
/// one it is skipped loudly, unless `REQUIRE_BROKER` is set (CI), where it fails.
pub async fn broker() -> Option<Broker> {
    let attempt = async {
        let broker = broker_at(&url091()).await?;
        let probe = Amqp10Transport::connect(Amqp10Config::new(url10()))
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
            transport_amqp091::testing::no_broker("a RabbitMQ test over AMQP 1.0", &why);
            None
        }
    }
}

/// The broker at the AMQP 0-9-1 `url`, for setup and inspection (the TLS tests' node).
pub async fn broker_at(url: &str) -> Result<Broker, String> {
    let setup = AmqpTransport::connect(AmqpConfig::new(url))
        .await
        .map_err(|e| format!("AMQP 0-9-1: {e}"))?;
    let channel = setup
        .connection()
        .create_channel()
        .await
        .map_err(|e| format!("channel: {e}"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| format!("confirm_select: {e}"))?;
    Ok(Broker {
        setup,
        channel,
        url: url.to_owned(),
    })
}

/// A name no other test run uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "t10-{prefix}-{}-{nanos:x}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
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
        let cleanup = Cleanup {
            plan: plan.clone(),
            url: self.url.clone(),
        };
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
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .expect("basic_publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "publish to {queue} not confirmed");
    }

    /// Messages ready in `queue`.
    pub async fn ready(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|q| q.message_count())
            .expect("passive declare")
    }

    /// Waits until `queue` holds `n` ready messages, at most `within`.
    pub async fn wait_ready(&self, queue: &str, n: u32, within: Duration) -> u32 {
        let deadline = Instant::now() + within;
        loop {
            let count = self.ready(queue).await;
            if count == n || Instant::now() >= deadline {
                return count;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
        self.channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic_get")
            .map(|m| (m.delivery.data.clone(), m.delivery.redelivered))
    }
}

/// Deletes what a test declared (its plan, and the plan's delay cascade), even when the
/// test panics.
pub struct Cleanup {
    plan: TopologyPlan,
    url: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        // A test's cascade has a prefix of its own: it goes with the plan.
        let config = AmqpConfig::new(self.url.as_str());
        transport_amqp091::testing::delete_blocking(&config, std::slice::from_ref(&self.plan), &[]);
    }
}

/// A transport with short timeouts, for tests.
pub async fn transport() -> Amqp10Transport {
    Amqp10Transport::connect(
        Amqp10Config::new(url10())
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
