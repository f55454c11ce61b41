//! The broker's state behind its lock, and the path a message takes through it:
//!
//! publish → route → enqueue → deliver → settle → (requeue | dead-letter → route → enqueue)
//!
//! Each step calls into the type that owns what it touches: [`Topology`] routes,
//! [`Queues`] hold messages and consumers' places, [`Connections`] hold consumers and
//! unacknowledged deliveries, [`Timers`] hold sleeps, [`Faults`] decide injected faults.
//! Only this file moves a message from one of them to another.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

use retry_core::{Confirm, ExchangeKind, Properties, Settlement, SoloGate, Timestamp};

use crate::broker::connections::{Connections, Recv, Unacked};
use crate::broker::dead_letter::{Death, is_cycle, record_death};
use crate::broker::error::BrokerError;
use crate::broker::fault::{Faults, FetchFault, PublishFault};
use crate::broker::hash::FastMap;
use crate::broker::message::{Handout, Held, MessageKey, Publishing, QueuedMessage, Stored};
use crate::broker::queue::QueueOptions;
use crate::broker::queues::{QueueIndex, Queues};
use crate::broker::timers::Timers;
use crate::broker::topology::Topology;
use crate::broker::trace::{DeathReason, EventKind, MessageRef, PublishOutcome, Publisher, Trace};

/// The broker's state and its clock, shared by every handle, transport and sleep.
pub(crate) struct Shared {
    /// The virtual time, readable without the lock: the driver asks for it on every turn.
    clock: AtomicU64,
    state: Mutex<State>,
    /// The gate this broker's consumers run suspects alone through, unless given another.
    gate: SoloGate,
}

impl Shared {
    pub(crate) fn new(state: State) -> Self {
        Shared {
            clock: AtomicU64::new(state.now.as_millis()),
            state: Mutex::new(state),
            gate: SoloGate::new(),
        }
    }

    pub(crate) fn solo_gate(&self) -> &SoloGate {
        &self.gate
    }

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

/// Everything inside the broker.
pub(crate) struct State {
    now: Timestamp,
    topology: Topology,
    queues: Queues,
    connections: Connections,
    timers: Timers,
    faults: Faults,
    trace: Trace,
    tracing: bool,
    /// Wakers to call once the lock is released.
    wakes: Vec<Waker>,
    /// The queues a message is being routed to; kept to reuse its allocation.
    routes: Vec<QueueIndex>,
    /// The key of the latest new message.
    last_key: u64,
    /// Fetches lost in flight, by the label of the message each carried.
    lost_fetches: FastMap<Arc<str>, u32>,
}

impl State {
    pub(crate) fn new(start: Timestamp, consumer_timeout: Option<Duration>, tracing: bool) -> Self {
        State {
            now: start,
            topology: Topology::new(),
            queues: Queues::default(),
            connections: Connections::new(consumer_timeout),
            timers: Timers::default(),
            faults: Faults::default(),
            trace: Trace::new(start),
            tracing,
            wakes: Vec::new(),
            routes: Vec::new(),
            last_key: 0,
            lost_fetches: FastMap::default(),
        }
    }

    pub(crate) fn now(&self) -> Timestamp {
        self.now
    }

    pub(crate) fn queues(&self) -> &Queues {
        &self.queues
    }

    pub(crate) fn connections(&self) -> &Connections {
        &self.connections
    }

    pub(crate) fn timers(&mut self) -> &mut Timers {
        &mut self.timers
    }

    /// Whether a watch of `queue` fails now (an injected fault), recorded in the trace.
    pub(crate) fn fail_watch(&mut self, queue: &str) -> bool {
        self.injected(Faults::on_watch, || format!("a watch of {queue} fails"))
    }

    /// Whether a subscribe to `queue` fails now (an injected fault), recorded in the trace.
    pub(crate) fn fail_subscribe(&mut self, queue: &str) -> bool {
        self.injected(Faults::on_subscribe, || {
            format!("a subscribe to {queue} fails")
        })
    }

