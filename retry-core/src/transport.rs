//! The `Transport` trait: what a broker binding implements so the driver can run on it.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::Timestamp;
use crate::TopologyPlan;
use crate::gate::SoloGate;
use crate::{Confirm, Publish, Settlement};
use crate::{Delivery, Message};

/// What a transport can do; the driver and the conformance suite read it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// The broker confirms publishes (otherwise a publish counts as confirmed once sent).
    pub publisher_confirms: bool,
    /// The broker counts deliveries of a message (quorum `x-delivery-count`, AMQP 1.0
    /// `delivery-count`).
    pub delivery_count: bool,
    /// The broker can hold a message for a delay by itself: a scheduled-delivery annotation
    /// (AMQP 1.0 brokers that have one), or a redelivery delay (NATS JetStream's nak with a
    /// delay). Delayed retries then need no dead-lettering.
    pub native_delays: bool,
    /// Queues can dead-letter to an exchange (TTL delay queues and broker rejects work).
    pub dead_letter_exchange: bool,
    /// The transport can declare a [`TopologyPlan`] itself.
    pub declares_topology: bool,
}

/// The broker's answer to a publish, as the transport saw it.
#[derive(Debug)]
pub enum PublishResult {
    /// The broker confirmed it: it has the message.
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
    /// The connection or channel is gone; it may come back. Made with
    /// [`connection_lost`](Self::connection_lost) or
    /// [`connection_failed`](Self::connection_failed).
    #[error("connection lost: {context}")]
    Connection {
        /// What was being done, on what, when it was lost.
        context: String,
        /// The broker client's own error, kept whole as the source.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
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
        /// How long it waited before giving up.
        after: Duration,
    },
    /// The plan asks for something this transport, or its broker, cannot do safely.
    #[error("{what} is not supported here: {why}")]
    Unsupported {
        /// What was asked for.
        what: String,
        /// Why it cannot be done, and what to do instead.
        why: String,
    },
    /// A TLS connection was refused, by the client's checks or by the server: never
    /// retried on plain TCP.
    #[error("TLS with {endpoint} failed: {failure}")]
    Tls {
        /// The host and port (never a user or password).
        endpoint: String,
        /// Which check failed.
        failure: crate::TlsFailure,
    },
    /// A [`fetch`](Transport::fetch) gave up with a message possibly on its way that the
    /// transport cannot keep for the next fetch (its `get-ok` or pull was lost with its
    /// channel or connection): the broker hands that message out again redelivered,
    /// through no crash of its own. The [`Consumer`](crate::Consumer) tries again, and
    /// excuses the next suspect from `queue` that shows a crash, once (see
    /// [`Engine::excuse_lost_fetch`](crate::Engine::excuse_lost_fetch)).
    ///
    /// ```
    /// use retry_core::TransportError;
    ///
    /// let e = TransportError::FetchLost {
    ///     queue: "comments.suspect".into(),
    ///     context: "the channel closed before its get-ok".into(),
    /// };
    /// assert_eq!(
    ///     e.to_string(),
    ///     "a fetch from comments.suspect was lost in flight: the channel closed before its get-ok"
    /// );
    /// ```
    #[error("a fetch from {queue} was lost in flight: {context}")]
    FetchLost {
        /// The queue fetched from.
        queue: String,
        /// How it was lost.
        context: String,
    },
    /// The transport was closed.
    #[error("transport closed")]
    Closed,
    /// A failure none of the other variants describe, kept whole so its chain of causes
    /// survives.
    #[error(transparent)]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl TransportError {
    /// The connection or channel is gone, for a reason the transport words itself.
    ///
    /// ```
    /// use retry_core::TransportError;
    ///
    /// let e = TransportError::connection_lost("the broker closed the channel");
    /// assert_eq!(e.to_string(), "connection lost: the broker closed the channel");
    /// ```
    pub fn connection_lost(context: impl Into<String>) -> Self {
        TransportError::Connection {
            context: context.into(),
            source: None,
        }
    }

