//! The broker: exchanges, queues, connections and the virtual clock behind one lock.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

use retry_core::{
    BrokerSignals, Confirm, Delivery, DeliveryFacts, ExchangeKind, Headers, Message, MessageParts,
    Properties, Settlement, Timestamp, TopologyPlan, message_identity,
};

use crate::clock::Sleep;
use crate::dead_letter::{Death, is_cycle, record_death};
use crate::error::BrokerError;
use crate::exchange::{Exchange, QueueIndex};
use crate::fault::Faults;
use crate::hash::FastMap;
use crate::message::{MessageKey, Outgoing, QueuedMessage};
use crate::queue::{Overflow, Queue, QueueOptions, Stored};
use crate::trace::{DeathReason, EventKind, MessageRef, PublishOutcome, Publisher, Trace};
use crate::transport::{DeliveryTag, MemoryTransport};

/// The virtual time a broker starts at unless told otherwise: 2024-01-01T00:00:00Z.
pub const DEFAULT_START: Timestamp = Timestamp::from_millis(1_704_067_200_000);

/// RabbitMQ's default `consumer_timeout`: 30 minutes.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A deterministic in-memory model of a RabbitMQ 3.10 broker with a virtual clock.
///
/// Cheap to clone: clones share one broker. Time moves only through [`advance`],
/// [`advance_to`] and [`step`] (or a [`Simulation`] calling them); TTLs expire and sleeps
/// end at exact virtual times.
///
/// ```
/// use transport_memory::{Broker, Outgoing, QueueOptions};
/// use std::time::Duration;
///
/// let broker = Broker::new();
/// broker.declare_queue("work", QueueOptions::new())?;
/// broker.declare_queue(
///     "work.delay",
///     QueueOptions::new()
///         .with_message_ttl(Duration::from_secs(30))
///         .with_dead_letter_exchange("")
///         .with_dead_letter_routing_key("work"),
/// )?;
/// broker.publish(Outgoing::to_queue("work.delay", b"later".to_vec()))?;
///
/// broker.advance(Duration::from_secs(29));
/// assert_eq!(broker.ready("work"), Some(0));
/// broker.advance(Duration::from_secs(1));
/// assert_eq!(broker.ready("work"), Some(1)); // expired at exactly 30 s, back in "work"
/// # Ok::<(), transport_memory::BrokerError>(())
/// ```
///
/// [`advance`]: Broker::advance
/// [`advance_to`]: Broker::advance_to
/// [`step`]: Broker::step
/// [`Simulation`]: crate::Simulation
#[derive(Clone)]
pub struct Broker {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("Broker")
            .field("now", &state.now)
            .field("queues", &state.queues.len())
            .field("connections", &state.connections.len())
            .finish()
    }
}

/// Builds a [`Broker`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct BrokerBuilder {
    start: Timestamp,
    consumer_timeout: Option<Duration>,
    trace: bool,
}

impl Default for BrokerBuilder {
    fn default() -> Self {
        BrokerBuilder {
            start: DEFAULT_START,
            consumer_timeout: Some(DEFAULT_CONSUMER_TIMEOUT),
            trace: true,
        }
    }
}

impl BrokerBuilder {
    /// The virtual time the broker starts at (default [`DEFAULT_START`]).
    pub fn start_at(mut self, start: Timestamp) -> Self {
        self.start = start;
        self
    }

    /// How long a delivery may stay unacknowledged before the broker closes its connection,
    /// as RabbitMQ's `consumer_timeout` does (default 30 minutes; `None` turns it off).
    pub fn consumer_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// Whether to record the event trace (default on). Off, the broker does less work per
    /// message; the trace is then empty.
    pub fn trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }

    /// The broker.
    pub fn build(self) -> Broker {
        let mut state = State {
            now: self.start,
            consumer_timeout: self.consumer_timeout,
            exchanges: Vec::new(),
            exchange_index: FastMap::default(),
            queues: Vec::new(),
            queue_index: FastMap::default(),
            connections: Vec::new(),
            open: BTreeSet::new(),
            timers: BTreeMap::new(),
            next_timer: 0,
            next_key: 0,
            next_seq: 0,
            faults: Faults::default(),
            trace: Trace::new(self.start),
            tracing: self.trace,
            wakes: Vec::new(),
            dirty: VecDeque::new(),
            live: FastMap::default(),
            scratch: Vec::new(),
            deliveries: 0,
        };
        for (name, kind) in [
            ("amq.direct", ExchangeKind::Direct),
            ("amq.fanout", ExchangeKind::Fanout),
            ("amq.topic", ExchangeKind::Topic),
        ] {
            state.add_exchange(name, kind);
        }
        Broker {
            shared: Arc::new(Shared {
                clock: AtomicU64::new(self.start.as_millis()),
                state: Mutex::new(state),
            }),
        }
    }
}

pub(crate) struct Shared {
    /// The virtual time, readable without the lock: the driver asks for it on every turn.
    clock: AtomicU64,
    state: Mutex<State>,
}

impl Shared {
    pub(crate) fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.clock.load(Ordering::Acquire))
    }

    /// Moves the clock to `t` and fires what is due; the only way time moves.
    pub(crate) fn fire_due(&self, t: Timestamp) -> Timestamp {
        self.with(|s| {
            s.fire_due(t);
            self.clock.store(s.now.as_millis(), Ordering::Release);
            s.now
        })
    }

    /// The state. A panic elsewhere while holding the lock leaves the state consistent
    /// enough to inspect, so poisoning is ignored rather than spread.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the state, then wakes whatever it made ready, outside the lock.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut state = self.lock();
        let r = f(&mut state);
        let wakes = std::mem::take(&mut state.wakes);
        drop(state);
        for w in wakes {
            w.wake();
        }
        r
    }
}

