//! Client connections: their consumers with prefetch, and the deliveries the broker waits to
//! hear about.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use retry_core::{Headers, Properties, Timestamp};

use crate::broker::error::BrokerError;
use crate::broker::hash::FastMap;
use crate::broker::message::{Handout, Held, MessageKey, Stored};
use crate::broker::queues::QueueIndex;

/// Every connection ever opened; closed ones keep their ids.
#[derive(Debug)]
pub(crate) struct Connections {
    all: Vec<Connection>,
    /// The connections still open: closed ones stay in `all` for their ids, and a long crash
    /// loop leaves many, which per-step scans should not visit.
    open: BTreeSet<usize>,
    /// How long a delivery may stay unacknowledged before its connection is closed.
    consumer_timeout: Option<Duration>,
    /// Deliveries so far, redeliveries included.
    deliveries: u64,
    /// The connection and tag of each delivery a client holds, by [`Held::address`]: a
    /// clone's publish looks its original up here, however many deliveries are unsettled.
    held_at: FastMap<usize, (usize, u64)>,
}

/// A client connection with one channel.
#[derive(Debug, Default)]
struct Connection {
    closed: Option<Arc<str>>,
    consumers: Vec<ConsumerState>,
    unacked: InFlightWindow,
    next_tag: u64,
}

/// A consumer on a connection: one subscription, with its own prefetch and its own
/// deliveries waiting to be received.
#[derive(Debug)]
struct ConsumerState {
    prefetch: u16,
    unacked: usize,
    active: bool,
    /// Deliveries pushed to the client and not yet taken by `recv`.
    inbox: VecDeque<Handout>,
    waker: Option<Waker>,
}

/// A delivery the broker waits to hear about: where it came from, and what it needs to put
/// the message back. The content is not here: it went to the client with the message.
#[derive(Debug)]
pub(crate) struct Unacked {
    pub(crate) queue: QueueIndex,
    /// The consumer it was pushed to; `None` for a message taken with a get.
    pub(crate) consumer: Option<usize>,
    pub(crate) key: MessageKey,
    pub(crate) label: Arc<str>,
    pub(crate) seq: u64,
    pub(crate) exchange: Arc<str>,
    pub(crate) routing_key: Arc<str>,
    pub(crate) expiration: Option<Duration>,
    pub(crate) expires_at: Option<Timestamp>,
    pub(crate) delivery_count: u32,
    /// Whether delivery added `x-delivery-count` to the headers.
    pub(crate) counted: bool,
    pub(crate) delivered_at: Timestamp,
}

impl Unacked {
    /// The message as the queue held it before delivery, from what the client holds.
    fn restore_held(self, held: &dyn Held) -> Stored {
        let (body, properties, headers) = (held.body(), held.properties(), held.headers());
        self.restore(body.to_vec(), properties.clone(), headers.clone())
    }

    /// The message as the queue held it before delivery, from the content handed out.
    fn restore(self, body: Vec<u8>, properties: Properties, mut headers: Headers) -> Stored {
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
            body,
            properties,
            headers,
            expiration: self.expiration,
            expires_at: self.expires_at,
            redelivered: true,
            delivery_count: self.delivery_count,
        }
    }
}

/// An unacknowledged delivery and where its content is.
#[derive(Debug)]
struct InFlight {
    unacked: Unacked,
    copy: ClientCopy,
}

/// Where the content of an unacknowledged delivery is.
enum ClientCopy {
    /// In its consumer's inbox: pushed, not yet received.
    InInbox,
    /// With the client, which received it.
    Held(Box<dyn Held>),
}

impl std::fmt::Debug for ClientCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ClientCopy::InInbox => "InInbox",
            ClientCopy::Held(_) => "Held",
        })
    }
}

/// A connection's unacknowledged deliveries, by tag, oldest first.
///
/// Tags are handed out in increasing order and most deliveries are settled in about that
/// order, so they are kept in a ring indexed by tag from the oldest still in flight, rather
/// than in a tree: a tree's nodes, each with room for eleven deliveries, are large
/// allocations that the allocator serves slowly, one for every few deliveries. The price:
/// while one delivery stays unsettled, every tag handed out after it keeps a slot, settled
/// or not, until it is settled (or its connection closes, or the consumer timeout closes
/// it).
#[derive(Debug, Default)]
struct InFlightWindow {
    /// The tag of `slots[0]`.
    base: u64,
    /// One slot per tag from `base`; the first, when there is one, is occupied.
    slots: VecDeque<Option<InFlight>>,
    /// Occupied slots.
    len: usize,
}