    /// The connection or channel is gone, as the client library's `source` error says; it is
    /// kept as the error's source, not copied into its message, so a chain names it once.
    ///
    /// ```
    /// use std::error::Error as _;
    /// use retry_core::TransportError;
    ///
    /// let io = std::io::Error::other("connection reset by peer");
    /// let e = TransportError::connection_failed("publishing to comments.retry.30s", io);
    /// assert_eq!(e.to_string(), "connection lost: publishing to comments.retry.30s");
    /// assert_eq!(e.source().unwrap().to_string(), "connection reset by peer");
    /// ```
    pub fn connection_failed(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        TransportError::Connection {
            context: context.into(),
            source: Some(source.into()),
        }
    }
}

/// A broker binding the driver runs on. Implementations keep the engine's rules: a publish
/// resolves only when the broker has answered, and settling is done only when asked.
///
/// A consumer has two intakes. The work queue is read through a [`Subscription`] made by
/// [`consume`](Self::consume), with up to `prefetch` deliveries held at once. The isolation
/// queue is read one message at a time with [`fetch`](Self::fetch), only while nothing else
/// runs, so that a delivery fetched from it is the only thing its consumer is doing (see the
/// guide, `docs/concepts.md`, "Suspects and crashes: crash attribution").
///
/// Time comes from the transport too, so a simulated broker can run on virtual time:
/// [`now`](Self::now) and [`sleep`](Self::sleep) default to the system clock and
/// `futures-timer`.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// The handle that settles one delivery. It names the subscription (or fetch) the
    /// delivery came from, so [`settle`](Self::settle) reaches the right channel or link.
    type Tag: Clone + Send + Sync + std::fmt::Debug + 'static;

    /// A running subscription to one queue.
    type Subscription: Subscription<Tag = Self::Tag>;

    /// What this transport can do.
    fn capabilities(&self) -> Capabilities;

    /// Declares (or verifies) everything in `plan`; idempotent. A transport that cannot
    /// declare (see [`Capabilities::declares_topology`]) verifies instead, as
    /// [`verify`](Self::verify) does.
    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError>;

    /// Checks, without declaring anything, that every address the engine can send to under
    /// `plan` exists, and fails with [`TransportError::MissingAddress`] naming what does
    /// not. The [`Consumer`](crate::Consumer) calls it before consuming when
    /// [provisioning is off](crate::ConsumerBuilder::with_provision); with provisioning on it
    /// calls [`provision`](Self::provision) instead, which must verify as much.
    ///
    /// The default does nothing and returns `Ok(())`. That is right for a transport whose
    /// broker reports an unroutable publish, as AMQP 0-9-1 does with `mandatory` (the
    /// publish comes back [`PublishResult::Returned`] and the original is requeued), and for
    /// one that cannot lose a publish (the in-memory broker). A transport whose broker
    /// accepts a publish to a missing queue and drops it, such as RabbitMQ's AMQP 1.0
    /// plugin, must implement it, and must never send to an address it has not verified.
    /// A transport that wraps another must forward it, or the default hides the inner
    /// transport's check.
    ///
    /// ```
    /// # use async_trait::async_trait;
    /// # use retry_core::*;
    /// # use std::time::Duration;
    /// /// A broker that drops a publish to a missing queue, so it checks first.
    /// struct Broker {
    ///     queues: Vec<String>,
    /// }
    ///
    /// #[async_trait]
    /// impl Transport for Broker {
    /// #   type Tag = u64;
    /// #   type Subscription = Broker;
    /// #   fn capabilities(&self) -> Capabilities { Capabilities::default() }
    /// #   async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
    /// #       self.verify(plan).await
    /// #   }
    ///     async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
    ///         let missing: Vec<&str> = plan
    ///             .queues()
    ///             .iter()
    ///             .map(|q| q.name.as_str())
    ///             .filter(|name| !self.queues.iter().any(|q| q == name))
    ///             .collect();
    ///         if missing.is_empty() {
    ///             return Ok(());
    ///         }
    ///         Err(TransportError::MissingAddress {
    ///             address: missing.join(", "),
    ///             hint: "declare the topology first".into(),
    ///         })
    ///     }
    ///     // ...
    /// #   async fn consume(&self, _: &str, _: u16) -> Result<Broker, TransportError> {
    /// #       unreachable!("never consumes: the plan does not verify")
    /// #   }
    /// #   async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #   async fn ready(&self, _: &str, _: Duration) -> Result<(), TransportError> { Ok(()) }
    /// #   async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
    /// #   async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
    /// }
    /// # #[async_trait]
    /// # impl Subscription for Broker {
    /// #     type Tag = u64;
    /// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
    /// # }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// // Someone deleted the delay queue: every queue but that one exists.
    /// let queues = ["comments", "comments.suspect", "comments.crash.30s", "comments.parking"];
    /// let broker = Broker { queues: queues.map(String::from).to_vec() };
    /// async fn handle(_: Message) -> Result<(), HandlerError> { Ok(()) }
    ///
    /// // With provisioning off the consumer still verifies, and refuses to start.
    /// let err = Consumer::builder(broker, "comments", policy, handle)
    ///     .with_provision(false)
    ///     .build()?
    ///     .run(std::future::pending())
    ///     .await
    ///     .unwrap_err();
    /// let ConsumerError::Verify { source: TransportError::MissingAddress { address, .. }, .. } = err
    /// else {
    ///     panic!("{err}")
    /// };
    /// assert_eq!(address, "comments.retry.30s");
    /// # Ok(())
    /// # }
    /// ```
    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        let _ = plan;
        Ok(())
    }

    /// Starts consuming `queue` with at most `prefetch` unsettled deliveries. Each call makes
    /// a new subscription with a channel or link, prefetch and acknowledgement batching of
    /// its own: subscriptions never share or replace each other.
    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self::Subscription, TransportError>;

    /// Takes at most one message from `queue` (`basic.get`, a credit of one that is then
    /// drained, a get from the model), or `Ok(None)` when the queue has nothing ready. The
    /// delivery is unsettled until [`settle`](Self::settle) settles it, at once (never
    /// batched); if the connection goes away first, the broker puts it back redelivered.
    ///
    /// A fetch that gives up while a message may be on its way keeps that message for the
    /// next fetch from `queue` and fails with [`TransportError::Timeout`]; when it cannot
    /// keep it (the message comes back to the queue redelivered), it fails with
    /// [`TransportError::FetchLost`], so that the consumer does not charge the message a
    /// crash it never caused.
    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<Self::Tag>>, TransportError>;

    /// Resolves once `queue` may have a message ready, without taking any: at once if it
    /// has one, otherwise when one arrives. A transport that cannot watch a queue looks at
    /// it every `poll`; one that cannot even count its messages resolves after `poll`, and
    /// the driver finds out with a [`fetch`](Self::fetch). Dropping the future stops the
    /// watch.
    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError>;

    /// Publishes a clone of `original` as `publish` says, and waits for the broker's answer.
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult;

    /// Settles a delivery of a subscription or of a fetch. A subscription may batch
    /// acknowledgements, so `Ok` may mean only that the ack is queued: see
    /// [`Subscription::flush`]. A tag whose connection or link has gone since fails with
    /// [`TransportError::Connection`]: the broker has that delivery back.
    async fn settle(&self, tag: &Self::Tag, settlement: Settlement) -> Result<(), TransportError>;

    /// Starts a [`QueueWalk`] of `queue`: its messages read one at a time, each at most once,
    /// and those the walk leaves put back when it ends. The [`ParkingLot`](crate::ParkingLot)
    /// reads its parking queue this way.
    ///
    /// The default reads with [`fetch`](Self::fetch), keeps the tag of each delivery left and
    /// requeues them one by one at the end, so it holds one tag per message left. A transport
    /// that can put back every delivery of a walk at once overrides it: the AMQP 0-9-1
    /// transport walks on a channel of its own, keeps nothing per message left, and closes
    /// the channel at the end.
    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<Self::Tag> + 'a>, TransportError> {
        Ok(Box::new(FetchWalk {
            transport: self,
            queue: queue.to_owned(),
            left: Vec::new(),
        }))
    }

    /// Ends the transport's connections: what its subscriptions held unsettled goes back to
    /// the broker, and every call after it fails. The default does nothing, for a transport
    /// that holds no connection. A transport that wraps another must forward it.
    async fn close(&self) {}

    /// The current time.
    fn now(&self) -> Timestamp {
        Timestamp::from_system_time(SystemTime::now())
    }

    /// A future that resolves after `duration`.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(futures_timer::Delay::new(duration))
    }

    /// The [`SoloGate`] a [`Consumer`](crate::Consumer) on this transport runs suspects alone
    /// through when it is given none
    /// ([`with_solo_gate`](crate::ConsumerBuilder::with_solo_gate)).
    ///
    /// The default, `None`, stands for [`SoloGate::process`]: a crash takes the whole
    /// process down, so every consumer of the process shares one gate. A transport whose
    /// consumers live in something smaller than the process returns a gate of that, as the
    /// in-memory broker does (one gate per broker): its consumers run in virtual time, and
    /// waiting on a gate held by a consumer of another test, in real time, would stall them.
    /// A transport that wraps another must forward it.
    ///
    /// ```
    /// # use async_trait::async_trait;
    /// # use retry_core::*;
    /// # use std::time::Duration;
    /// /// A simulated broker: its consumers share a gate of its own, not the process's.
    /// struct Simulated {
    ///     gate: SoloGate,
    /// }
    ///
    /// #[async_trait]
    /// impl Transport for Simulated {
    /// #   type Tag = u64;
    /// #   type Subscription = Simulated;
    /// #   fn capabilities(&self) -> Capabilities { Capabilities::default() }
    /// #   async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
    /// #   async fn consume(&self, _: &str, _: u16) -> Result<Simulated, TransportError> {
    /// #       Ok(Simulated { gate: self.gate.clone() })
    /// #   }
    /// #   async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #   async fn ready(&self, _: &str, _: Duration) -> Result<(), TransportError> { Ok(()) }
    /// #   async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
    /// #   async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
    ///     fn solo_gate(&self) -> Option<SoloGate> {
    ///         Some(self.gate.clone())
    ///     }
    ///     // ...
    /// }
    /// # #[async_trait]
    /// # impl Subscription for Simulated {
    /// #     type Tag = u64;
    /// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
    /// # }
    ///
    /// async fn handle(_: Message) -> Result<(), HandlerError> { Ok(()) }
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let gate = SoloGate::new();
    /// let simulated = Simulated { gate: gate.clone() };
    /// let consumer = Consumer::builder(simulated, "orders", policy, handle).build()?;
    /// assert!(consumer.solo_gate().same_as(&gate));
    /// assert!(!consumer.solo_gate().same_as(&SoloGate::process()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn solo_gate(&self) -> Option<SoloGate> {
        None
    }
}