/// A consumer on a connection: one subscription, with its own prefetch and its own
/// deliveries waiting to be received.
#[derive(Debug)]
pub(crate) struct ConsumerState {
    pub(crate) prefetch: u16,
    pub(crate) unacked: usize,
    pub(crate) active: bool,
    /// Deliveries pushed to the client and not yet taken by `recv`.
    pub(crate) inbox: VecDeque<Delivery<DeliveryTag>>,
    pub(crate) waker: Option<Waker>,
}

/// A delivery the broker waits to hear about. The message's content moved into the
/// delivered [`Message`] rather than being copied: most deliveries are acknowledged and
/// never needed again, and the rare return to the queue rebuilds it from the message.
#[derive(Debug)]
pub(crate) struct Unacked {
    pub(crate) queue: QueueIndex,
    /// The consumer it was pushed to; `None` for a message taken with a get.
    pub(crate) consumer: Option<usize>,
    pub(crate) key: MessageKey,
    pub(crate) label: Arc<str>,
    seq: u64,
    exchange: Arc<str>,
    routing_key: Arc<str>,
    expiration: Option<Duration>,
    expires_at: Option<Timestamp>,
    delivery_count: u32,
    /// Whether delivery added `x-delivery-count` to the headers.
    counted: bool,
    /// Keeps the delivered message alive, so its address identifies it while it is in flight.
    pub(crate) message: Message,
    pub(crate) delivered_at: Timestamp,
}

impl Unacked {
    /// The message as the queue held it before delivery.
    fn restore(self) -> Stored {
        let parts = self.message.parts();
        let mut headers = parts.headers.clone();
        if self.counted {
            // Added at delivery by a quorum queue; the count itself is kept apart.
            headers.remove("x-delivery-count");
        }
        Stored {
            key: self.key,
            label: self.label,
            seq: self.seq,
            exchange: self.exchange,
            routing_key: self.routing_key,
            body: parts.body.clone(),
            properties: parts.properties.clone(),
            headers,
            expiration: self.expiration,
            expires_at: self.expires_at,
            redelivered: true,
            delivery_count: self.delivery_count,
        }
    }
}

/// A client connection with one channel.
#[derive(Debug, Default)]
pub(crate) struct Connection {
    pub(crate) closed: Option<Arc<str>>,
    pub(crate) consumers: Vec<ConsumerState>,
    pub(crate) unacked: BTreeMap<u64, Unacked>,
    pub(crate) next_tag: u64,
}

/// Everything inside the broker.
pub(crate) struct State {
    pub(crate) now: Timestamp,
    consumer_timeout: Option<Duration>,
    exchanges: Vec<Exchange>,
    exchange_index: FastMap<Arc<str>, usize>,
    pub(crate) queues: Vec<Queue>,
    queue_index: FastMap<Arc<str>, QueueIndex>,
    pub(crate) connections: Vec<Connection>,
    /// The connections still open: closed ones stay in `connections` for their ids, and a
    /// long crash loop leaves many, which per-step scans should not visit.
    open: BTreeSet<usize>,
    pub(crate) timers: BTreeMap<(Timestamp, u64), Waker>,
    pub(crate) next_timer: u64,
    next_key: u64,
    next_seq: u64,
    pub(crate) faults: Faults,
    pub(crate) trace: Trace,
    tracing: bool,
    /// Wakers to call once the lock is released.
    pub(crate) wakes: Vec<Waker>,
    /// Queues whose head may be deliverable or expired.
    dirty: VecDeque<QueueIndex>,
    /// In-flight deliveries by the address of their message, so a clone published from a
    /// delivery keeps its identity.
    pub(crate) live: FastMap<usize, (MessageKey, Arc<str>)>,
    scratch: Vec<QueueIndex>,
    pub(crate) deliveries: u64,
}

/// What a publish carries into the broker.
pub(crate) struct Publishing {
    pub(crate) identity: Option<(MessageKey, Arc<str>)>,
    pub(crate) exchange: Arc<str>,
    pub(crate) routing_key: Arc<str>,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: Properties,
    pub(crate) headers: Headers,
    pub(crate) expiration: Option<Duration>,
    pub(crate) mandatory: bool,
}

impl From<Outgoing> for Publishing {
    fn from(m: Outgoing) -> Self {
        Publishing {
            identity: None,
            exchange: Arc::from(m.exchange),
            routing_key: Arc::from(m.routing_key),
            body: m.body,
            properties: m.properties,
            headers: m.headers,
            expiration: m.expiration,
            mandatory: m.mandatory,
        }
    }
}

/// The address that identifies a delivered message while it is in flight.
pub(crate) fn message_address(m: &Message) -> usize {
    std::ptr::from_ref::<MessageParts>(m.parts()) as usize
}

impl State {
    pub(crate) fn record(&mut self, kind: impl FnOnce() -> EventKind) {
        if self.tracing {
            let at = self.now;
            self.trace.push(at, kind());
        }
    }

    pub(crate) fn tracing(&self) -> bool {
        self.tracing
    }

    fn add_exchange(&mut self, name: &str, kind: ExchangeKind) {
        let name: Arc<str> = Arc::from(name);
        self.exchange_index
            .insert(name.clone(), self.exchanges.len());
        self.exchanges.push(Exchange::new(kind));
    }

