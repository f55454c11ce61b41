//! `MemoryTransport`: one client connection to the in-memory broker, implementing the retry
//! engine's `Transport` trait on virtual time.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use retry_core::returns::stamp_headers;
use retry_core::{
    Capabilities, Confirm, Delivery, Message, Publish, PublishResult, Settlement, SoloGate,
    Timestamp, TopologyPlan, Transport, TransportError,
};

use crate::broker::Broker;
use crate::broker::core::State;
use crate::broker::error::BrokerError;
use crate::broker::fault::FetchFault;
use crate::broker::message::{MessageKey, Outgoing, Publishing};
use crate::broker::trace::{EventKind, MessageRef, PublishOutcome, Publisher};
use crate::transport::confirms::{self, SharedConfirms, YieldOnce};
use crate::transport::delivery::{DeliveryTag, identity_of, receive};
use crate::transport::link::{Link, LinkHandle, SubscriptionState, lock_link};
use crate::transport::subscription::MemorySubscription;

impl Broker {
    /// Opens a client connection: a [`MemoryTransport`] for the retry engine's driver.
    pub fn connect(&self) -> MemoryTransport {
        let id = self.shared.with(State::open_connection);
        MemoryTransport::new(self.clone(), id)
    }
}

/// A client connection (with one channel in confirm mode) to a [`Broker`]: the retry
/// engine's [`Transport`] on the in-memory broker and its virtual clock.
///
/// Each [`consume`](Transport::consume) starts a consumer of its own, with its own prefetch,
/// returned as a [`MemorySubscription`]. [`fetch`](Transport::fetch) takes one message as
/// `basic.get` does, and [`ready`](Transport::ready) watches a queue exactly: it wakes when a
/// message becomes ready there, with no polling and no virtual time spent.
///
/// Like a lapin connection with automatic recovery, it reopens itself after the broker
/// closes it: the first `recv` of a subscription after the close fails with
/// [`TransportError::Connection`], the next one opens a new connection and consumes again.
/// Deliveries held across the close come back redelivered, and settling one of them fails
/// (its tag belongs to the closed connection). [`without_recovery`] turns that off.
///
/// Dropping it closes the connection, as a process exit does: the broker returns its
/// unacknowledged deliveries to their queues flagged redelivered.
///
/// ```
/// use futures::FutureExt;
/// use retry_core::{Settlement, Subscription, Transport};
/// use transport_memory::{Broker, Outgoing, QueueOptions};
///
/// let broker = Broker::new();
/// broker.declare_queue("work", QueueOptions::new())?;
/// broker.publish(Outgoing::to_queue("work", b"hi".to_vec()))?;
///
/// // Nothing here waits on the clock, so each future completes on its first poll.
/// let conn = broker.connect();
/// let subscription = conn.consume("work", 10).now_or_never().expect("ready")?;
/// let delivery = subscription.recv().now_or_never().expect("ready")?.expect("a delivery");
/// assert_eq!(delivery.message.body(), b"hi");
/// assert!(!delivery.facts.redelivered);
/// conn.settle(&delivery.tag, Settlement::Ack).now_or_never().expect("ready")?;
/// assert_eq!(broker.stats("work").map(|s| (s.ready, s.unacked)), Some((0, 0)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`without_recovery`]: MemoryTransport::without_recovery
pub struct MemoryTransport {
    broker: Broker,
    link: Arc<Mutex<Link>>,
    confirms: SharedConfirms,
    /// How long a fetch's answer takes to arrive.
    fetch_latency: Duration,
    /// A message a fetch took but gave up on before it arrived: the next fetch gets it.
    unclaimed: Mutex<Option<Delivery<DeliveryTag>>>,
}

impl fmt::Debug for MemoryTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTransport")
            .field("connection", &self.connection_id())
            .finish()
    }
}

impl MemoryTransport {
    fn new(broker: Broker, id: usize) -> Self {
        MemoryTransport {
            broker,
            link: Arc::new(Mutex::new(Link::new(id))),
            confirms: SharedConfirms::default(),
            fetch_latency: Duration::ZERO,
            unclaimed: Mutex::new(None),
        }
    }

    /// The same connection, whose fetches answer `latency` of virtual time after the broker
    /// handed them their message, as a `basic.get` over a network does. A shutdown can then
    /// come while a fetch is under way.
    pub fn with_fetch_latency(mut self, latency: Duration) -> Self {
        self.fetch_latency = latency;
        self
    }

