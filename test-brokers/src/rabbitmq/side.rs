//! The side connection: plain lapin, beside the transport under test, to set up what a test
//! starts from and to look at what it left.

use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::poll_until;

/// Whether a broker answers at the AMQP 0-9-1 `url`: connects within 5 s and closes again.
/// The error says where (without credentials) and why, ready for
/// [`no_broker`](crate::no_broker).
///
/// ```no_run
/// # async fn f() {
/// if let Err(why) = test_brokers::rabbitmq::probe(&test_brokers::amqp_url()).await {
///     test_brokers::no_broker("my test", &why);
/// }
/// # }
/// ```
pub async fn probe(url: &str) -> Result<(), String> {
    let connecting = Connection::connect(url, ConnectionProperties::default());
    let why = match tokio::time::timeout(Duration::from_secs(5), connecting).await {
        Ok(Ok(connection)) => {
            let _ = connection.close(200, "probe".into()).await;
            return Ok(());
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 5 s".into(),
    };
    Err(format!("RabbitMQ at {}: {why}", crate::authority(url)))
}

/// A new channel on `connection`, in confirm mode.
pub async fn confirm_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// A plain lapin connection to [`amqp_url`](crate::amqp_url) and a confirm-mode channel on
/// it, for setup and inspection. Panics without a broker.
pub async fn raw() -> (Connection, Channel) {
    let connection = Connection::connect(&crate::amqp_url(), ConnectionProperties::default())
        .await
        .expect("the side connection to the test broker");
    let channel = confirm_channel(&connection)
        .await
        .expect("a confirm channel on the side connection");
    (connection, channel)
}

/// Publishes `body` as a persistent message with `message_id` to the default exchange with
/// `routing_key` (the queue of that name), and waits for its confirm; panics unless it is a
/// positive one. `channel` is in confirm mode.
pub async fn publish(channel: &Channel, routing_key: &str, body: &[u8], message_id: &str) {
    let properties = BasicProperties::default()
        .with_message_id(message_id.into())
        .with_delivery_mode(2);
    publish_with(channel, routing_key, body, properties).await;
}

/// Publishes `body` with `properties` to the default exchange with `routing_key`, and
/// waits for its confirm; panics unless it is a positive one. `channel` is in confirm mode.
pub async fn publish_with(
    channel: &Channel,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) {
    let confirm = channel
        .basic_publish(
            "".into(),
            routing_key.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .expect("basic.publish")
        .await
        .expect("the publish's confirm");
    assert!(
        confirm.is_ack(),
        "the publish to {routing_key} was not confirmed: {confirm:?}"
    );
}

/// A field table of these entries.
///
/// ```
/// use lapin::types::AMQPValue;
///
/// let table = test_brokers::rabbitmq::table([("x-max-length", AMQPValue::LongInt(0))]);
/// assert_eq!(table.inner().len(), 1);
/// ```
pub fn table<'a>(entries: impl IntoIterator<Item = (&'a str, AMQPValue)>) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in entries {
        table.insert(name.into(), value);
    }
    table
}

/// Takes one message from `queue` with `basic.get`, acknowledged as it is taken; `None` when
/// the queue is empty. Panics if the broker refuses (no such queue).
pub async fn get(channel: &Channel, queue: &str) -> Option<Delivery> {
    channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap_or_else(|e| panic!("basic.get from {queue}: {e}"))
        .map(|message| message.delivery)
}

/// [`get`], asked every 50 ms until a message arrives or `within` has passed.
pub async fn wait_get(channel: &Channel, queue: &str, within: Duration) -> Option<Delivery> {
    let every = Duration::from_millis(50);
    poll_until(within, every, || get(channel, queue), Option::is_some).await
}

/// Declares the durable queue `name` with `arguments`; panics if the broker refuses.
pub async fn declare_durable(channel: &Channel, name: &str, arguments: FieldTable) {
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(name.into(), options, arguments)
        .await
        .unwrap_or_else(|e| panic!("declare {name}: {e}"));
}

/// The messages ready in `queue` (a passive declare: delivered and unacknowledged ones are
/// not counted, see [`ready_and_unacked`](super::ready_and_unacked)).
pub async fn message_count(channel: &Channel, queue: &str) -> Result<u32, lapin::Error> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?;
    Ok(declared.message_count())
}

/// [`message_count`], asked every 50 ms until there are `expected` or `within` has passed
/// (the broker handles settlements and the end of a connection asynchronously); returns the
/// last count, or the first error.
pub async fn wait_for_count(
    channel: &Channel,
    queue: &str,
    expected: u32,
    within: Duration,
) -> Result<u32, lapin::Error> {
    let every = Duration::from_millis(50);
    let count = || message_count(channel, queue);
    poll_until(within, every, count, |n| {
        n.as_ref().map_or(true, |n| *n == expected)
    })
    .await
}