/// A walk of one queue, made by [`Transport::walk`]: its ready messages read one at a time
/// in queue order, each at most once, and every delivery the walk
/// [leaves](Self::leave) put back where it was when it [ends](Self::end).
///
/// A delivery left stays unsettled with the broker until the walk ends: that is what keeps
/// the walk from reading it again, and what puts it back in its place. The broker therefore
/// holds every message left, unacknowledged, for the length of the walk (a broker's
/// `consumer_timeout` applies); the caller holds one message at a time, since it settles or
/// leaves each delivery before it reads the next. If the connection goes away, the broker
/// puts back everything the walk held.
///
/// ```
/// # use retry_core::*;
/// # async fn demo<T: Transport>(transport: &T) -> Result<(), TransportError> {
/// // Count a queue's messages that carry a header, and leave them all in place.
/// let mut walk = transport.walk("comments.parking").await?;
/// let mut tenants = 0;
/// while let Some(delivery) = walk.next().await? {
///     tenants += usize::from(delivery.message.headers().get("tenant").is_some());
///     walk.leave(delivery.tag);
/// }
/// walk.end().await?;
/// # Ok(()) }
/// ```
#[async_trait]
pub trait QueueWalk<Tag>: Send {
    /// The next message, or `Ok(None)` when the queue has no more ready for this walk.
    /// Settle or [leave](Self::leave) each delivery before reading the next.
    async fn next(&mut self) -> Result<Option<Delivery<Tag>>, TransportError>;