    fn link(&self) -> MutexGuard<'_, Link> {
        lock_link(&self.link)
    }

    fn id(&self) -> usize {
        self.link().id
    }

    pub(crate) fn link_handle(&self) -> LinkHandle {
        LinkHandle::new(&self.link)
    }

    /// The same connection, without automatic recovery: once closed, it stays closed and
    /// every operation fails.
    pub fn without_recovery(self) -> Self {
        self.link().recover = false;
        self
    }

    /// The id of the connection in use, as the trace and [`Broker::close_connection`] name
    /// it. It changes when the transport recovers.
    pub fn connection_id(&self) -> u64 {
        self.id() as u64
    }

    /// The broker.
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// Whether the connection in use is open.
    pub fn is_open(&self) -> bool {
        self.broker.is_open(self.connection_id())
    }

    /// Publishes a message through this connection, with confirms; injected faults apply.
    pub fn publish_message(&self, message: Outgoing) -> PublishResult {
        self.publish_inner(Publishing::from(message))
    }

    /// Settles a delivery without awaiting: for tests that drive the broker by hand.
    pub fn settle_now(&self, tag: &DeliveryTag, settlement: Settlement) -> Result<(), BrokerError> {
        let id = self.id();
        if tag.connection != id as u64 {
            // On a recovered connection an old tag means nothing; the broker already took
            // the delivery back when the old connection closed.
            return Err(BrokerError::ConnectionClosed(format!(
                "delivery tag {} belongs to closed connection {}",
                tag.tag, tag.connection
            )));
        }
        self.broker
            .shared
            .with(|s| s.settle(id, tag.tag, settlement))
    }

    fn publish_inner(&self, p: Publishing) -> PublishResult {
        let id = self.id();
        self.broker.shared.with(|s| {
            if let Some(reason) = s.connections().closed(id) {
                let reason = reason.to_string();
                if s.tracing() {
                    let (key, label) = match p.identity.clone() {
                        Some(identity) => identity,
                        None => (MessageKey(0), Arc::from("?")),
                    };
                    let why = Arc::from(reason.as_str());
                    s.record(|| EventKind::Published {
                        message: MessageRef { key, label },
                        by: Publisher::Connection(id as u64),
                        exchange: p.exchange.clone(),
                        routing_key: p.routing_key.clone(),
                        outcome: PublishOutcome::Failed(why),
                    });
                }
                return PublishResult::Failed(TransportError::connection_lost(reason));
            }
            match s.publish(Publisher::Connection(id as u64), p) {
                Ok(Confirm::Ack) => PublishResult::Confirmed,
                Ok(Confirm::Nack) => PublishResult::Refused,
                Ok(Confirm::Returned) => PublishResult::Returned,
                Ok(Confirm::Failed) => PublishResult::Failed(TransportError::Timeout {
                    operation: "publisher confirm",
                    after: Duration::ZERO,
                }),
                Err(e) => {
                    // A publish to a missing exchange is a channel error: the channel, and
                    // with it every unacknowledged delivery, is gone.
                    s.close_connection(id, &e.to_string());
                    PublishResult::Failed(e.into())
                }
            }
        })
    }

    /// Fails with a lost connection when the fault `injected` (drawn on the broker) says so.
    fn injected(
        &self,
        queue: &str,
        doing: &str,
        injected: fn(&mut State, &str) -> bool,
    ) -> Result<(), TransportError> {
        if self.broker.shared.with(|s| injected(s, queue)) {
            return Err(TransportError::connection_lost(format!(
                "{doing} {queue}: connection dropped (injected)"
            )));
        }
        Ok(())
    }

    /// The open connection to use for a new operation: a closed one is recovered first
    /// (unless recovery is off).
    pub(crate) fn ensure_open(&self) -> Result<usize, TransportError> {
        let mut link = self.link();
        self.broker.shared.with(|s| {
            if let Some(reason) = s.connections().closed(link.id) {
                if !link.recover {
                    return Err(TransportError::connection_lost(reason.to_string()));
                }
                link.recover(s)?;
            }
            Ok(link.id)
        })
    }
}

