//! The pieces a lapin consumer of your own needs to run [`retry_core::Engine`] without
//! [`AmqpTransport`](crate::AmqpTransport): read a delivery as the engine does, write a
//! clone's properties, read a publisher confirm, and declare or delete a plan on a plain
//! [`lapin::Connection`].
//!
//! Your code keeps its own `basic_consume`, `basic_publish` and `basic_ack`; the engine
//! decides. `cargo run -p transport-amqp091 --example embedded` is a complete consumer built
//! this way.
//!
//! ```no_run
//! use lapin::options::{BasicAckOptions, BasicPublishOptions};
//! use retry_core::{Action, Engine, Lane, Timestamp};
//! use transport_amqp091::embed;
//!
//! # async fn step(channel: &lapin::Channel, engine: &mut Engine<retry_core::Delivery<u64>>, d: lapin::message::Delivery) -> Result<(), Box<dyn std::error::Error>> {
//! let now = || Timestamp::from_system_time(std::time::SystemTime::now());
//! let delivery = embed::delivery(d, "comments");
//! engine.handle_delivery(now(), Lane::Work, delivery.facts, delivery);
//! while let Some(action) = engine.poll_action() {
//!     match action {
//!         Action::Publish { delivery, publish } => {
//!             let original = &engine.data(delivery).expect("in flight").message;
//!             let confirmation = channel
//!                 .basic_publish(
//!                     (&*publish.route.exchange).into(),
//!                     (&*publish.route.routing_key).into(),
//!                     BasicPublishOptions { mandatory: true, ..Default::default() },
//!                     original.body(),
//!                     embed::clone_properties(original, &publish),
//!                 )
//!                 .await?
//!                 .await;
//!             engine.handle_confirm(now(), delivery, embed::confirm(confirmation))?;
//!         }
//!         Action::Settle { data, .. } => {
//!             channel.basic_ack(data.tag, BasicAckOptions::default()).await?;
//!         }
//!         Action::RunHandler { .. } => { /* run it, then engine.handle_outcome(..) */ }
//!     }
//! }
//! # Ok(()) }
//! ```

use lapin::{BasicProperties, Connection};
use retry_core::{Confirm, Delivery, Message, Publish, TopologyPlan, TransportError};

use crate::ProvisionReport;
use crate::convert::{properties_to_amqp, received};

/// A lapin delivery from `queue` as the engine reads it: the message, its
/// [`DeliveryFacts`](retry_core::DeliveryFacts) decoded from its headers and redelivered
/// flag, and its delivery tag, to settle it with `basic_ack`, `basic_nack` or
/// `basic_reject` on the channel it came from.
///
/// ```
/// use lapin::message::Delivery;
///
/// let d = Delivery::mock(7, "".into(), "comments".into(), true, b"hello".to_vec());
/// let delivery = transport_amqp091::embed::delivery(d, "comments");
/// assert_eq!(delivery.tag, 7);
/// assert!(delivery.facts.redelivered);
/// assert_eq!(delivery.message.queue(), "comments");
/// assert_eq!(delivery.message.body(), b"hello");
/// ```
pub fn delivery(delivery: lapin::message::Delivery, queue: &str) -> Delivery<u64> {
    received(delivery, queue, |tag, _| tag)
}

/// The properties to publish `original`'s clone with: its properties, the clone's headers
/// ([`Publish::clone_headers`]) and the per-message TTL the engine asked for. Publish the
/// clone `mandatory`, with `original`'s body, to `publish.route`.
///
/// ```
/// use retry_core::headers::EngineHeaders;
/// use retry_core::{Message, MessageParts, Publish, Route};
///
/// let original = Message::new(MessageParts { queue: "comments".into(), ..Default::default() });
/// let publish = Publish {
///     route: Route { exchange: "comments.retry".into(), routing_key: "comments.retry.30s".into() },
///     expiration: None,
///     headers: EngineHeaders {
///         attempts: 1, crashes: 0, first_failure: None, last_failure: None,
///         last_error: None, reason: None, delay: None, suspect: None,
///     },
/// };
/// let properties = transport_amqp091::embed::clone_properties(&original, &publish);
/// let headers = properties.headers().as_ref().expect("the engine's headers");
/// assert!(headers.inner().contains_key("x-retry-attempts"));
/// ```
pub fn clone_properties(original: &Message, publish: &Publish) -> BasicProperties {
    let headers = publish.clone_headers(original);
    properties_to_amqp(
        original.properties(),
        &headers,
        &original.parts().native,
        publish.expiration,
    )
}

/// The engine's reading of a publisher confirm, awaited on the `PublisherConfirm` that
/// `basic_publish` returned: a plain positive confirm is [`Confirm::Ack`]; a returned
/// (unroutable `mandatory`) publish is [`Confirm::Returned`], even when the broker also
/// confirmed it; a negative confirm is [`Confirm::Nack`]; an error, or a channel not in
/// confirm mode, is [`Confirm::Failed`].
///
/// ```
/// use lapin::Confirmation;
/// use retry_core::Confirm;
/// use transport_amqp091::embed::confirm;
///
/// assert_eq!(confirm(Ok(Confirmation::Ack(None))), Confirm::Ack);
/// assert_eq!(confirm(Ok(Confirmation::Nack(None))), Confirm::Nack);
/// assert_eq!(confirm(Ok(Confirmation::NotRequested)), Confirm::Failed);
/// ```
pub fn confirm(confirmation: Result<lapin::Confirmation, lapin::Error>) -> Confirm {
    match confirmation {
        Ok(lapin::Confirmation::Ack(None)) => Confirm::Ack,
        Ok(lapin::Confirmation::Ack(Some(_)) | lapin::Confirmation::Nack(Some(_))) => {
            Confirm::Returned
        }
        Ok(lapin::Confirmation::Nack(None)) => Confirm::Nack,
        Ok(lapin::Confirmation::NotRequested) | Err(_) => Confirm::Failed,
    }
}

/// Declares every exchange, queue and binding of `plan` on `conn`, idempotently, as
/// [`AmqpTransport::provision`](crate::AmqpTransport) does: an object that exists with
/// other settings is a [`TransportError::TopologyConflict`] naming it and the argument.
/// Uses a channel of its own, closed when done. Each object is declared without asking
/// first whether it exists, so the report lists them as
/// [`declared`](ProvisionReport::declared).
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use retry_core::{RetryPolicy, TopologyPlan};
/// use std::time::Duration;
///
/// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let report = transport_amqp091::embed::provision(&conn, &TopologyPlan::new("comments", &policy)?).await?;
/// println!("declared {:?}", report.declared);
/// # Ok(()) }
/// ```
pub async fn provision(
    conn: &Connection,
    plan: &TopologyPlan,
) -> Result<ProvisionReport, TransportError> {
    crate::provision::provision(conn, plan, false).await
}

/// Deletes every queue and exchange of `plan` on `conn`, with their messages. For tests and
/// decommissioning.
///
/// ```no_run
/// # async fn f(conn: lapin::Connection, plan: retry_core::TopologyPlan) -> Result<(), retry_core::TransportError> {
/// transport_amqp091::embed::teardown(&conn, &plan).await?;
/// # Ok(()) }
/// ```
pub async fn teardown(conn: &Connection, plan: &TopologyPlan) -> Result<(), TransportError> {
    crate::provision::teardown(conn, plan).await
}