    /// What befalls a fetch from `queue` that found a message (an injected fault), if
    /// anything, recorded in the trace.
    pub(crate) fn fetch_fault(&mut self, queue: &str) -> Option<FetchFault> {
        let fault = self.faults.on_fetch()?;
        let description = match fault {
            FetchFault::Late => {
                format!("a fetch from {queue} gives up with its message on the way")
            }
            FetchFault::Lost => format!(
                "a fetch from {queue} is lost in flight: its message goes back to the queue redelivered"
            ),
        };
        self.record(|| EventKind::Fault {
            description: Arc::from(description),
        });
        Some(fault)
    }

    /// The broker's copy of delivery `tag`, handed to a fetch on `conn` whose answer was
    /// lost, goes back to its place in its queue flagged redelivered, as RabbitMQ requeues
    /// the unacknowledged deliveries of a channel that closes. Nothing happens when the
    /// delivery is settled or its connection closed (which requeued it already).
    pub(crate) fn requeue_lost_fetch(&mut self, conn: usize, tag: u64) {
        if !self.connections.is_open(conn) {
            return;
        }
        let Some(taken) = self.connections.take(conn, tag) else {
            return;
        };
        let q = taken.unacked().queue;
        let m = self.connections.restore(conn, taken);
        *self.lost_fetches.entry(m.label.clone()).or_default() += 1;
        self.put_back_unacked(tag, q, m);
        self.pump();
    }

    /// Fetches lost in flight so far, by the label of the message each carried.
    pub(crate) fn lost_fetches(&self) -> &FastMap<Arc<str>, u32> {
        &self.lost_fetches
    }

    fn injected(&mut self, draw: fn(&mut Faults) -> bool, what: impl FnOnce() -> String) -> bool {
        let hit = draw(&mut self.faults);
        if hit {
            self.record(|| EventKind::Fault {
                description: Arc::from(what()),
            });
        }
        hit
    }

    pub(crate) fn faults(&mut self) -> &mut Faults {
        &mut self.faults
    }

    pub(crate) fn trace(&self) -> &Trace {
        &self.trace
    }

    pub(crate) fn tracing(&self) -> bool {
        self.tracing
    }

    /// Adds an event to the trace, if tracing is on.
    pub(crate) fn record(&mut self, kind: impl FnOnce() -> EventKind) {
        if self.tracing {
            let at = self.now;
            self.trace.push(at, kind());
        }
    }

    // Topology.

    pub(crate) fn has_exchange(&self, name: &str) -> bool {
        self.topology.has_exchange(name)
    }

    pub(crate) fn declare_exchange(
        &mut self,
        name: &str,
        kind: ExchangeKind,
    ) -> Result<(), BrokerError> {
        if self.topology.declare_exchange(name, kind)? {
            self.retry_stuck_dead_letters();
        }
        Ok(())
    }

    pub(crate) fn declare_queue(
        &mut self,
        name: &str,
        options: QueueOptions,
    ) -> Result<(), BrokerError> {
        if self.queues.declare(name, options)? {
            self.retry_stuck_dead_letters();
        }
        Ok(())
    }

    pub(crate) fn bind(
        &mut self,
        exchange: &str,
        queue: &str,
        routing_key: &str,
    ) -> Result<(), BrokerError> {
        self.topology
            .bind(&self.queues, exchange, queue, routing_key)?;
        self.retry_stuck_dead_letters();
        Ok(())
    }

    pub(crate) fn bind_exchange(
        &mut self,
        source: &str,
        destination: &str,
        routing_key: &str,
    ) -> Result<(), BrokerError> {
        self.topology
            .bind_exchange(source, destination, routing_key)?;
        self.retry_stuck_dead_letters();
        Ok(())
    }

    // Publish.

    /// The key given to the latest new message.
    pub(crate) fn last_key(&self) -> MessageKey {
        MessageKey(self.last_key)
    }

    /// A new identity that the trace and the simulation follow by `label`, whatever the
    /// message's id.
    pub(crate) fn new_labelled(&mut self, label: &str) -> (MessageKey, Arc<str>) {
        self.last_key += 1;
        (MessageKey(self.last_key), Arc::from(label))
    }

