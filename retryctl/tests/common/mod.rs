//! Shared helpers for the `retryctl` tests, from transport-amqp091's test helpers:
//! skipping without a broker, unique names, raw lapin access for setup and inspection, and
//! `rabbitmqctl` for what the broker counts.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use retry_core::{Headers, TopologyPlan};
use transport_amqp091::{AmqpConfig, AmqpTransport, headers_from_table};

pub fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The same broker's AMQP 1.0 URL (no virtual host path), as transport-amqp10's tests take
/// it.
pub fn url10() -> String {
    std::env::var("AMQP10_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into())
}

/// The broker's config, or `None` (after a loud message) when there is no broker and
/// `REQUIRE_BROKER` is unset. With `REQUIRE_BROKER` set, a missing broker fails the test.
pub async fn broker(test: &str) -> Option<AmqpConfig> {
    let reachable = tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(&url(), ConnectionProperties::default()),
    )
    .await;
    match reachable {
        Ok(Ok(c)) => {
            let _ = c.close(200, "probe".into()).await;
            Some(AmqpConfig::new(url()).with_connection_name(format!("test-{}", unique(test))))
        }
        other => {
            let why = match other {
                Ok(Err(e)) => e.to_string(),
                _ => "timed out".into(),
            };
            let at = AmqpConfig::new(url()).redacted_url();
            transport_amqp091::testing::no_broker(test, &format!("RabbitMQ at {at}: {why}"));
            None
        }
    }
}

/// A name no other test run uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{prefix}-{}-{:x}-{}",
        std::process::id(),
        nanos & 0xffff_ffff,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A plain lapin connection and confirm-mode channel for setup and inspection.
pub async fn raw() -> (Connection, Channel) {
    let conn = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    (conn, ch)
}

/// Publishes `body` to the default exchange with `routing_key`, waiting for the confirm.
pub async fn publish(ch: &Channel, routing_key: &str, body: &[u8], message_id: &str) {
    let properties = BasicProperties::default()
        .with_message_id(message_id.into())
        .with_delivery_mode(2);
    publish_with(ch, routing_key, body, properties).await;
}

/// Publishes `body` with `properties` to the default exchange with `routing_key`, waiting
/// for the confirm.
pub async fn publish_with(
    ch: &Channel,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) {
    let confirm = ch
        .basic_publish(
            "".into(),
            routing_key.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack(), "{confirm:?}");
}

/// A field table of these entries.
pub fn table<'a>(entries: impl IntoIterator<Item = (&'a str, AMQPValue)>) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in entries {
        table.insert(name.into(), value);
    }
    table
}

/// A message taken from a queue with basic.get (acked), as body, message id and headers.
pub struct Got {
    pub body: Vec<u8>,
    pub message_id: Option<String>,
    pub headers: Headers,
}

pub async fn get(ch: &Channel, queue: &str) -> Option<Got> {
    let msg = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()?;
    let d = msg.delivery;
    Some(Got {
        message_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
        headers: d
            .properties
            .headers()
            .as_ref()
            .map(headers_from_table)
            .unwrap_or_default(),
        body: d.data,
    })
}

/// Calls `probe` every `every` until what it returns is `done`, or `within` has passed;
/// returns its last answer.
pub async fn poll_until<T, F: Future<Output = T>>(
    within: Duration,
    every: Duration,
    mut probe: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let answer = probe().await;
        if done(&answer) || tokio::time::Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(every).await;
    }
}

/// Polls `queue` until a message arrives or `within` passes.
pub async fn wait_get(ch: &Channel, queue: &str, within: Duration) -> Option<Got> {
    let every = Duration::from_millis(50);
    poll_until(within, every, || get(ch, queue), Option::is_some).await
}

pub async fn message_count(ch: &Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

pub async fn transport(config: &AmqpConfig) -> AmqpTransport {
    AmqpTransport::connect(config.clone()).await.unwrap()
}

pub use transport_amqp091::testing::rabbitmqctl;

/// `rabbitmqctl list_queues` rows with the name and these columns, for queues whose names
/// start with `prefix`.
pub async fn list_queues_with(prefix: &str, columns: &[&str]) -> Vec<serde_json::Value> {
    let prefix = prefix.to_owned();
    let columns: Vec<String> = columns.iter().map(|c| (*c).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let mut args = vec!["list_queues", "name"];
        args.extend(columns.iter().map(String::as_str));
        args.extend(["--formatter", "json"]);
        let listing = rabbitmqctl(&args);
        let rows: serde_json::Value = serde_json::from_str(&listing).expect("json");
        rows.as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["name"].as_str().is_some_and(|n| n.starts_with(&prefix)))
            .cloned()
            .collect()
    })
    .await
    .unwrap()
}

/// Ready and unacknowledged messages of `queue`, as the broker counts them: unlike a passive
/// declare, this sees a delivery whose ack never came.
pub async fn ready_and_unacked(queue: &str) -> (u64, u64) {
    let rows = list_queues_with(queue, &["messages_ready", "messages_unacknowledged"]).await;
    let row = rows
        .iter()
        .find(|r| r["name"] == queue)
        .unwrap_or_else(|| panic!("no queue {queue} in {rows:?}"));
    (
        row["messages_ready"].as_u64().unwrap(),
        row["messages_unacknowledged"].as_u64().unwrap(),
    )
}

/// [`ready_and_unacked`] once nothing of `queue` is unacknowledged, or after 5 s: a closed
/// channel's deliveries go back to the queue a moment after the close returns.
pub async fn ready_and_unacked_settled(queue: &str) -> (u64, u64) {
    let (within, every) = (Duration::from_secs(5), Duration::from_millis(100));
    poll_until(within, every, || ready_and_unacked(queue), |c| c.1 == 0).await
}

/// Deletes the plans (with their cascades) and queues a test made when it is dropped,
/// whether the test passed or panicked ([`transport_amqp091::testing::delete_blocking`]).
pub struct Cleanup {
    config: AmqpConfig,
    plans: Vec<TopologyPlan>,
    pub queues: Vec<String>,
}

impl Cleanup {
    pub fn new(config: &AmqpConfig) -> Self {
        Cleanup {
            config: config.clone(),
            plans: Vec::new(),
            queues: Vec::new(),
        }
    }

    /// Deletes `plan` and its cascade on drop.
    pub fn plan(&mut self, plan: &TopologyPlan) {
        self.plans.push(plan.clone());
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        transport_amqp091::testing::delete_blocking(&self.config, &self.plans, &self.queues);
    }
}