impl Drop for MemoryTransport {
    fn drop(&mut self) {
        let id = self.id();
        self.broker
            .shared
            .with(|s| s.close_connection(id, "client went away"));
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    type Tag = DeliveryTag;
    type Subscription = MemorySubscription;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            publisher_confirms: true,
            delivery_count: true,
            native_delays: false,
            dead_letter_exchange: true,
            declares_topology: true,
        }
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.ensure_open()?;
        self.broker.provision(plan).map_err(TransportError::from)
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<MemorySubscription, TransportError> {
        let id = self.ensure_open()?;
        self.injected(queue, "subscribing to", State::fail_subscribe)?;
        let consumer = self
            .broker
            .shared
            .with(|s| s.consume(id, queue, prefetch))
            .map_err(TransportError::from)?;
        let mut link = self.link();
        link.subscriptions.push(SubscriptionState {
            queue: queue.to_owned(),
            prefetch,
            connection: id,
            consumer,
            cancelled: false,
            close_reported: false,
        });
        Ok(MemorySubscription::new(
            self.broker.clone(),
            self.link.clone(),
            link.subscriptions.len() - 1,
        ))
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        let id = self.ensure_open()?;
        // Handed over even if its connection has closed since, as a client library hands
        // over what it received before a drop: the driver runs it, its settle fails, and the
        // process knows why the broker's copy comes back redelivered.
        if let Some(delivery) = lock(&self.unclaimed).take() {
            return Ok(Some(delivery));
        }
        let (got, fault) = self.broker.shared.with(|s| {
            let got = s.get(id, queue, receive)?;
            let fault = if got.is_some() {
                s.fetch_fault(queue)
            } else {
                None
            };
            Ok::<_, BrokerError>((got, fault))
        })?;
        if !self.fetch_latency.is_zero() {
            self.broker.sleep(self.fetch_latency).await;
        }
        match fault {
            None => Ok(got),
            Some(FetchFault::Late) => {
                *lock(&self.unclaimed) = got;
                Err(TransportError::Timeout {
                    operation: "fetch",
                    after: self.fetch_latency,
                })
            }
            Some(FetchFault::Lost) => {
                // The answer never arrives: the client gives up on the channel, and the
                // broker puts the message back redelivered, at its place (the head).
                if let Some(delivery) = got {
                    let tag = delivery.tag.tag;
                    self.broker.shared.with(|s| s.requeue_lost_fetch(id, tag));
                }
                Err(TransportError::FetchLost {
                    queue: queue.to_owned(),
                    context: "its answer was lost with its channel (injected)".to_owned(),
                })
            }
        }
    }

    async fn ready(&self, queue: &str, _poll: Duration) -> Result<(), TransportError> {
        self.injected(queue, "watching", State::fail_watch)?;
        futures::future::poll_fn(|cx| {
            match self.broker.shared.with(|s| s.watch(queue, cx.waker())) {
                Ok(true) => Poll::Ready(Ok(())),
                Ok(false) => Poll::Pending,
                Err(e) => Poll::Ready(Err(TransportError::from(e))),
            }
        })
        .await
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        let mut headers = publish.clone_headers(original);
        let (identity, batched) = self
            .broker
            .shared
            .with(|s| (identity_of(s, original), s.faults().misattributes()));
        // With returns misattributed, answers come in batches and are paired by stamp.
        let stamp = batched.then(|| {
            let stamp = confirms::lock(&self.confirms).register();
            stamp_headers(&mut headers, stamp);
            stamp
        });
        let result = self.publish_inner(Publishing {
            identity,
            exchange: publish.route.exchange.clone(),
            routing_key: publish.route.routing_key.clone(),
            body: original.body().to_vec(),
            properties: original.properties().clone(),
            headers,
            expiration: publish.expiration,
            mandatory: true,
        });
        let Some(stamp) = stamp else {
            return result;
        };
        confirms::lock(&self.confirms).answered(stamp, &result);
        YieldOnce::new().await;
        if confirms::lock(&self.confirms).pending() {
            let shuffle = self.broker.shared.with(|s| s.faults().on_confirm_batch());
            let misattributed = confirms::lock(&self.confirms).hand_over(shuffle);
            if misattributed > 0 {
                let description = Arc::from(format!(
                    "{misattributed} returns handed to another publish's confirm"
                ));
                self.broker
                    .shared
                    .with(|s| s.record(|| EventKind::Fault { description }));
            }
        }
        let verdict =
            futures::future::poll_fn(|cx| confirms::lock(&self.confirms).poll_verdict(stamp, cx))
                .await;
        match (verdict, result) {
            // The broker's own error says more than the verdict.
            (Confirm::Failed, failed @ PublishResult::Failed(_)) => failed,
            (verdict, _) => confirms::result_of(verdict),
        }
    }

    async fn settle(
        &self,
        tag: &DeliveryTag,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        self.settle_now(tag, settlement)
            .map_err(TransportError::from)
    }

    /// Closes the connection for good, as a drop does, and turns recovery off
    /// ([`without_recovery`](MemoryTransport::without_recovery)): its unacknowledged
    /// deliveries go back to their queues flagged redelivered, its consumers are cancelled,
    /// and every call after it fails.
    async fn close(&self) {
        self.link().recover = false;
        let id = self.id();
        self.broker
            .shared
            .with(|s| s.close_connection(id, "closed by the client"));
    }

    fn now(&self) -> Timestamp {
        self.broker.now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(self.broker.sleep(duration))
    }

    /// The broker's gate: every consumer on this broker shares it, and no consumer
    /// elsewhere, so tests side by side in one binary never wait on each other in virtual
    /// time.
    fn solo_gate(&self) -> Option<SoloGate> {
        Some(self.broker.shared.solo_gate().clone())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