impl InFlightWindow {
    fn insert(&mut self, tag: u64, in_flight: InFlight) {
        if self.len == 0 {
            self.slots.clear();
            self.base = tag;
        }
        while tag < self.base {
            self.slots.push_front(None);
            self.base -= 1;
        }
        let at = usize::try_from(tag - self.base).expect("a window of tags in memory");
        if at >= self.slots.len() {
            self.slots.resize_with(at + 1, || None);
        }
        if self.slots[at].replace(in_flight).is_none() {
            self.len += 1;
        }
    }

    fn slot(&self, tag: u64) -> Option<usize> {
        let at = usize::try_from(tag.checked_sub(self.base)?).ok()?;
        (at < self.slots.len()).then_some(at)
    }

    fn get(&self, tag: u64) -> Option<&InFlight> {
        self.slots[self.slot(tag)?].as_ref()
    }

    fn get_mut(&mut self, tag: u64) -> Option<&mut InFlight> {
        let at = self.slot(tag)?;
        self.slots[at].as_mut()
    }

    fn remove(&mut self, tag: u64) -> Option<InFlight> {
        let at = self.slot(tag)?;
        let in_flight = self.slots[at].take()?;
        self.len -= 1;
        // Settled slots at the front are dropped, so the oldest delivery is the first.
        while let Some(None) = self.slots.front() {
            self.slots.pop_front();
            self.base += 1;
        }
        Some(in_flight)
    }

    /// The deliveries, oldest first.
    fn values(&self) -> impl Iterator<Item = &InFlight> {
        self.slots.iter().flatten()
    }

    /// The deliveries with their tags, oldest first, leaving the window empty.
    fn drain(&mut self) -> impl Iterator<Item = (u64, InFlight)> + use<> {
        let base = self.base;
        self.len = 0;
        std::mem::take(&mut self.slots)
            .into_iter()
            .zip(base..)
            .filter_map(|(slot, tag)| Some((tag, slot?)))
    }
}

/// A delivery taken off its connection to be settled.
#[derive(Debug)]
pub(crate) struct Taken {
    tag: u64,
    in_flight: InFlight,
}

impl Taken {
    pub(crate) fn unacked(&self) -> &Unacked {
        &self.in_flight.unacked
    }
}

/// What closing a connection leaves to do.
#[derive(Debug)]
pub(crate) struct Closed {
    /// How many consumers it had, to cancel.
    pub(crate) consumers: usize,
    /// Its unacknowledged deliveries, by tag, as their queues held them, to return there.
    pub(crate) returned: Vec<(u64, QueueIndex, Stored)>,
}

/// What a consumer's `recv` found.
#[derive(Debug)]
pub(crate) enum Recv<R> {
    /// A delivery.
    Delivery(R),
    /// Nothing, and nothing more will come: the consumer was cancelled.
    Ended,
    /// Nothing yet.
    Pending,
}

impl Connections {
    pub(crate) fn new(consumer_timeout: Option<Duration>) -> Self {
        Connections {
            all: Vec::new(),
            open: BTreeSet::new(),
            consumer_timeout,
            deliveries: 0,
            held_at: FastMap::default(),
        }
    }

    /// Opens a connection; returns its id.
    pub(crate) fn open(&mut self) -> usize {
        let id = self.all.len();
        self.all.push(Connection::default());
        self.open.insert(id);
        id
    }

    /// How many connections were ever opened.
    pub(crate) fn len(&self) -> usize {
        self.all.len()
    }

    /// Why connection `conn` closed, if it did.
    pub(crate) fn closed(&self, conn: usize) -> Option<&Arc<str>> {
        self.all[conn].closed.as_ref()
    }

    /// Fails when connection `conn` is closed.
    pub(crate) fn check_open(&self, conn: usize) -> Result<(), BrokerError> {
        match self.closed(conn) {
            Some(reason) => Err(BrokerError::ConnectionClosed(reason.to_string())),
            None => Ok(()),
        }
    }

