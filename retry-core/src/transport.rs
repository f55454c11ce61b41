//! The `Transport` trait: what a broker binding implements so the driver can run on it.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::engine::{Confirm, Publish, Settlement};
use crate::message::{Delivery, Message};
use crate::time::Timestamp;
use crate::topology::TopologyPlan;

/// What a transport can do; the driver and the conformance suite read it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// The broker confirms publishes (otherwise a publish counts as confirmed once sent).
    pub publisher_confirms: bool,
    /// The broker counts deliveries of a message (quorum `x-delivery-count`, AMQP 1.0
    /// `delivery-count`).
    pub delivery_count: bool,
    /// The broker can delay a message by itself (a scheduled-delivery annotation).
    pub native_delays: bool,
    /// Queues can dead-letter to an exchange (TTL delay queues and broker rejects work).
    pub dead_letter_exchange: bool,
    /// The transport can declare a [`TopologyPlan`] itself.
    pub declares_topology: bool,
}

/// The broker's answer to a publish, as the transport saw it.
#[derive(Debug)]
pub enum PublishResult {
    /// Confirmed.
    Confirmed,
    /// Refused with a negative confirm.
    Refused,
    /// Returned as unroutable.
    Returned,
    /// Failed: no answer, a closed channel or connection, a timeout.
    Failed(TransportError),
}

impl PublishResult {
    /// The engine input for this result.
    pub fn confirm(&self) -> Confirm {
        match self {
            PublishResult::Confirmed => Confirm::Ack,
            PublishResult::Refused => Confirm::Nack,
            PublishResult::Returned => Confirm::Returned,
            PublishResult::Failed(_) => Confirm::Failed,
        }
    }
}

/// A transport failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The connection or channel is gone; it may come back.
    #[error("connection lost: {0}")]
    Connection(String),
    /// The broker already has an object declared differently.
    #[error(
        "{object} already exists with a different {argument}: broker has {existing}, plan wants {wanted}"
    )]
    TopologyConflict {
        /// The queue or exchange.
        object: String,
        /// The argument that differs.
        argument: String,
        /// The broker's value.
        existing: String,
        /// The plan's value.
        wanted: String,
    },
    /// An address the engine needs does not exist.
    #[error("{address} does not exist: {hint}")]
    MissingAddress {
        /// The queue, exchange or address.
        address: String,
        /// How to create it.
        hint: String,
    },
    /// No answer in time.
    #[error("{operation} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        operation: &'static str,
        /// How long.
        after: Duration,
    },
    /// The transport was closed.
    #[error("transport closed")]
    Closed,
    /// Anything else.
    #[error(transparent)]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

/// A broker binding the driver runs on. Implementations keep the engine's rules: a publish
/// resolves only when the broker has answered, and settling is done only when asked.
///
/// Time comes from the transport too, so a simulated broker can run on virtual time:
/// [`now`](Self::now) and [`sleep`](Self::sleep) default to the system clock and
/// `futures-timer`.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// The handle that settles one delivery.
    type Tag: Clone + Send + Sync + std::fmt::Debug + 'static;

    /// What this transport can do.
    fn capabilities(&self) -> Capabilities;

    /// Declares (or verifies) everything in `plan`; idempotent.
    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError>;

    /// Starts consuming `queue` with at most `prefetch` unsettled deliveries.
    async fn consume(&self, queue: &str, prefetch: u16) -> Result<(), TransportError>;

    /// The next delivery; `Ok(None)` once consuming has stopped for good.
    async fn recv(&self) -> Result<Option<Delivery<Self::Tag>>, TransportError>;

    /// Publishes a clone of `original` as `publish` says, and waits for the broker's answer.
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult;

    /// Settles a delivery.
    async fn settle(&self, tag: &Self::Tag, settlement: Settlement) -> Result<(), TransportError>;

    /// Stops receiving; unsettled deliveries stay with the broker.
    async fn cancel(&self) -> Result<(), TransportError>;

    /// The current time.
    fn now(&self) -> Timestamp {
        Timestamp::from_system_time(SystemTime::now())
    }

    /// A future that resolves after `duration`.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(futures_timer::Delay::new(duration))
    }
}

/// A shared transport is a transport, so a consumer can run on one while the caller keeps a
/// handle to it (to inspect it, or to run several consumers on one connection).
#[async_trait]
impl<T: Transport> Transport for std::sync::Arc<T> {
    type Tag = T::Tag;

    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        (**self).provision(plan).await
    }

    async fn consume(&self, queue: &str, prefetch: u16) -> Result<(), TransportError> {
        (**self).consume(queue, prefetch).await
    }

    async fn recv(&self) -> Result<Option<Delivery<Self::Tag>>, TransportError> {
        (**self).recv().await
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        (**self).publish(original, publish).await
    }

    async fn settle(&self, tag: &Self::Tag, settlement: Settlement) -> Result<(), TransportError> {
        (**self).settle(tag, settlement).await
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        (**self).cancel().await
    }

    fn now(&self) -> Timestamp {
        (**self).now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        (**self).sleep(duration)
    }
}
