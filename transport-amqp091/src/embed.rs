//! The pieces a lapin consumer of your own needs to run [`retry_core::Engine`] without
//! [`AmqpTransport`](crate::AmqpTransport): read a delivery as the engine does, write a
//! clone's properties, publish clones and read their confirms, and declare or delete a plan
//! on a plain [`lapin::Connection`].
//!
//! Your code keeps its own `basic_consume` and `basic_ack`; the engine decides.
//! `cargo run -p examples --example 06_embedded` is a complete consumer built this way.
//!
//! **Publishing clones.** lapin 4.12 can hand a `basic.return` to the wrong publish when
//! several are in flight on one channel, so a clone that reached no queue can come back as a
//! plain positive confirm, and acknowledging its original then loses the message. Either
//! publish one clone at a time per channel, awaiting each confirm before the next publish
//! (as below; [`confirm`] reads it), or publish with [`Publisher`], which pairs every
//! confirm with its return by a stamp and may have any number in flight.
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

use std::time::Duration;

use lapin::{BasicProperties, Connection};
use retry_core::{
    Confirm, Delivery, Message, Publish, PublishResult, TopologyPlan, TransportError,
};

use crate::ProvisionReport;
use crate::convert::{properties_to_amqp, received};
use crate::publisher::PublisherSlot;

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
    received(delivery, queue, None, |tag, _| tag)
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
/// **Only sound with one publish in flight on the channel**: lapin attaches a
/// `basic.return` to whichever confirm it completes next, so with several in flight the
/// return of an unroutable clone can come with another publish's confirm and this reads
/// [`Confirm::Ack`] for a clone that reached no queue. Await each confirm before the next
/// `basic_publish` on that channel, never drop one unread (a later confirm would then carry
/// its return), or publish with [`Publisher`].
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

/// Publishes the engine's clones on a confirm channel of its own, any number in flight at
/// once, each result paired with the broker's `basic.return`s by a stamp the clone carries
/// (the [`PUBLISH_ID`](retry_core::headers::PUBLISH_ID) header, see
/// [`ReturnMatcher`](retry_core::ReturnMatcher)) rather than by lapin's pairing. This is
/// how [`AmqpTransport`](crate::AmqpTransport) publishes.
///
/// * Clones are published `mandatory` to `publish.route`, with `original`'s body and
///   [`clone_properties`] plus the stamp.
/// * Each publish is sent and its confirm awaited in a tokio task of its own (call it
///   within a tokio runtime): dropping the future of [`publish`](Self::publish) stops
///   waiting for the result, never the reading of the confirm, which may carry another
///   clone's return.
/// * A confirm that does not come within the confirm timeout fails every publish in flight
///   on the channel, which is closed; so does a channel error or a lost connection. The
///   next publish opens a new channel on the connection it is given. A failed publish
///   means: requeue the original (a duplicate at worst, never a loss).
///
/// ```no_run
/// # async fn f(conn: lapin::Connection, engine: &mut retry_core::Engine<retry_core::Delivery<u64>>) -> Result<(), Box<dyn std::error::Error>> {
/// use retry_core::{Action, Timestamp};
/// use std::time::Duration;
/// use transport_amqp091::embed;
///
/// let publisher = embed::Publisher::new(Duration::from_secs(30));
/// let now = || Timestamp::from_system_time(std::time::SystemTime::now());
/// while let Some(action) = engine.poll_action() {
///     if let Action::Publish { delivery, publish } = action {
///         let original = engine.data(delivery).expect("in flight").message.clone();
///         let result = publisher.publish(&conn, &original, &publish).await;
///         engine.handle_confirm(now(), delivery, result.confirm())?;
///     }
/// }
/// # Ok(()) }
/// ```
pub struct Publisher {
    slot: PublisherSlot,
    confirm_timeout: Duration,
}

impl Publisher {
    /// A publisher that gives a confirm `confirm_timeout` (the transport's default is 30 s).
    /// It opens its channel on the first publish.
    pub fn new(confirm_timeout: Duration) -> Self {
        Publisher {
            slot: PublisherSlot::default(),
            confirm_timeout,
        }
    }

    /// Publishes `original`'s clone as `publish` asks on `connection` and waits for the
    /// broker's answer: [`PublishResult::Confirmed`] only when the clone reached a queue and
    /// was confirmed. Feed [`PublishResult::confirm`] to the engine.
    ///
    /// The channel is opened on `connection` and kept while it can be used (open, or its
    /// connection recovering); once it cannot (after a channel error, a confirm timeout or
    /// its connection's close), the next publish opens one on the `connection` given then.
    pub async fn publish(
        &self,
        connection: &Connection,
        original: &Message,
        publish: &Publish,
    ) -> PublishResult {
        self.slot
            .publish(connection, 0, original, publish, self.confirm_timeout)
            .await
    }
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}