    /// Whether connection `conn` exists and is open.
    pub(crate) fn is_open(&self, conn: usize) -> bool {
        self.all.get(conn).is_some_and(|c| c.closed.is_none())
    }

    /// The broker's `consumer_timeout`.
    pub(crate) fn consumer_timeout(&self) -> Option<Duration> {
        self.consumer_timeout
    }

    /// Deliveries so far, redeliveries included.
    pub(crate) fn deliveries(&self) -> u64 {
        self.deliveries
    }

    /// Starts a consumer on `conn`; returns its index there.
    pub(crate) fn add_consumer(&mut self, conn: usize, prefetch: u16) -> usize {
        let consumers = &mut self.all[conn].consumers;
        consumers.push(ConsumerState {
            prefetch,
            unacked: 0,
            active: true,
            inbox: VecDeque::new(),
            waker: None,
        });
        consumers.len() - 1
    }

    /// Stops consumer `consumer` of `conn`, waking its receiver; `false` when there is no such
    /// consumer.
    pub(crate) fn cancel(&mut self, conn: usize, consumer: usize, wakes: &mut Vec<Waker>) -> bool {
        let Some(c) = self.all[conn].consumers.get_mut(consumer) else {
            return false;
        };
        c.active = false;
        if let Some(w) = c.waker.take() {
            wakes.push(w);
        }
        true
    }

    /// Whether consumer `consumer` of `conn` takes deliveries and has room under its
    /// prefetch.
    pub(crate) fn has_room(&self, conn: usize, consumer: usize) -> bool {
        let c = &self.all[conn].consumers[consumer];
        c.active && (c.prefetch == 0 || c.unacked < usize::from(c.prefetch))
    }

    /// The tag of the next delivery on `conn`.
    pub(crate) fn next_tag(&mut self, conn: usize) -> u64 {
        let connection = &mut self.all[conn];
        connection.next_tag += 1;
        connection.next_tag
    }

    fn track(&mut self, conn: usize, tag: u64, unacked: Unacked, copy: ClientCopy) {
        self.deliveries += 1;
        self.all[conn]
            .unacked
            .insert(tag, InFlight { unacked, copy });
    }

    /// Pushes a delivery to consumer `consumer` of `conn`, waking its receiver.
    pub(crate) fn push(
        &mut self,
        conn: usize,
        consumer: usize,
        handout: Handout,
        unacked: Unacked,
        wakes: &mut Vec<Waker>,
    ) {
        self.track(conn, handout.tag, unacked, ClientCopy::InInbox);
        let c = &mut self.all[conn].consumers[consumer];
        c.unacked += 1;
        c.inbox.push_back(handout);
        if let Some(w) = c.waker.take() {
            wakes.push(w);
        }
    }

    /// Records a delivery taken with a get, which the client holds at once.
    pub(crate) fn hand_over(
        &mut self,
        conn: usize,
        tag: u64,
        unacked: Unacked,
        held: Box<dyn Held>,
    ) {
        self.held_at.insert(held.address(), (conn, tag));
        self.track(conn, tag, unacked, ClientCopy::Held(held));
    }

    /// The next delivery waiting for consumer `consumer` of `conn`, given to `receive`,
    /// which returns what the client keeps of it. Without one, `waker` (if any) is woken
    /// when one arrives.
    pub(crate) fn recv<R>(
        &mut self,
        conn: usize,
        consumer: usize,
        waker: Option<&Waker>,
        receive: impl FnOnce(Handout) -> (R, Box<dyn Held>),
    ) -> Recv<R> {
        let connection = &mut self.all[conn];
        let c = &mut connection.consumers[consumer];
        match c.inbox.pop_front() {
            Some(handout) => {
                let tag = handout.tag;
                let (r, held) = receive(handout);
                // A delivery settled before it was received is not in flight any more.
                if let Some(in_flight) = connection.unacked.get_mut(tag) {
                    self.held_at.insert(held.address(), (conn, tag));
                    in_flight.copy = ClientCopy::Held(held);
                }
                Recv::Delivery(r)
            }
            None if !c.active => Recv::Ended,
            None => {
                if let Some(w) = waker {
                    c.waker = Some(w.clone());
                }
                Recv::Pending
            }
        }
    }