    /// Leaves a delivery of this walk where it was: unsettled until [`end`](Self::end), so
    /// the walk does not read it again.
    fn leave(&mut self, tag: Tag);

    /// Acknowledges (removes) a delivery of this walk, at once. A tag whose connection has
    /// gone fails with [`TransportError::Connection`]: the broker has that delivery back.
    async fn ack(&mut self, tag: Tag) -> Result<(), TransportError>;

    /// Puts back every delivery left, each in its place, and ends the walk. Deliveries whose
    /// connection has gone are back already, and are no error. Calling it again does
    /// nothing.
    async fn end(&mut self) -> Result<(), TransportError>;
}

/// [`Transport::walk`]'s default: [`Transport::fetch`], and a requeue of each tag left.
struct FetchWalk<'a, T: Transport + ?Sized> {
    transport: &'a T,
    queue: String,
    left: Vec<T::Tag>,
}

#[async_trait]
impl<T: Transport + ?Sized> QueueWalk<T::Tag> for FetchWalk<'_, T> {
    async fn next(&mut self) -> Result<Option<Delivery<T::Tag>>, TransportError> {
        self.transport.fetch(&self.queue).await
    }

    fn leave(&mut self, tag: T::Tag) {
        self.left.push(tag);
    }

    async fn ack(&mut self, tag: T::Tag) -> Result<(), TransportError> {
        self.transport.settle(&tag, Settlement::Ack).await
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        let mut first_error = None;
        // Last read first: a broker that puts a requeued message back in its place (RabbitMQ)
        // finds each place at the head, and one that puts it at the head restores the order.
        for tag in std::mem::take(&mut self.left).into_iter().rev() {
            match self.transport.settle(&tag, Settlement::Requeue).await {
                Ok(()) | Err(TransportError::Connection { .. } | TransportError::Closed) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// A running subscription to one queue, made by [`Transport::consume`]. It owns its channel
/// or link, its prefetch and its acknowledgement batching. Dropping it without
/// [`cancel`](Self::cancel) leaves its unsettled deliveries with the broker, which returns
/// them when the transport's connection closes.
#[async_trait]
pub trait Subscription: Send + Sync + 'static {
    /// The handle that settles one delivery; the transport's [`Transport::Tag`].
    type Tag: Clone + Send + Sync + std::fmt::Debug + 'static;

    /// The next delivery; `Ok(None)` once the subscription has stopped for good (it was
    /// cancelled, or the broker cancelled it). A lost connection is an error, and the next
    /// call resumes on the recovered one, if the transport recovers.
    async fn recv(&self) -> Result<Option<Delivery<Self::Tag>>, TransportError>;

    /// Stops new deliveries. Deliveries already received can still be settled.
    async fn cancel(&self) -> Result<(), TransportError>;

    /// Sends every settlement settled but not yet sent (batched acknowledgements), and
    /// returns once they are written. After `flush`, every delivery whose
    /// [`settle`](Transport::settle) returned `Ok` is settled on the broker, unless the
    /// connection dropped, which this reports.
    async fn flush(&self) -> Result<(), TransportError>;
}

/// A shared transport is a transport, so a consumer can run on one while the caller keeps a
/// handle to it (to inspect it, or to run several consumers on one connection).
#[async_trait]
impl<T: Transport> Transport for std::sync::Arc<T> {
    type Tag = T::Tag;
    type Subscription = T::Subscription;

    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        (**self).provision(plan).await
    }

    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        (**self).verify(plan).await
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self::Subscription, TransportError> {
        (**self).consume(queue, prefetch).await
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<Self::Tag>>, TransportError> {
        (**self).fetch(queue).await
    }

    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        (**self).ready(queue, poll).await
    }

    // The two calls of every delivery hand back the inner transport's future as it is,
    // rather than boxing a second future around it: written as `async_trait` expands an
    // `async fn`, so the trait sees the same methods.
    fn publish<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        original: &'life1 Message,
        publish: &'life2 Publish,
    ) -> Pin<Box<dyn Future<Output = PublishResult> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        (**self).publish(original, publish)
    }

    fn settle<'life0, 'life1, 'async_trait>(
        &'life0 self,
        tag: &'life1 Self::Tag,
        settlement: Settlement,
    ) -> Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        (**self).settle(tag, settlement)
    }

    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<Self::Tag> + 'a>, TransportError> {
        (**self).walk(queue).await
    }

    async fn close(&self) {
        (**self).close().await
    }

    fn now(&self) -> Timestamp {
        (**self).now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        (**self).sleep(duration)
    }

    fn solo_gate(&self) -> Option<SoloGate> {
        (**self).solo_gate()
    }
}
