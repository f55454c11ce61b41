//! Shared helpers for the broker tests: skipping without a broker, unique names, raw lapin
//! access for setup and inspection, and `rabbitmqctl` for faults.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use retry_core::{Headers, TopologyPlan};
use transport_amqp091::{AmqpConfig, AmqpTransport, headers_from_table};

pub fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
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

/// A user's headers in every AMQP 0-9-1 type the engine's header model reads as another
/// (64-bit integers, doubles, text, bytes), as a Java or .NET publisher sends them, nested
/// ones included.
pub fn narrow_headers() -> Vec<(&'static str, AMQPValue)> {
    let mut nested = FieldTable::default();
    nested.insert("n".into(), AMQPValue::LongInt(-5));
    vec![
        ("i8", AMQPValue::ShortShortInt(-3)),
        ("u8", AMQPValue::ShortShortUInt(200)),
        ("i16", AMQPValue::ShortInt(-300)),
        ("u16", AMQPValue::ShortUInt(60_000)),
        ("i32", AMQPValue::LongInt(7)),
        ("u32", AMQPValue::LongUInt(4_000_000_000)),
        ("f32", AMQPValue::Float(1.5)),
        (
            "decimal",
            AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 1234,
            }),
        ),
        (
            "latin1",
            AMQPValue::LongString(LongString::from(b"caf\xe9".to_vec())),
        ),
        (
            "array",
            AMQPValue::FieldArray(vec![AMQPValue::ShortInt(1)].into()),
        ),
        ("table", AMQPValue::FieldTable(nested)),
    ]
}

/// Checks that `table` holds every one of [`narrow_headers`] with its own type.
pub fn assert_narrow_headers_kept(table: &FieldTable) {
    for (name, value) in narrow_headers() {
        assert_eq!(table.inner().get(name), Some(&value), "header {name}");
    }
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

/// Declares a durable queue with these arguments.
pub async fn declare_durable(ch: &Channel, name: &str, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
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

/// Closes, from the broker's side, every connection whose client-provided name is `name`.
/// Returns how many were closed.
pub async fn close_connection(name: &str) -> usize {
    let needle = format!("{{\"connection_name\",\"{name}\"}}");
    tokio::task::spawn_blocking(move || {
        // The table form prints pids in the full syntax close_connection accepts.
        let listing = rabbitmqctl(&["list_connections", "-q", "pid", "client_properties"]);
        let mut closed = 0;
        for line in listing.lines().filter(|l| l.contains(&needle)) {
            let pid = line.split('\t').next().unwrap();
            rabbitmqctl(&["close_connection", pid, "test: forced close"]);
            closed += 1;
        }
        if closed == 0 {
            eprintln!("no connection named {needle} in:\n{listing}");
        }
        closed
    })
    .await
    .unwrap()
}

/// `rabbitmqctl list_queues` rows for queues whose names start with `prefix`: name,
/// arguments (as JSON), durable, type.
pub async fn list_queues(prefix: &str) -> Vec<serde_json::Value> {
    list_queues_with(prefix, &["arguments", "durable", "type"]).await
}

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

/// `t`'s recovery count once it reaches `at_least`, or whatever it is after 10 s: lapin may
/// finish recording a recovery a moment after consuming has resumed.
pub async fn recoveries_reaching(t: &AmqpTransport, at_least: u64) -> u64 {
    let (within, every) = (Duration::from_secs(10), Duration::from_millis(20));
    let count = || std::future::ready(t.recoveries());
    poll_until(within, every, count, |n| *n >= at_least).await
}

/// `rabbitmqctl list_bindings` rows (source, destination, routing key) whose source starts
/// with `prefix`.
pub async fn list_bindings(prefix: &str) -> Vec<(String, String, String)> {
    let prefix = prefix.to_owned();
    tokio::task::spawn_blocking(move || {
        let listing = rabbitmqctl(&[
            "list_bindings",
            "source_name",
            "destination_name",
            "routing_key",
            "--formatter",
            "json",
        ]);
        let rows: serde_json::Value = serde_json::from_str(&listing).expect("json");
        let mut out: Vec<_> = rows
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| {
                r["source_name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(&prefix))
            })
            .map(|r| {
                (
                    r["source_name"].as_str().unwrap().to_owned(),
                    r["destination_name"].as_str().unwrap().to_owned(),
                    r["routing_key"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        out.sort();
        out
    })
    .await
    .unwrap()
}

/// A consumer running in the background, with a record of how each delivery ended.
pub struct Running {
    pub terminals: std::sync::Arc<std::sync::Mutex<Vec<(String, retry_core::Terminal)>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<Result<retry_core::RunReport, retry_core::ConsumerError>>,
}

/// Starts a consumer of `queue` on `transport` (which it provisions), recording terminals
/// by message id.
pub fn start<H: retry_core::Handler>(
    transport: std::sync::Arc<AmqpTransport>,
    policy: retry_core::RetryPolicy,
    handler: H,
    queue: &str,
    configure: impl FnOnce(
        retry_core::ConsumerBuilder<std::sync::Arc<AmqpTransport>, H>,
    ) -> retry_core::ConsumerBuilder<std::sync::Arc<AmqpTransport>, H>,
) -> Running {
    let terminals = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&terminals);
    let builder = retry_core::Consumer::builder(transport, queue, policy, handler)
        .with_prefetch(10)
        .with_handler_timeout(Duration::from_secs(10))
        .with_shutdown_grace(Duration::from_secs(2))
        .with_on_terminal(move |msg, t| {
            let id = msg.properties().message_id.clone().unwrap_or_default();
            seen.lock().unwrap().push((id, *t));
        });
    let consumer = configure(builder).build().expect("valid consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    Running {
        terminals,
        stop: Some(stop),
        handle,
    }
}

impl Running {
    /// The terminals recorded for message `id`, in order.
    pub fn of(&self, id: &str) -> Vec<retry_core::Terminal> {
        self.terminals
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, _)| m == id)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Waits until `done` holds for the recorded terminals, or `within` passes.
    pub async fn until(
        &self,
        within: Duration,
        done: impl Fn(&[(String, retry_core::Terminal)]) -> bool,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if done(&self.terminals.lock().unwrap()) {
                return true;
            }
            if tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the consumer and returns its report.
    pub async fn stop(mut self) -> retry_core::RunReport {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), &mut self.handle)
            .await
            .expect("the consumer stops within its grace")
            .expect("the consumer task did not panic")
            .expect("the consumer ran without error")
    }
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

/// How many of this process's threads are lapin IO loops (one per connection).
pub fn io_loop_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|name| name.trim_end() == "lapin-io-loop")
                })
                .count()
        })
        .unwrap_or(0)
}

/// The broker's `host:port`, from [`url`], for a proxy to stand in front of.
pub fn authority() -> String {
    url()
        .split_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .unwrap_or("127.0.0.1:5672")
        .to_owned()
}

/// The plan the connection-fault tests consume under: classic queues, one 30 s delay.
pub fn classic_plan(queue: &str) -> TopologyPlan {
    let policy = retry_core::RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .unwrap();
    TopologyPlan::builder(queue, &policy)
        .with_queue_type(retry_core::QueueType::Classic)
        .build()
        .unwrap()
}
