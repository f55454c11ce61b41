//! This crate's glue for its broker tests: the broker's `AmqpConfig` or a loud skip, the
//! transport under test, a consumer running in the background, and messages read back as
//! the engine's headers. Everything broker-level (the lapin side connection, rabbitmqctl,
//! unique names, cleanup) comes from test-brokers, re-exported here.

#![allow(dead_code, unused_imports)]

use std::time::Duration;

use lapin::Channel;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString};
use retry_core::{Headers, TopologyPlan};
use transport_amqp091::{AmqpConfig, AmqpTransport, headers_from_table};

pub use test_brokers::rabbitmq::{
    Cleanup, close_connection, declare_durable, list_bindings, list_queues, list_queues_with,
    message_count, publish, publish_with, rabbitmqctl, raw, ready_and_unacked,
    ready_and_unacked_settled, table,
};
pub use test_brokers::{amqp_url, authority, poll_until, unique};

/// The broker's config, or `None` (after a loud message) when there is no broker and
/// `REQUIRE_BROKER` is unset. With `REQUIRE_BROKER` set, a missing broker fails the test.
pub async fn broker(test: &str) -> Option<AmqpConfig> {
    if let Err(why) = test_brokers::rabbitmq::probe(&amqp_url()).await {
        test_brokers::no_broker(test, &why);
        return None;
    }
    Some(AmqpConfig::new(amqp_url()).with_connection_name(format!("test-{}", unique(test))))
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

impl From<Delivery> for Got {
    fn from(d: Delivery) -> Self {
        Got {
            message_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
            headers: d
                .properties
                .headers()
                .as_ref()
                .map(headers_from_table)
                .unwrap_or_default(),
            body: d.data,
        }
    }
}

/// One message from `queue`, acknowledged, with its headers read as the transport reads them.
pub async fn get(ch: &Channel, queue: &str) -> Option<Got> {
    test_brokers::rabbitmq::get(ch, queue).await.map(Got::from)
}

/// [`get`] once a message arrives, or `None` after `within`.
pub async fn wait_get(ch: &Channel, queue: &str, within: Duration) -> Option<Got> {
    let got = test_brokers::rabbitmq::wait_get(ch, queue, within).await;
    got.map(Got::from)
}

pub async fn transport(config: &AmqpConfig) -> AmqpTransport {
    AmqpTransport::connect(config.clone()).await.unwrap()
}

/// `t`'s recovery count once it reaches `at_least`, or whatever it is after 10 s: lapin may
/// finish recording a recovery a moment after consuming has resumed.
pub async fn recoveries_reaching(t: &AmqpTransport, at_least: u64) -> u64 {
    let (within, every) = (Duration::from_secs(10), Duration::from_millis(20));
    let count = || std::future::ready(t.recoveries());
    poll_until(within, every, count, |n| *n >= at_least).await
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
