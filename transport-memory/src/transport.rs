//! `MemoryTransport`: one client connection to the in-memory broker, implementing the retry
//! engine's `Transport` trait on virtual time.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use retry_core::headers::{Origin, clone_headers};
use retry_core::{
    Capabilities, Confirm, Delivery, Message, Publish, PublishResult, Settlement, Subscription,
    Timestamp, TopologyPlan, Transport, TransportError,
};

use crate::broker::{Broker, Publishing, message_address};
use crate::error::BrokerError;
use crate::message::Outgoing;
use crate::trace::{EventKind, MessageRef, PublishOutcome, Publisher};

/// The handle that settles one delivery: its connection and its delivery tag there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeliveryTag {
    /// The connection it was delivered on.
    pub connection: u64,
    /// The delivery tag, from 1 on each connection.
    pub tag: u64,
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
}

/// A view of which connection a transport is using, kept by whoever watches it from outside
/// (the simulation, to crash or disconnect the consumer that owns the transport).
#[derive(Clone, Debug)]
pub(crate) struct LinkHandle(Arc<Mutex<Link>>);

impl LinkHandle {
    pub(crate) fn connection(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).id
    }
}

/// The connection currently in use, and the subscriptions to redo on a new one.
#[derive(Debug)]
struct Link {
    id: usize,
    subscriptions: Vec<SubscriptionState>,
    recover: bool,
}

#[derive(Debug)]
struct SubscriptionState {
    queue: String,
    prefetch: u16,
    /// The connection and consumer index it consumes on now.
    connection: usize,
    consumer: usize,
    cancelled: bool,
    /// Whether the close of its connection was reported by a `recv` yet.
    close_reported: bool,
}

impl fmt::Debug for MemoryTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTransport")
            .field("connection", &self.connection_id())
            .finish()
    }
}

impl MemoryTransport {
    pub(crate) fn new(broker: Broker, id: usize) -> Self {
        MemoryTransport {
            broker,
            link: Arc::new(Mutex::new(Link {
                id,
                subscriptions: Vec::new(),
                recover: true,
            })),
        }
    }