    fn new_identity(&mut self, properties: &Properties) -> (MessageKey, Arc<str>) {
        self.last_key += 1;
        let key = MessageKey(self.last_key);
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
            Some(PublishFault::Lose) => {
                trace(self, PublishOutcome::Lost);
                return Ok(Confirm::Failed);
            }
            Some(PublishFault::Refuse) => {
                trace(self, PublishOutcome::Refused);
                return Ok(Confirm::Nack);
            }
            _ => {}
        }
        let Some(mut targets) = self.route(&p.exchange, &p.routing_key) else {
            trace(
                self,
                PublishOutcome::Failed(Arc::from(format!("no exchange '{}'", p.exchange))),
            );
            return Err(BrokerError::ExchangeNotFound(p.exchange.to_string()));
        };
        if fault == Some(PublishFault::Return) {
            // As if the binding were gone: routed nowhere.
            targets.clear();
        }
        if targets.is_empty() {
            self.routes = targets;
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
                    routed.push(self.queues.get(q).name().clone());
                }
            } else {
                refused = true;
            }
        }
        self.routes = targets;
        let outcome = if refused {
            PublishOutcome::Refused
        } else if fault == Some(PublishFault::LoseConfirm) {
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

    // Route.

    /// The queues `exchange` routes `routing_key` to, in a vector to give back to
    /// `self.routes`; `None` when the exchange does not exist.
    fn route(&mut self, exchange: &str, routing_key: &str) -> Option<Vec<QueueIndex>> {
        let mut out = std::mem::take(&mut self.routes);
        out.clear();
        if self
            .topology
            .route(&self.queues, exchange, routing_key, &mut out)
        {
            Some(out)
        } else {
            self.routes = out;
            None
        }
    }

    // Enqueue.

    /// Puts a message in a queue; `false` when the queue refuses it.
    fn enqueue(&mut self, q: QueueIndex, mut m: Stored) -> bool {
        let now = self.now;
        let queue = self.queues.get(q);
        if queue.refuses_publish() {
            return false;
        }
        let expires_at = queue.expiry_for(now, m.expiration);
        let empty = queue.is_empty();
        m.seq = self.queues.next_seq();
        m.expires_at = expires_at;
        if expires_at == Some(now) {
            // A zero TTL: delivered if a consumer can take it right now, else expired on
            // arrival.
            if empty && let Some((conn, consumer)) = self.pick_consumer(q) {
                self.deliver(q, conn, consumer, m);
                return true;
            }
            self.dead_letter(q, m, DeathReason::Expired);
            return true;
        }
        self.queues.get_mut(q).push(m);
        while let Some(head) = self.queues.get_mut(q).take_over_max_length() {
            self.dead_letter(q, head, DeathReason::MaxLen);
        }
        self.queues.mark(q);
        true
    }

    /// Delivers or expires queue heads until nothing more can move.
    pub(crate) fn pump(&mut self) {
        while let Some(q) = self.queues.next_marked() {
            self.dispatch(q);
        }
    }

    fn dispatch(&mut self, q: QueueIndex) {
        while self.expire_head(q) {
            let Some((conn, consumer)) = self.pick_consumer(q) else {
                // Ready with nobody to take it: whoever watches the queue can come for it.
                let watchers = self.queues.get_mut(q).take_watchers();
                self.wakes.extend(watchers);
                return;
            };
            if let Some(m) = self.queues.get_mut(q).pop_head() {
                self.deliver(q, conn, consumer, m);
            }
        }
    }

    /// Dead-letters expired messages at the head of `q`; whether a live one is left there.
    fn expire_head(&mut self, q: QueueIndex) -> bool {
        let now = self.now;
        loop {
            let Some(head) = self.queues.get(q).head() else {
                return false;
            };
            if head.expires_at.is_none_or(|t| t > now) {
                return true;
            }
            if let Some(m) = self.queues.get_mut(q).pop_head() {
                self.dead_letter(q, m, DeathReason::Expired);
            }
        }
    }

    /// Whether `queue` has a message ready; if not, `waker` is woken when one is.
    pub(crate) fn watch(&mut self, queue: &str, waker: &Waker) -> Result<bool, BrokerError> {
        let q = self.queues.index_of(queue)?;
        if self.expire_head(q) {
            return Ok(true);
        }
        self.queues.get_mut(q).watch(waker);
        Ok(false)
    }

    // Deliver.

    /// The next consumer of `q` with room under its prefetch, round-robin.
    fn pick_consumer(&mut self, q: QueueIndex) -> Option<(usize, usize)> {
        let connections = &self.connections;
        self.queues
            .get_mut(q)
            .next_consumer(|conn, consumer| connections.has_room(conn, consumer))
    }

    /// Pushes `m` from `q` to consumer `consumer` of `conn`.
    fn deliver(&mut self, q: QueueIndex, conn: usize, consumer: usize, m: Stored) {
        let (handout, unacked) = self.hand_out(q, conn, Some(consumer), m);
        self.connections
            .push(conn, consumer, handout, unacked, &mut self.wakes);
    }

    /// Takes the message at the head of `queue` for `conn`, as `basic.get` does, and gives
    /// it to `receive`, which returns what the client keeps of it; `None` when nothing is
    /// ready. A missing queue is a channel error.
    pub(crate) fn get<R>(
        &mut self,
        conn: usize,
        queue: &str,
        receive: impl FnOnce(Handout) -> (R, Box<dyn Held>),
    ) -> Result<Option<R>, BrokerError> {
        let q = self.queue_on(conn, queue)?;
        if !self.expire_head(q) {
            return Ok(None);
        }
        let Some(m) = self.queues.get_mut(q).pop_head() else {
            return Ok(None);
        };
        let (handout, unacked) = self.hand_out(q, conn, None, m);
        let tag = handout.tag;
        let (r, held) = receive(handout);
        self.connections.hand_over(conn, tag, unacked, held);
        Ok(Some(r))
    }

    /// The next delivery pushed to consumer `consumer` of `conn`, given to `receive`; see
    /// [`Connections::recv`].
    pub(crate) fn recv<R>(
        &mut self,
        conn: usize,
        consumer: usize,
        waker: Option<&Waker>,
        receive: impl FnOnce(Handout) -> (R, Box<dyn Held>),
    ) -> Recv<R> {
        self.connections.recv(conn, consumer, waker, receive)
    }

    /// Delivers `m` from `q` on `conn`, to a consumer or to a get: it is unacknowledged
    /// there until settled or the connection closes.
    fn hand_out(
        &mut self,
        q: QueueIndex,
        conn: usize,
        consumer: Option<usize>,
        m: Stored,
    ) -> (Handout, Unacked) {
        let queue = self.queues.get_mut(q);
        queue.delivered();
        let quorum = queue.is_quorum();
        let queue_name = queue.name().clone();
        if let Some(copy) = self.faults.on_deliver(&m) {
            // The duplicate waits at the head, as a second copy of a message does after a
            // publisher retried a publish whose confirm it never saw.
            self.queues.get_mut(q).push_front(copy);
            self.queues.mark(q);
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
        let tag = self.connections.next_tag(conn);
        let message = self.tracing.then(|| MessageRef::new(key, &label));
        let handout = Handout {
            connection: conn,
            tag,
            queue: queue_name.clone(),
            exchange: exchange.clone(),
            routing_key: routing_key.clone(),
            body,
            properties,
            headers,
            redelivered,
        };
        let unacked = Unacked {
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
            delivered_at: self.now,
        };
        if let Some(message) = message {
            self.record(|| EventKind::Delivered {
                message,
                queue: queue_name,
                connection: conn as u64,
                tag,
                redelivered,
            });
        }
        (handout, unacked)
    }

    // Settle.

    /// Settles a delivery on `conn`. An unknown tag closes the channel, as on RabbitMQ.
    pub(crate) fn settle(
        &mut self,
        conn: usize,
        tag: u64,
        settlement: Settlement,
    ) -> Result<(), BrokerError> {
        self.connections.check_open(conn)?;
        let Some(taken) = self.connections.take(conn, tag) else {
            let reason = format!("PRECONDITION_FAILED - unknown delivery tag {tag}");
            self.close_connection(conn, &reason);
            return Err(BrokerError::ConnectionClosed(reason));
        };
        let u = taken.unacked();
        let q = u.queue;
        let message = MessageRef::new(u.key, &u.label);
        self.queues.get_mut(q).settled();
        let queue = self.queues.get(q).name().clone();
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
                let m = self.connections.restore(conn, taken);
                self.return_to_queue(q, m);
            }
            Settlement::Reject => {
                let mut m = self.connections.restore(conn, taken);
                m.redelivered = false;
                self.dead_letter(q, m, DeathReason::Rejected);
            }
        }
        // The consumer has room again.
        self.queues.mark(q);
        self.pump();
        Ok(())
    }

    /// A delivery goes back to its queue: flagged redelivered and, on quorum queues,
    /// counted, and dead-lettered once past the delivery limit.
    fn return_to_queue(&mut self, q: QueueIndex, mut m: Stored) {
        m.redelivered = true;
        let queue = self.queues.get_mut(q);
        if queue.is_quorum() {
            m.delivery_count = m.delivery_count.saturating_add(1);
            if queue.over_delivery_limit(m.delivery_count) {
                self.dead_letter(q, m, DeathReason::DeliveryLimit);
                return;
            }
        }
        queue.put_back(m);
        self.queues.mark(q);
    }

    // Dead-letter.

    /// Dead-letters `m` out of queue `q`, or discards it when the queue has no dead-letter
    /// exchange. Without a dead-letter routing key it keeps its own routing key, and it is
    /// routed like a publish, through exchange-to-exchange bindings too.
    fn dead_letter(&mut self, q: QueueIndex, mut m: Stored, reason: DeathReason) {
        let queue = self.queues.get(q);
        let queue_name = queue.name().clone();
        let Some(dlx) = queue.dead_letter_exchange().cloned() else {
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
        let at_least_once = queue.options().effective_at_least_once();
        let new_key = match queue.dead_letter_routing_key() {
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
            self.queues.get_mut(q).push_stuck(m, reason);
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
        let queue_name = self.queues.get(from).name().clone();
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
            targets.retain(|&t| !is_cycle(&m.headers, queues.get(t).name()));
        }
        if targets.is_empty() {
            self.routes = targets;
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
                routed.push(self.queues.get(t).name().clone());
            }
        }
        self.routes = targets;
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

    /// Tries again to route the at-least-once dead letters that found no queue, after the
    /// topology changed.
    fn retry_stuck_dead_letters(&mut self) {
        for q in 0..self.queues.len() {
            let stuck = self.queues.get_mut(q).take_stuck();
            for (m, reason) in stuck {
                if let Some(m) = self.route_dead_letter(q, m, reason) {
                    self.queues.get_mut(q).push_stuck(m, reason);
                }
            }
        }
        self.pump();
    }

    // Connections and consumers.

    pub(crate) fn open_connection(&mut self) -> usize {
        let id = self.connections.open();
        self.record(|| EventKind::ConnectionOpened {
            connection: id as u64,
        });
        id
    }

    /// `queue`, for a request on connection `conn`: a closed connection fails, and a missing
    /// queue is a channel error that closes the connection, as on RabbitMQ.
    fn queue_on(&mut self, conn: usize, queue: &str) -> Result<QueueIndex, BrokerError> {
        self.connections.check_open(conn)?;
        self.queues.index_of(queue).inspect_err(|e| {
            self.close_connection(conn, &e.to_string());
        })
    }

    /// Starts a consumer on `conn`; returns its index there.
    pub(crate) fn consume(
        &mut self,
        conn: usize,
        queue: &str,
        prefetch: u16,
    ) -> Result<usize, BrokerError> {
        let q = self.queue_on(conn, queue)?;
        let consumer = self.connections.add_consumer(conn, prefetch);
        let queue = self.queues.get_mut(q);
        queue.add_consumer(conn, consumer);
        let queue = queue.name().clone();
        self.record(|| EventKind::ConsumerStarted {
            connection: conn as u64,
            queue,
            prefetch,
        });
        self.queues.mark(q);
        self.pump();
        Ok(consumer)
    }

    /// Cancels consumer `consumer` of `conn`: nothing more is pushed to it, and its receiver
    /// learns that the stream ended. What it holds stays unacknowledged.
    pub(crate) fn cancel(&mut self, conn: usize, consumer: usize) {
        if self.connections.cancel(conn, consumer, &mut self.wakes) {
            self.queues.remove_consumer(conn, consumer);
        }
    }

    /// Closes a connection: its consumers go, and its unacknowledged deliveries return to
    /// their queues flagged redelivered. Returns whether it was open.
    pub(crate) fn close_connection(&mut self, conn: usize, reason: &str) -> bool {
        let reason: Arc<str> = Arc::from(reason);
        let Some(closed) = self.connections.close(conn, reason.clone()) else {
            return false;
        };
        for consumer in 0..closed.consumers {
            self.cancel(conn, consumer);
        }
        self.record(|| EventKind::ConnectionClosed {
            connection: conn as u64,
            reason,
        });
        for (tag, q, m) in closed.returned {
            self.put_back_unacked(tag, q, m);
        }
        self.pump();
        true
    }

    /// Delivery `tag`, taken off its connection unacknowledged, goes back to queue `q`
    /// flagged redelivered, as the broker requeues what a closed channel held.
    fn put_back_unacked(&mut self, tag: u64, q: QueueIndex, m: Stored) {
        self.queues.get_mut(q).settled();
        let message = MessageRef::new(m.key, &m.label);
        let queue = self.queues.get(q).name().clone();
        self.record(|| EventKind::Requeued {
            message,
            queue,
            tag,
            by_consumer: false,
        });
        self.return_to_queue(q, m);
    }

    // Time.

    /// The earliest virtual time something is due: a sleep ending, a queue head expiring, or
    /// a delivery passing the consumer timeout.
    pub(crate) fn next_deadline(&self) -> Option<Timestamp> {
        let timer = self.timers.next();
        let expiry = self.queues.next_expiry();
        let timeout = self.connections.next_timeout();
        [timer, expiry, timeout].into_iter().flatten().min()
    }

    /// Moves the clock to `t` (never backwards) and fires everything due by then. Only
    /// [`Shared::fire_due`] calls it, keeping the lock-free clock in step.
    fn fire_due(&mut self, t: Timestamp) {
        if t > self.now {
            self.now = t;
        }
        let now = self.now;
        self.timers.fire_due(now, &mut self.wakes);
        self.queues.mark_expired(now);
        self.pump();
        if let Some(limit) = self.connections.consumer_timeout() {
            for conn in self.connections.overdue(now, limit) {
                let reason = format!(
                    "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value used: {} ms",
                    limit.as_millis()
                );
                self.close_connection(conn, &reason);
            }
        }
    }

    // Inspection.

    /// Where each message has copies: the queues holding it ready, and whether a consumer
    /// holds one.
    pub(crate) fn copies(&self) -> HashMap<Arc<str>, (Vec<Arc<str>>, bool)> {
        let mut out: HashMap<Arc<str>, (Vec<Arc<str>>, bool)> = HashMap::new();
        for q in self.queues.iter() {
            for m in q.ready().chain(q.stuck()) {
                out.entry(m.label.clone())
                    .or_default()
                    .0
                    .push(q.name().clone());
            }
        }
        for label in self.connections.unacked_labels() {
            out.entry(label.clone()).or_default().1 = true;
        }
        out
    }

    /// Copies of the ready messages in queue `q`, head first.
    pub(crate) fn snapshot(&self, q: QueueIndex) -> Vec<QueuedMessage> {
        self.queues.get(q).snapshot()
    }
}