    /// Takes delivery `tag` of `conn` off the connection to settle it; `None` for an unknown
    /// tag.
    pub(crate) fn take(&mut self, conn: usize, tag: u64) -> Option<Taken> {
        let connection = &mut self.all[conn];
        let in_flight = connection.unacked.remove(tag)?;
        if let Some(ci) = in_flight.unacked.consumer {
            connection.consumers[ci].unacked -= 1;
        }
        if let ClientCopy::Held(held) = &in_flight.copy {
            self.held_at.remove(&held.address());
        }
        Some(Taken { tag, in_flight })
    }

    /// The message of a taken delivery as its queue held it, flagged redelivered.
    pub(crate) fn restore(&self, conn: usize, taken: Taken) -> Stored {
        let Taken { tag, in_flight } = taken;
        let InFlight { unacked, copy } = in_flight;
        match copy {
            ClientCopy::Held(held) => unacked.restore_held(held.as_ref()),
            ClientCopy::InInbox => {
                // Settled before it was received: the inbox keeps it, as a client library
                // keeps a delivery it has not handed out yet.
                let consumer = unacked
                    .consumer
                    .expect("a delivery in an inbox was pushed to a consumer");
                let h = self.all[conn].consumers[consumer]
                    .inbox
                    .iter()
                    .find(|h| h.tag == tag)
                    .expect("a delivery not yet received is in its consumer's inbox");
                unacked.restore(h.body.clone(), h.properties.clone(), h.headers.clone())
            }
        }
    }

    /// Closes `conn`: its inboxes are emptied and its unacknowledged deliveries taken, to go
    /// back to their queues. `None` when it was already closed or never opened.
    pub(crate) fn close(&mut self, conn: usize, reason: Arc<str>) -> Option<Closed> {
        let connection = self.all.get_mut(conn)?;
        if connection.closed.is_some() {
            return None;
        }
        connection.closed = Some(reason);
        self.open.remove(&conn);
        let unacked = connection.unacked.drain();
        let mut waiting: BTreeMap<u64, Handout> = BTreeMap::new();
        for c in &mut connection.consumers {
            waiting.extend(c.inbox.drain(..).map(|h| (h.tag, h)));
        }
        let held_at = &mut self.held_at;
        let returned = unacked
            .map(|(tag, InFlight { unacked, copy })| {
                let q = unacked.queue;
                let m = match copy {
                    ClientCopy::Held(held) => {
                        held_at.remove(&held.address());
                        unacked.restore_held(held.as_ref())
                    }
                    ClientCopy::InInbox => {
                        let h = waiting
                            .remove(&tag)
                            .expect("a delivery not yet received is in its consumer's inbox");
                        unacked.restore(h.body, h.properties, h.headers)
                    }
                };
                (tag, q, m)
            })
            .collect();
        Some(Closed {
            consumers: connection.consumers.len(),
            returned,
        })
    }

    /// The earliest time an open connection's oldest delivery passes the consumer timeout.
    pub(crate) fn next_timeout(&self) -> Option<Timestamp> {
        let limit = self.consumer_timeout?;
        self.open
            .iter()
            .filter_map(|&c| self.all[c].unacked.values().next())
            .map(|f| f.unacked.delivered_at + limit)
            .min()
    }

    /// The open connections holding a delivery for `limit` or longer at `now`.
    pub(crate) fn overdue(&self, now: Timestamp, limit: Duration) -> Vec<usize> {
        self.open
            .iter()
            .copied()
            .filter(|&c| {
                self.all[c]
                    .unacked
                    .values()
                    .next()
                    .is_some_and(|f| f.unacked.delivered_at + limit <= now)
            })
            .collect()
    }

    /// The labels of the messages open connections hold unacknowledged.
    pub(crate) fn unacked_labels(&self) -> impl Iterator<Item = &Arc<str>> {
        self.open
            .iter()
            .flat_map(|&c| self.all[c].unacked.values())
            .map(|f| &f.unacked.label)
    }

    /// The identity of the message a client holds at `address` ([`Held::address`]), on
    /// whichever connection holds it.
    pub(crate) fn find_held(&self, address: usize) -> Option<(MessageKey, Arc<str>)> {
        let &(conn, tag) = self.held_at.get(&address)?;
        let f = self.all.get(conn)?.unacked.get(tag)?;
        Some((f.unacked.key, f.unacked.label.clone()))
    }
}