    fn link(&self) -> MutexGuard<'_, Link> {
        lock_link(&self.link)
    }

    fn id(&self) -> usize {
        self.link().id
    }

    pub(crate) fn link_handle(&self) -> LinkHandle {
        LinkHandle(self.link.clone())
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
            if let Some(reason) = &s.connections[id].closed {
                let reason = reason.to_string();
                if s.tracing() {
                    let (key, label) = match p.identity.clone() {
                        Some(identity) => identity,
                        None => (crate::message::MessageKey(0), Arc::from("?")),
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
                return PublishResult::Failed(TransportError::Connection(reason));
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

    /// Reopens a closed connection and consumes again, as automatic recovery does.
    fn recover(link: &mut Link, s: &mut crate::broker::State) -> Result<(), TransportError> {
        let old = link.id;
        link.id = s.open_connection();
        let description = Arc::from(format!("conn {old} recovered as conn {}", link.id));
        s.record(|| EventKind::Fault { description });
        for sub in link.subscriptions.iter_mut().filter(|sub| !sub.cancelled) {
            sub.consumer = s.consume(link.id, &sub.queue, sub.prefetch)?;
            sub.connection = link.id;
            sub.close_reported = false;
        }
        Ok(())
    }

    /// The open connection to use for a new operation: a closed one is recovered first
    /// (unless recovery is off).
    fn ensure_open(&self) -> Result<usize, TransportError> {
        let mut link = self.link();
        self.broker.shared.with(|s| {
            if let Some(reason) = &s.connections[link.id].closed {
                if !link.recover {
                    return Err(TransportError::Connection(reason.to_string()));
                }
                Self::recover(&mut link, s)?;
            }
            Ok(link.id)
        })
    }
}

fn lock_link(link: &Mutex<Link>) -> MutexGuard<'_, Link> {
    link.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for MemoryTransport {
    fn drop(&mut self) {
        let id = self.id();
        self.broker
            .shared
            .with(|s| s.close_connection(id, "client went away"));
    }
}

/// A consumer of one queue on a [`MemoryTransport`]'s connection, with its own prefetch.
/// Made by [`Transport::consume`]; it follows its transport to a recovered connection.
pub struct MemorySubscription {
    broker: Broker,
    link: Arc<Mutex<Link>>,
    index: usize,
}

impl fmt::Debug for MemorySubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let link = lock_link(&self.link);
        let sub = &link.subscriptions[self.index];
        f.debug_struct("MemorySubscription")
            .field("queue", &sub.queue)
            .field("prefetch", &sub.prefetch)
            .field("connection", &sub.connection)
            .finish()
    }
}

impl MemorySubscription {
    /// The next delivery if one is waiting, without waiting: for tests that drive the
    /// broker by hand. `Ok(None)` when nothing is waiting. Does not recover a closed
    /// connection.
    pub fn try_recv(&self) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        let link = lock_link(&self.link);
        let sub = &link.subscriptions[self.index];
        let mut state = self.broker.shared.lock();
        let c = &mut state.connections[sub.connection];
        if let Some(reason) = &c.closed {
            return Err(TransportError::Connection(reason.to_string()));
        }
        Ok(c.consumers[sub.consumer].inbox.pop_front())
    }

    /// Polls for a delivery. A closed connection is reported once, then recovered.
    fn poll_recv(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<Option<Delivery<DeliveryTag>>, TransportError>> {
        let mut link = lock_link(&self.link);
        self.broker.shared.with(|s| {
            let sub = &mut link.subscriptions[self.index];
            if sub.cancelled {
                return Poll::Ready(Ok(None));
            }
            if let Some(reason) = &s.connections[sub.connection].closed {
                if !sub.close_reported {
                    sub.close_reported = true;
                    return Poll::Ready(Err(TransportError::Connection(reason.to_string())));
                }
                if !link.recover {
                    return Poll::Ready(Err(TransportError::Connection(reason.to_string())));
                }
                if s.connections[link.id].closed.is_some()
                    && let Err(e) = MemoryTransport::recover(&mut link, s)
                {
                    return Poll::Ready(Err(e));
                }
            }
            let sub = &link.subscriptions[self.index];
            let c = &mut s.connections[sub.connection].consumers[sub.consumer];
            match c.inbox.pop_front() {
                Some(d) => Poll::Ready(Ok(Some(d))),
                // Cancelled by the broker (its queue was deleted, say).
                None if !c.active => Poll::Ready(Ok(None)),
                None => {
                    c.waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
    }
}

#[async_trait]
impl Subscription for MemorySubscription {
    type Tag = DeliveryTag;

    async fn recv(&self) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        futures::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        let mut link = lock_link(&self.link);
        let sub = &mut link.subscriptions[self.index];
        sub.cancelled = true;
        let (conn, ci) = (sub.connection, sub.consumer);
        self.broker.shared.with(|s| {
            if let Some(reason) = &s.connections[conn].closed {
                return Err(TransportError::Connection(reason.to_string()));
            }
            s.cancel(conn, ci);
            Ok(())
        })
    }

    /// Settlements are applied when made: nothing waits to be sent.
    async fn flush(&self) -> Result<(), TransportError> {
        Ok(())
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
        Ok(MemorySubscription {
            broker: self.broker.clone(),
            link: self.link.clone(),
            index: link.subscriptions.len() - 1,
        })
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        let id = self.ensure_open()?;
        self.broker
            .shared
            .with(|s| s.get(id, queue))
            .map_err(TransportError::from)
    }

    async fn ready(&self, queue: &str, _poll: Duration) -> Result<(), TransportError> {
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
        let origin = Origin {
            queue: original.queue(),
            exchange: original.exchange(),
            routing_key: original.routing_key(),
        };
        let headers = clone_headers(original.headers(), origin, &publish.headers);
        let identity = self
            .broker
            .shared
            .lock()
            .live
            .get(&message_address(original))
            .cloned();
        self.publish_inner(Publishing {
            identity,
            exchange: publish.route.exchange.clone(),
            routing_key: publish.route.routing_key.clone(),
            body: original.body().to_vec(),
            properties: original.properties().clone(),
            headers,
            expiration: publish.expiration,
            mandatory: true,
        })
    }

    async fn settle(
        &self,
        tag: &DeliveryTag,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        self.settle_now(tag, settlement)
            .map_err(TransportError::from)
    }

    fn now(&self) -> Timestamp {
        self.broker.now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(self.broker.sleep(duration))
    }
}