    pub(crate) fn declare_exchange(
        &mut self,
        name: &str,
        kind: ExchangeKind,
    ) -> Result<(), BrokerError> {
        if name.is_empty() {
            return Err(BrokerError::AccessRefused(
                "operation not permitted on the default exchange".to_owned(),
            ));
        }
        if let Some(&i) = self.exchange_index.get(name) {
            let existing = self.exchanges[i].kind;
            if existing != kind {
                return Err(BrokerError::Inequivalent {
                    object: format!("exchange '{name}'"),
                    argument: "type".to_owned(),
                    existing: existing.as_str().to_owned(),
                    wanted: kind.as_str().to_owned(),
                });
            }
            return Ok(());
        }
        if name.starts_with("amq.") {
            return Err(BrokerError::AccessRefused(format!(
                "exchange name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        self.add_exchange(name, kind);
        self.retry_stuck_dead_letters();
        Ok(())
    }

    pub(crate) fn declare_queue(
        &mut self,
        name: &str,
        options: QueueOptions,
    ) -> Result<(), BrokerError> {
        if name.is_empty() {
            return Err(BrokerError::InvalidArgument {
                argument: "queue".to_owned(),
                reason: "server-named queues are not modelled; give the queue a name".to_owned(),
            });
        }
        if let Some(&i) = self.queue_index.get(name) {
            if let Some((argument, existing, wanted)) = self.queues[i].options.difference(&options)
            {
                return Err(BrokerError::Inequivalent {
                    object: format!("queue '{name}'"),
                    argument,
                    existing,
                    wanted,
                });
            }
            return Ok(());
        }
        if name.starts_with("amq.") {
            return Err(BrokerError::AccessRefused(format!(
                "queue name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        let name: Arc<str> = Arc::from(name);
        self.queue_index.insert(name.clone(), self.queues.len());
        self.queues.push(Queue::new(name, options));
        self.retry_stuck_dead_letters();
        Ok(())
    }

    pub(crate) fn bind(
        &mut self,
        exchange: &str,
        queue: &str,
        routing_key: &str,
    ) -> Result<(), BrokerError> {
        if exchange.is_empty() {
            return Err(BrokerError::AccessRefused(
                "operation not permitted on the default exchange".to_owned(),
            ));
        }
        let q = self.queue_index(queue)?;
        let x = *self
            .exchange_index
            .get(exchange)
            .ok_or_else(|| BrokerError::ExchangeNotFound(exchange.to_owned()))?;
        self.exchanges[x].bind(q, routing_key);
        self.retry_stuck_dead_letters();
        Ok(())
    }

    pub(crate) fn provision(&mut self, plan: &TopologyPlan) -> Result<(), BrokerError> {
        for x in plan.exchanges() {
            self.declare_exchange(&x.name, x.kind)?;
        }
        for q in plan.queues() {
            self.declare_queue(&q.name, QueueOptions::from(&q.arguments))?;
        }
        for b in plan.bindings() {
            self.bind(&b.exchange, &b.queue, &b.routing_key)?;
        }
        Ok(())
    }

    pub(crate) fn queue_index(&self, name: &str) -> Result<QueueIndex, BrokerError> {
        self.queue_index
            .get(name)
            .copied()
            .ok_or_else(|| BrokerError::QueueNotFound(name.to_owned()))
    }

    /// The queues `exchange` routes `routing_key` to, into `self.scratch`; `None` when the
    /// exchange does not exist.
    fn route(&mut self, exchange: &str, routing_key: &str) -> Option<Vec<QueueIndex>> {
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        if exchange.is_empty() {
            if let Some(&q) = self.queue_index.get(routing_key) {
                out.push(q);
            }
        } else {
            let &x = self.exchange_index.get(exchange)?;
            self.exchanges[x].route(routing_key, &mut out);
        }
        Some(out)
    }

    /// The key given to the latest new message.
    pub(crate) fn last_key(&self) -> MessageKey {
        MessageKey(self.next_key)
    }

    fn new_identity(&mut self, properties: &Properties) -> (MessageKey, Arc<str>) {
        self.next_key += 1;
        let key = MessageKey(self.next_key);
        let label = match &properties.message_id {
            Some(id) => Arc::from(id.as_str()),
            None => Arc::from(key.to_string()),
        };
        (key, label)
    }

    /// A publish from `by`, with publisher confirms. Faults apply to connections only.
    pub(crate) fn publish(&mut self, by: Publisher, p: Publishing) -> Result<Confirm, BrokerError> {
        let identity = match p.identity.clone() {
            Some(id) => id,
            None => self.new_identity(&p.properties),
        };
        let message = MessageRef::new(identity.0, &identity.1);
        let fault = match by {
            Publisher::Connection(_) => self.faults.on_publish(),
            Publisher::Producer => None,
        };
        let (exchange, routing_key) = (p.exchange.clone(), p.routing_key.clone());
        let trace = |state: &mut State, outcome: PublishOutcome| {
            let message = message.clone();
            let (exchange, routing_key) = (exchange.clone(), routing_key.clone());
            state.record(|| EventKind::Published {
                message,
                by,
                exchange,
                routing_key,
                outcome,
            });
        };
        match fault {
            Some(crate::fault::PublishFault::Lose) => {
                trace(self, PublishOutcome::Lost);
                return Ok(Confirm::Failed);
            }
            Some(crate::fault::PublishFault::Refuse) => {
                trace(self, PublishOutcome::Refused);
                return Ok(Confirm::Nack);
            }
            _ => {}
        }
        let Some(targets) = self.route(&p.exchange, &p.routing_key) else {
            trace(
                self,
                PublishOutcome::Failed(Arc::from(format!("no exchange '{}'", p.exchange))),
            );
            return Err(BrokerError::ExchangeNotFound(p.exchange.to_string()));
        };
        if targets.is_empty() {
            self.scratch = targets;
            if p.mandatory {
                trace(self, PublishOutcome::Returned);
                return Ok(Confirm::Returned);
            }
            trace(self, PublishOutcome::Routed(Vec::new()));
            return Ok(Confirm::Ack);
        }
        let stored = Stored {
            key: identity.0,
            label: identity.1,
            seq: 0,
            exchange: p.exchange,
            routing_key: p.routing_key,
            body: p.body,
            properties: p.properties,
            headers: p.headers,
            expiration: p.expiration,
            expires_at: None,
            redelivered: false,
            delivery_count: 0,
        };
        let mut refused = false;
        let mut routed = Vec::new();
        let last = targets.len() - 1;
        let mut stored = Some(stored);
        for (i, &q) in targets.iter().enumerate() {
            let copy = if i == last {
                stored.take()
            } else {
                stored.clone()
            };
            let Some(copy) = copy else { break };
            if self.enqueue(q, copy) {
                if self.tracing {
                    routed.push(self.queues[q].name.clone());
                }
            } else {
                refused = true;
            }
        }
        self.scratch = targets;
        let outcome = if refused {
            PublishOutcome::Refused
        } else if fault == Some(crate::fault::PublishFault::LoseConfirm) {
            PublishOutcome::ConfirmLost(routed)
        } else {
            PublishOutcome::Routed(routed)
        };
        let confirm = match outcome {
            PublishOutcome::Refused => Confirm::Nack,
            PublishOutcome::ConfirmLost(_) => Confirm::Failed,
            _ => Confirm::Ack,
        };
        trace(self, outcome);
        self.pump();
        Ok(confirm)
    }

    /// Puts a message in a queue; `false` when the queue refuses it.
    fn enqueue(&mut self, q: QueueIndex, mut m: Stored) -> bool {
        let now = self.now;
        let queue = &self.queues[q];
        let max = queue.options.max_length;
        // A classic queue refuses the publish that would exceed the limit; a quorum queue
        // only refuses once it is over the limit, so it takes one message past it.
        let full = |max: u64| match queue.is_quorum() {
            true => queue.ready.len() as u64 > max,
            false => queue.ready.len() as u64 >= max,
        };
        if queue.options.overflow == Overflow::RejectPublish && max.is_some_and(full) {
            return false;
        }
        self.next_seq += 1;
        m.seq = self.next_seq;
        m.expires_at = queue.expiry_for(now, m.expiration);
        if m.expires_at == Some(now) {
            // A zero TTL: delivered if a consumer can take it right now, else expired on
            // arrival.
            if queue.ready.is_empty()
                && let Some((conn, consumer)) = self.pick_consumer(q)
            {
                self.deliver(q, conn, consumer, m);
                return true;
            }
            self.dead_letter(q, m, DeathReason::Expired);
            return true;
        }
        let drop_head = self.queues[q].options.overflow == Overflow::DropHead;
        self.queues[q].ready.push_back(m);
        if let Some(max) = max.filter(|_| drop_head) {
            while self.queues[q].ready.len() as u64 > max {
                let Some(head) = self.queues[q].ready.pop_front() else {
                    break;
                };
                self.dead_letter(q, head, DeathReason::MaxLen);
            }
        }
        self.dirty.push_back(q);
        true
    }

    /// Delivers or expires queue heads until nothing more can move.
    pub(crate) fn pump(&mut self) {
        while let Some(q) = self.dirty.pop_front() {
            self.dispatch(q);
        }
    }

    fn dispatch(&mut self, q: QueueIndex) {
        while self.expire_head(q) {
            let Some((conn, consumer)) = self.pick_consumer(q) else {
                // Ready with nobody to take it: whoever watches the queue can come for it.
                let watchers = std::mem::take(&mut self.queues[q].watchers);
                self.wakes.extend(watchers);
                return;
            };
            if let Some(m) = self.queues[q].ready.pop_front() {
                self.deliver(q, conn, consumer, m);
            }
        }
    }

    /// Dead-letters expired messages at the head of `q`; whether a live one is left there.
    fn expire_head(&mut self, q: QueueIndex) -> bool {
        let now = self.now;
        loop {
            let Some(head) = self.queues[q].ready.front() else {
                return false;
            };
            if head.expires_at.is_none_or(|t| t > now) {
                return true;
            }
            if let Some(m) = self.queues[q].ready.pop_front() {
                self.dead_letter(q, m, DeathReason::Expired);
            }
        }
    }

    /// Takes the message at the head of `queue` for `conn`, as `basic.get` does; `None` when
    /// nothing is ready. A missing queue is a channel error.
    pub(crate) fn get(
        &mut self,
        conn: usize,
        queue: &str,
    ) -> Result<Option<Delivery<DeliveryTag>>, BrokerError> {
        let q = self.queue_on(conn, queue)?;
        if !self.expire_head(q) {
            return Ok(None);
        }
        let m = self.queues[q].ready.pop_front();
        Ok(m.map(|m| self.hand_out(q, conn, None, m)))
    }

    /// `queue`, for a request on connection `conn`: a closed connection fails, and a missing
    /// queue is a channel error that closes the connection, as on RabbitMQ.
    fn queue_on(&mut self, conn: usize, queue: &str) -> Result<QueueIndex, BrokerError> {
        if let Some(reason) = &self.connections[conn].closed {
            return Err(BrokerError::ConnectionClosed(reason.to_string()));
        }
        self.queue_index(queue).inspect_err(|e| {
            self.close_connection(conn, &e.to_string());
        })
    }

    /// Whether `queue` has a message ready; if not, `waker` is woken when one is.
    pub(crate) fn watch(&mut self, queue: &str, waker: &Waker) -> Result<bool, BrokerError> {
        let q = self.queue_index(queue)?;
        if self.expire_head(q) {
            return Ok(true);
        }
        let watchers = &mut self.queues[q].watchers;
        if !watchers.iter().any(|w| w.will_wake(waker)) {
            watchers.push(waker.clone());
        }
        Ok(false)
    }

    /// The next consumer of `q` with room under its prefetch, round-robin.
    fn pick_consumer(&mut self, q: QueueIndex) -> Option<(usize, usize)> {
        let queue = &self.queues[q];
        let n = queue.consumers.len();
        for i in 0..n {
            let at = (queue.next_consumer + i) % n;
            let (conn, ci) = queue.consumers[at];
            let c = &self.connections[conn].consumers[ci];
            if c.active && (c.prefetch == 0 || c.unacked < usize::from(c.prefetch)) {
                self.queues[q].next_consumer = (at + 1) % n;
                return Some((conn, ci));
            }
        }
        None
    }

    fn deliver(&mut self, q: QueueIndex, conn: usize, consumer: usize, m: Stored) {
        let delivery = self.hand_out(q, conn, Some(consumer), m);
        let c = &mut self.connections[conn].consumers[consumer];
        c.unacked += 1;
        c.inbox.push_back(delivery);
        if let Some(w) = c.waker.take() {
            self.wakes.push(w);
        }
    }

    /// Delivers `m` from `q` on `conn`, to a consumer or to a get: it is unacknowledged
    /// there until settled or the connection closes.
    fn hand_out(
        &mut self,
        q: QueueIndex,
        conn: usize,
        consumer: Option<usize>,
        m: Stored,
    ) -> Delivery<DeliveryTag> {
        self.deliveries += 1;
        let queue = &mut self.queues[q];
        queue.unacked += 1;
        let quorum = queue.is_quorum();
        let queue_name = queue.name.clone();
        if let Some(copy) = self.faults.on_deliver(&m) {
            // The duplicate waits at the head, as a second copy of a message does after a
            // publisher retried a publish whose confirm it never saw.
            self.queues[q].ready.push_front(copy);
            self.dirty.push_back(q);
            let message = MessageRef::new(m.key, &m.label);
            let queue = queue_name.clone();
            self.record(|| EventKind::Fault {
                description: Arc::from(format!("duplicate of {} queued in {queue}", message.label)),
            });
        }
        let Stored {
            key,
            label,
            seq,
            exchange,
            routing_key,
            body,
            properties,
            mut headers,
            expiration,
            expires_at,
            redelivered,
            delivery_count,
        } = m;
        // A quorum queue counts returns in x-delivery-count: from the first return on for a
        // consumer, and always, 0 included, for a get.
        let counted = quorum && (delivery_count > 0 || consumer.is_none());
        if counted {
            headers.insert_static("x-delivery-count", i64::from(delivery_count));
        }
        let redelivered = redelivered || (quorum && delivery_count > 0);
        let parts = MessageParts {
            // `String::from`, not `to_string`: no formatting machinery per delivery.
            queue: String::from(&*queue_name),
            exchange: String::from(&*exchange),
            routing_key: String::from(&*routing_key),
            body,
            properties,
            headers,
        };
        let identity = message_identity(parts.properties.message_id.as_deref(), &parts.body);
        let facts = DeliveryFacts::decode(
            &parts.headers,
            BrokerSignals {
                redelivered,
                delivery_count: None,
            },
            identity,
        );
        let message = Message::new(parts);
        let connection = &mut self.connections[conn];
        connection.next_tag += 1;
        let tag = connection.next_tag;
        let delivery = Delivery {
            tag: DeliveryTag {
                connection: conn as u64,
                tag,
            },
            message: message.clone(),
            facts,
        };
        self.live
            .insert(message_address(&message), (key, label.clone()));
        let message_ref = self.tracing.then(|| MessageRef::new(key, &label));
        connection.unacked.insert(
            tag,
            Unacked {
                queue: q,
                consumer,
                key,
                label,
                seq,
                exchange,
                routing_key,
                expiration,
                expires_at,
                delivery_count: if quorum { delivery_count } else { 0 },
                counted,
                message,
                delivered_at: self.now,
            },
        );
        if let Some(message) = message_ref {
            self.record(|| EventKind::Delivered {
                message,
                queue: queue_name,
                connection: conn as u64,
                tag,
                redelivered,
            });
        }
        delivery
    }

    /// Settles a delivery on `conn`. An unknown tag closes the channel, as on RabbitMQ.
    pub(crate) fn settle(
        &mut self,
        conn: usize,
        tag: u64,
        settlement: Settlement,
    ) -> Result<(), BrokerError> {
        if let Some(reason) = &self.connections[conn].closed {
            return Err(BrokerError::ConnectionClosed(reason.to_string()));
        }
        let Some(u) = self.connections[conn].unacked.remove(&tag) else {
            let reason = format!("PRECONDITION_FAILED - unknown delivery tag {tag}");
            self.close_connection(conn, &reason);
            return Err(BrokerError::ConnectionClosed(reason));
        };
        self.live.remove(&message_address(&u.message));
        if let Some(ci) = u.consumer {
            self.connections[conn].consumers[ci].unacked -= 1;
        }
        let q = u.queue;
        self.queues[q].unacked -= 1;
        let message = MessageRef::new(u.key, &u.label);
        let queue = self.queues[q].name.clone();
        match settlement {
            Settlement::Ack => {
                self.record(|| EventKind::Acked {
                    message,
                    queue,
                    tag,
                });
            }
            Settlement::Requeue => {
                self.record(|| EventKind::Requeued {
                    message,
                    queue,
                    tag,
                    by_consumer: true,
                });
                self.return_to_queue(q, u.restore());
            }
            Settlement::Reject => {
                let mut m = u.restore();
                m.redelivered = false;
                self.dead_letter(q, m, DeathReason::Rejected);
            }
        }
        // The consumer has room again.
        self.dirty.push_back(q);
        self.pump();
        Ok(())
    }

    /// A delivery goes back to its queue: flagged redelivered and, on quorum queues,
    /// counted, and dead-lettered once past the delivery limit.
    fn return_to_queue(&mut self, q: QueueIndex, mut m: Stored) {
        m.redelivered = true;
        let queue = &mut self.queues[q];
        if queue.is_quorum() {
            m.delivery_count = m.delivery_count.saturating_add(1);
            if queue
                .options
                .delivery_limit
                .is_some_and(|limit| m.delivery_count > limit)
            {
                self.dead_letter(q, m, DeathReason::DeliveryLimit);
                return;
            }
        }
        queue.put_back(m);
        self.dirty.push_back(q);
    }

    /// Dead-letters `m` out of queue `q`, or discards it when the queue has no dead-letter
    /// exchange.
    fn dead_letter(&mut self, q: QueueIndex, mut m: Stored, reason: DeathReason) {
        let queue = &self.queues[q];
        let queue_name = queue.name.clone();
        let Some(dlx) = queue.dead_letter_exchange.clone() else {
            let message = MessageRef {
                key: m.key,
                label: m.label,
            };
            self.record(|| EventKind::Discarded {
                message,
                queue: queue_name,
                why: match reason {
                    DeathReason::Expired => "expired, no dead-letter exchange",
                    DeathReason::Rejected => "rejected, no dead-letter exchange",
                    DeathReason::MaxLen => "over max-length, no dead-letter exchange",
                    DeathReason::DeliveryLimit => "over delivery limit, no dead-letter exchange",
                },
            });
            return;
        };
        let at_least_once = queue.options.effective_at_least_once();
        let new_key = match &queue.dead_letter_routing_key {
            Some(k) => k.clone(),
            None => m.routing_key.clone(),
        };
        record_death(
            &mut m.headers,
            &Death {
                queue: &queue_name,
                reason,
                exchange: &m.exchange,
                routing_key: &m.routing_key,
                time: self.now,
                original_expiration: m.expiration,
            },
        );
        m.exchange = dlx;
        m.routing_key = new_key;
        m.expiration = None;
        m.redelivered = false;
        m.delivery_count = 0;
        if let Some(m) = self.route_dead_letter(q, m, reason)
            && at_least_once
        {
            self.queues[q].stuck_dead_letters.push((m, reason));
        }
    }

    /// Routes a dead letter already marked with its death; gives it back when it reached
    /// no queue.
    fn route_dead_letter(
        &mut self,
        from: QueueIndex,
        m: Stored,
        reason: DeathReason,
    ) -> Option<Stored> {
        let queue_name = self.queues[from].name.clone();
        let message = self.tracing.then(|| MessageRef::new(m.key, &m.label));
        let Some(mut targets) = self.route(&m.exchange, &m.routing_key) else {
            if let Some(message) = message {
                self.record(|| EventKind::Discarded {
                    message,
                    queue: queue_name,
                    why: "dead-letter exchange does not exist",
                });
            }
            return Some(m);
        };
        if reason != DeathReason::Rejected {
            let queues = &self.queues;
            targets.retain(|&t| !is_cycle(&m.headers, &queues[t].name));
        }
        if targets.is_empty() {
            self.scratch = targets;
            if let Some(message) = message {
                let (exchange, routing_key) = (m.exchange.clone(), m.routing_key.clone());
                self.record(|| EventKind::DeadLettered {
                    message,
                    queue: queue_name,
                    reason,
                    exchange,
                    routing_key,
                    routed: Vec::new(),
                });
            }
            return Some(m);
        }
        let names = message
            .as_ref()
            .map(|_| (m.exchange.clone(), m.routing_key.clone()));
        let mut routed = Vec::new();
        let mut m = Some(m);
        let last = targets.len() - 1;
        for (i, &t) in targets.iter().enumerate() {
            let copy = if i == last { m.take() } else { m.clone() };
            let Some(copy) = copy else { break };
            if self.enqueue(t, copy) && self.tracing {
                routed.push(self.queues[t].name.clone());
            }
        }
        self.scratch = targets;
        if let (Some(message), Some((exchange, routing_key))) = (message, names) {
            self.record(|| EventKind::DeadLettered {
                message,
                queue: queue_name,
                reason,
                exchange,
                routing_key,
                routed,
            });
        }
        None
    }

    fn retry_stuck_dead_letters(&mut self) {
        for q in 0..self.queues.len() {
            if self.queues[q].stuck_dead_letters.is_empty() {
                continue;
            }
            let stuck = std::mem::take(&mut self.queues[q].stuck_dead_letters);
            for (m, reason) in stuck {
                if let Some(m) = self.route_dead_letter(q, m, reason) {
                    self.queues[q].stuck_dead_letters.push((m, reason));
                }
            }
        }
        self.pump();
    }

    pub(crate) fn open_connection(&mut self) -> usize {
        let id = self.connections.len();
        self.connections.push(Connection::default());
        self.open.insert(id);
        self.record(|| EventKind::ConnectionOpened {
            connection: id as u64,
        });
        id
    }

    /// Starts a consumer on `conn`; returns its index there.
    pub(crate) fn consume(
        &mut self,
        conn: usize,
        queue: &str,
        prefetch: u16,
    ) -> Result<usize, BrokerError> {
        let q = self.queue_on(conn, queue)?;
        let connection = &mut self.connections[conn];
        let ci = connection.consumers.len();
        connection.consumers.push(ConsumerState {
            prefetch,
            unacked: 0,
            active: true,
            inbox: VecDeque::new(),
            waker: None,
        });
        self.queues[q].consumers.push((conn, ci));
        let queue = self.queues[q].name.clone();
        self.record(|| EventKind::ConsumerStarted {
            connection: conn as u64,
            queue,
            prefetch,
        });
        self.dirty.push_back(q);
        self.pump();
        Ok(ci)
    }

    /// Cancels consumer `ci` of `conn`: nothing more is pushed to it, and its receiver
    /// learns that the stream ended. What it holds stays unacknowledged.
    pub(crate) fn cancel(&mut self, conn: usize, ci: usize) {
        let Some(c) = self.connections[conn].consumers.get_mut(ci) else {
            return;
        };
        c.active = false;
        if let Some(w) = c.waker.take() {
            self.wakes.push(w);
        }
        for queue in &mut self.queues {
            queue.consumers.retain(|&(c, i)| (c, i) != (conn, ci));
            queue.next_consumer = 0;
        }
    }

    /// Closes a connection: its consumers go, and its unacknowledged deliveries return to
    /// their queues flagged redelivered. Returns whether it was open.
    pub(crate) fn close_connection(&mut self, conn: usize, reason: &str) -> bool {
        let Some(connection) = self.connections.get_mut(conn) else {
            return false;
        };
        if connection.closed.is_some() {
            return false;
        }
        let reason: Arc<str> = Arc::from(reason);
        connection.closed = Some(reason.clone());
        self.open.remove(&conn);
        let unacked = std::mem::take(&mut connection.unacked);
        for c in 0..connection.consumers.len() {
            self.connections[conn].consumers[c].inbox.clear();
            self.cancel(conn, c);
        }
        self.record(|| EventKind::ConnectionClosed {
            connection: conn as u64,
            reason,
        });
        for (tag, u) in unacked {
            self.live.remove(&message_address(&u.message));
            let q = u.queue;
            self.queues[q].unacked -= 1;
            let message = MessageRef::new(u.key, &u.label);
            let queue = self.queues[q].name.clone();
            self.record(|| EventKind::Requeued {
                message,
                queue,
                tag,
                by_consumer: false,
            });
            self.return_to_queue(q, u.restore());
        }
        self.pump();
        true
    }

    /// The earliest virtual time something is due: a sleep ending, a queue head expiring, or
    /// a delivery passing the consumer timeout.
    pub(crate) fn next_deadline(&self) -> Option<Timestamp> {
        let timer = self.timers.keys().next().map(|(t, _)| *t);
        let expiry = self.queues.iter().filter_map(Queue::head_expiry).min();
        let timeout = self.consumer_timeout.and_then(|limit| {
            self.open
                .iter()
                .filter_map(|&c| self.connections[c].unacked.values().next())
                .map(|u| u.delivered_at + limit)
                .min()
        });
        [timer, expiry, timeout].into_iter().flatten().min()
    }

    /// Moves the clock to `t` (never backwards) and fires everything due by then. Only
    /// [`Shared::fire_due`] calls it, keeping the lock-free clock in step.
    fn fire_due(&mut self, t: Timestamp) {
        if t > self.now {
            self.now = t;
        }
        let now = self.now;
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > now {
                break;
            }
            self.wakes.push(entry.remove());
        }
        for q in 0..self.queues.len() {
            if self.queues[q].head_expiry().is_some_and(|e| e <= now) {
                self.dirty.push_back(q);
            }
        }
        self.pump();
        if let Some(limit) = self.consumer_timeout {
            let overdue: Vec<usize> = self
                .open
                .iter()
                .copied()
                .filter(|&c| {
                    self.connections[c]
                        .unacked
                        .values()
                        .next()
                        .is_some_and(|u| u.delivered_at + limit <= now)
                })
                .collect();
            for conn in overdue {
                let reason = format!(
                    "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value used: {} ms",
                    limit.as_millis()
                );
                self.close_connection(conn, &reason);
            }
        }
    }

    /// Where each message has copies: the queues holding it ready, and whether a consumer
    /// holds one.
    pub(crate) fn copies(&self) -> HashMap<Arc<str>, (Vec<Arc<str>>, bool)> {
        let mut out: HashMap<Arc<str>, (Vec<Arc<str>>, bool)> = HashMap::new();
        for q in &self.queues {
            for m in q
                .ready
                .iter()
                .chain(q.stuck_dead_letters.iter().map(|(m, _)| m))
            {
                out.entry(m.label.clone())
                    .or_default()
                    .0
                    .push(q.name.clone());
            }
        }
        for &c in &self.open {
            for u in self.connections[c].unacked.values() {
                out.entry(u.label.clone()).or_default().1 = true;
            }
        }
        out
    }

    pub(crate) fn snapshot(&self, q: QueueIndex) -> Vec<QueuedMessage> {
        self.queues[q]
            .ready
            .iter()
            .map(|m| QueuedMessage {
                key: m.key,
                label: m.label.clone(),
                exchange: m.exchange.to_string(),
                routing_key: m.routing_key.to_string(),
                body: m.body.clone(),
                properties: m.properties.clone(),
                headers: m.headers.clone(),
                expiration: m.expiration,
                expires_at: m.expires_at,
                redelivered: m.redelivered,
                delivery_count: m.delivery_count,
            })
            .collect()
    }
}

/// Counts for one queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueStats {
    /// Messages waiting to be delivered.
    pub ready: usize,
    /// Messages delivered and not yet settled.
    pub unacked: usize,
    /// Active consumers.
    pub consumers: usize,
    /// Quorum queues with at-least-once dead-lettering: dead letters waiting for a route.
    pub stuck_dead_letters: usize,
}

impl Default for Broker {
    fn default() -> Self {
        Broker::new()
    }
}

impl Broker {
    /// A broker at [`DEFAULT_START`] with RabbitMQ's default consumer timeout and tracing on.
    pub fn new() -> Self {
        BrokerBuilder::default().build()
    }

    /// A builder for other settings.
    pub fn builder() -> BrokerBuilder {
        BrokerBuilder::default()
    }

    /// The virtual time.
    pub fn now(&self) -> Timestamp {
        self.shared.now()
    }

    /// Declares an exchange; redeclaring with the same type is a no-op.
    pub fn declare_exchange(&self, name: &str, kind: ExchangeKind) -> Result<(), BrokerError> {
        self.shared.with(|s| s.declare_exchange(name, kind))
    }

    /// Declares a queue; redeclaring with the same arguments is a no-op, with different ones
    /// an [`BrokerError::Inequivalent`] naming the argument.
    pub fn declare_queue(&self, name: &str, options: QueueOptions) -> Result<(), BrokerError> {
        self.shared.with(|s| s.declare_queue(name, options))
    }

    /// Binds `queue` to `exchange` with `routing_key` (a pattern for topic exchanges).
    pub fn bind(&self, exchange: &str, queue: &str, routing_key: &str) -> Result<(), BrokerError> {
        self.shared.with(|s| s.bind(exchange, queue, routing_key))
    }

    /// Declares everything in `plan`.
    ///
    /// ```
    /// use retry_core::{RetryPolicy, TopologyPlan};
    /// use transport_memory::Broker;
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::new("comments", &policy)?;
    /// let broker = Broker::new();
    /// broker.provision(&plan)?;
    /// assert_eq!(broker.ready("comments.retry.30s"), Some(0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn provision(&self, plan: &TopologyPlan) -> Result<(), BrokerError> {
        self.shared.with(|s| s.provision(plan))
    }

    /// Publishes as a producer with publisher confirms: `Ack` when routed (or dropped
    /// without `mandatory`), `Nack` when a `reject-publish` queue is full, `Returned` when
    /// `mandatory` and unroutable. Injected faults do not apply to the producer. An unknown
    /// exchange is an error.
    pub fn publish(&self, message: Outgoing) -> Result<Confirm, BrokerError> {
        self.shared
            .with(|s| s.publish(Publisher::Producer, Publishing::from(message)))
    }

    /// Opens a client connection: a [`MemoryTransport`] for the retry engine's driver.
    pub fn connect(&self) -> MemoryTransport {
        let id = self.shared.with(State::open_connection);
        MemoryTransport::new(self.clone(), id)
    }

    /// Closes connection `id` as the broker would (a network failure, an operator's
    /// `close_connection`): its unacknowledged deliveries return to their queues flagged
    /// redelivered. Returns whether it was open.
    pub fn close_connection(&self, id: u64, reason: &str) -> bool {
        self.shared.with(|s| {
            let Ok(id) = usize::try_from(id) else {
                return false;
            };
            let description = Arc::from(format!("close conn {id}: {reason}"));
            s.record(|| EventKind::Fault { description });
            s.close_connection(id, reason)
        })
    }

    /// The earliest virtual time something is due, if anything is.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.shared.lock().next_deadline()
    }

    /// Moves the clock to the next deadline and fires it; `None` when nothing is due.
    pub fn step(&self) -> Option<Timestamp> {
        let t = self.shared.lock().next_deadline()?;
        Some(self.shared.fire_due(t))
    }

    /// Moves the clock to `t`, firing every deadline on the way at its own time. A time in
    /// the past does nothing.
    pub fn advance_to(&self, t: Timestamp) {
        loop {
            let next = self.shared.lock().next_deadline();
            match next {
                Some(d) if d <= t => self.shared.fire_due(d),
                _ => {
                    self.shared.fire_due(t);
                    return;
                }
            };
        }
    }

    /// Moves the clock forward by `d`; see [`advance_to`](Self::advance_to).
    pub fn advance(&self, d: Duration) {
        let t = self.now() + d;
        self.advance_to(t);
    }

    /// A future that completes once the virtual clock reaches now + `duration`.
    pub fn sleep(&self, duration: Duration) -> Sleep {
        let deadline = self.now() + duration;
        Sleep::new(self.shared.clone(), deadline)
    }

    /// The number of ready messages in `queue`, or `None` if there is no such queue.
    pub fn ready(&self, queue: &str) -> Option<usize> {
        self.stats(queue).map(|s| s.ready)
    }

    /// The counts of `queue`.
    pub fn stats(&self, queue: &str) -> Option<QueueStats> {
        let s = self.shared.lock();
        let q = &s.queues[s.queue_index(queue).ok()?];
        Some(QueueStats {
            ready: q.ready.len(),
            unacked: q.unacked,
            consumers: q.consumers.len(),
            stuck_dead_letters: q.stuck_dead_letters.len(),
        })
    }

    /// Copies of the ready messages in `queue`, head first.
    pub fn messages(&self, queue: &str) -> Result<Vec<QueuedMessage>, BrokerError> {
        let s = self.shared.lock();
        let q = s.queue_index(queue)?;
        Ok(s.snapshot(q))
    }

    /// The names of the declared queues, in declaration order.
    pub fn queue_names(&self) -> Vec<String> {
        let s = self.shared.lock();
        s.queues.iter().map(|q| q.name.to_string()).collect()
    }

    /// Whether connection `id` is open.
    pub fn is_open(&self, id: u64) -> bool {
        let s = self.shared.lock();
        usize::try_from(id)
            .ok()
            .and_then(|i| s.connections.get(i))
            .is_some_and(|c| c.closed.is_none())
    }

    /// Deliveries to consumers so far, redeliveries included.
    pub fn deliveries(&self) -> u64 {
        self.shared.lock().deliveries
    }

    /// A copy of the event trace so far.
    pub fn trace(&self) -> Trace {
        self.shared.lock().trace.clone()
    }
}
