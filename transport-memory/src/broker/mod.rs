//! The broker model: a deterministic RabbitMQ 3.10 with a virtual clock. It knows nothing of
//! the retry engine: messages go out of it as plain data, and the one engine type in it is the
//! driver outcome its [`trace`] records for the layers above.
//!
//! [`Broker`] is the handle. Behind it, [`core`] holds the state under one lock and moves
//! messages along publish → route → enqueue → deliver → settle → dead-letter, calling into
//! the types that own each part of the state:
//!
//! * [`topology`]: exchanges and their bindings to queues and to other exchanges
//!   ([`exchange`]), and routing;
//! * [`queues`]: the queues ([`queue`]), their messages and consumers' places;
//! * [`connections`]: consumers with their prefetch, and unacknowledged deliveries;
//! * [`timers`]: sleeps on the virtual clock ([`clock`] has the [`Sleep`] future);
//! * [`fault`]: injected faults; [`dead_letter`]: `x-death` records; [`trace`]: the event
//!   log every layer writes to.
//!
//! Messages come in as [`Outgoing`] and go out to clients as plain
//! [`Handout`](message::Handout)s; the transport layer makes the retry engine's deliveries of
//! them, and defines [`Broker::connect`] and [`Broker::provision`], which speak the engine's
//! types.

pub(crate) mod clock;
pub(crate) mod connections;
pub(crate) mod core;
pub(crate) mod dead_letter;
pub(crate) mod error;
pub(crate) mod exchange;
pub(crate) mod fault;
pub(crate) mod hash;
pub(crate) mod message;
pub(crate) mod queue;
pub(crate) mod queues;
pub(crate) mod timers;
pub(crate) mod topology;
pub(crate) mod trace;

use std::sync::Arc;
use std::time::Duration;

use retry_core::{Confirm, ExchangeKind, Timestamp};

use self::clock::Sleep;
use self::core::{Shared, State};
use self::error::BrokerError;
use self::fault::{FaultRates, Faults};
use self::message::{Outgoing, Publishing, QueuedMessage};
use self::queue::QueueOptions;
use self::trace::{EventKind, Publisher, Trace};

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
            .field("now", &state.now())
            .field("queues", &state.queues().len())
            .field("connections", &state.connections().len())
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
    pub fn with_start_at(mut self, start: Timestamp) -> Self {
        self.start = start;
        self
    }

    /// How long a delivery may stay unacknowledged before the broker closes its connection,
    /// as RabbitMQ's `consumer_timeout` does (default 30 minutes; `None` turns it off).
    pub fn with_consumer_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// Whether to record the event trace (default on). Off, the broker does less work per
    /// message; the trace is then empty.
    pub fn with_trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }

    /// The broker.
    pub fn build(self) -> Broker {
        let state = State::new(self.start, self.consumer_timeout, self.trace);
        Broker {
            shared: Arc::new(Shared::new(state)),
        }
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

    /// Binds the exchange `destination` to the exchange `source` with `routing_key`, as
    /// AMQP 0-9-1's `exchange.bind` does: a message `source` routes with this binding goes
    /// on through `destination`'s bindings, with its routing key unchanged.
    ///
    /// As on RabbitMQ: binding the same pair with the same key again is a no-op; a missing
    /// exchange is [`BrokerError::ExchangeNotFound`] naming it; the default exchange (`""`)
    /// can be neither end ([`BrokerError::AccessRefused`]). A routing visits each exchange at
    /// most once, so a cycle of bindings ends, and puts one copy in each queue it reaches,
    /// however many paths lead there.
    ///
    /// ```
    /// use retry_core::ExchangeKind;
    /// use transport_memory::{Broker, BrokerError, Outgoing, QueueOptions};
    ///
    /// let broker = Broker::new();
    /// broker.declare_exchange("events", ExchangeKind::Topic)?;
    /// broker.declare_exchange("orders", ExchangeKind::Direct)?;
    /// broker.declare_queue("orders.created", QueueOptions::new())?;
    /// broker.bind("orders", "orders.created", "order.created")?;
    /// broker.bind_exchange("events", "orders", "order.#")?;
    ///
    /// broker.publish(Outgoing::new("events", "order.created", b"{}".to_vec()))?;
    /// assert_eq!(broker.ready("orders.created"), Some(1));
    ///
    /// assert_eq!(
    ///     broker.bind_exchange("events", "audit", "#"),
    ///     Err(BrokerError::ExchangeNotFound("audit".into()))
    /// );
    /// assert!(matches!(
    ///     broker.bind_exchange("", "orders", "order.created"),
    ///     Err(BrokerError::AccessRefused(_))
    /// ));
    /// # Ok::<(), BrokerError>(())
    /// ```
    pub fn bind_exchange(
        &self,
        source: &str,
        destination: &str,
        routing_key: &str,
    ) -> Result<(), BrokerError> {
        self.shared
            .with(|s| s.bind_exchange(source, destination, routing_key))
    }

    /// Publishes as a producer with publisher confirms: `Ack` when routed (or dropped
    /// without `mandatory`), `Nack` when a `reject-publish` queue is full, `Returned` when
    /// `mandatory` and unroutable. Injected faults do not apply to the producer. An unknown
    /// exchange is an error.
    pub fn publish(&self, message: Outgoing) -> Result<Confirm, BrokerError> {
        self.shared
            .with(|s| s.publish(Publisher::Producer, Publishing::from(message)))
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
        let q = s.queues().get(s.queues().find(queue)?);
        Some(QueueStats {
            ready: q.ready_len(),
            unacked: q.unacked(),
            consumers: q.consumer_count(),
            stuck_dead_letters: q.stuck_len(),
        })
    }

    /// Copies of the ready messages in `queue`, head first.
    pub fn messages(&self, queue: &str) -> Result<Vec<QueuedMessage>, BrokerError> {
        let s = self.shared.lock();
        let q = s.queues().index_of(queue)?;
        Ok(s.snapshot(q))
    }

    /// The names of the declared queues, in declaration order.
    pub fn queue_names(&self) -> Vec<String> {
        let s = self.shared.lock();
        s.queues().iter().map(|q| q.name().to_string()).collect()
    }

    /// Whether connection `id` is open.
    pub fn is_open(&self, id: u64) -> bool {
        let s = self.shared.lock();
        usize::try_from(id).is_ok_and(|i| s.connections().is_open(i))
    }

    /// Deliveries to consumers so far, redeliveries included.
    pub fn deliveries(&self) -> u64 {
        self.shared.lock().connections().deliveries()
    }

    /// A copy of the event trace so far.
    pub fn trace(&self) -> Trace {
        self.shared.lock().trace().clone()
    }
}

/// Fault injection.
impl Broker {
    fn fault(&self, description: String, f: impl FnOnce(&mut Faults)) {
        self.shared.with(|s| {
            f(s.faults());
            let description = Arc::from(description);
            s.record(|| EventKind::Fault { description });
        });
    }

    /// The next `n` publishes through any connection never reach the broker: the publisher
    /// sees [`PublishResult::Failed`](retry_core::PublishResult::Failed).
    pub fn lose_publishes(&self, n: u32) {
        self.fault(format!("lose the next {n} publishes"), |f| {
            f.lose_publishes(n);
        });
    }

    /// The next `n` publishes through any connection are refused with a negative confirm.
    pub fn refuse_publishes(&self, n: u32) {
        self.fault(format!("refuse the next {n} publishes"), |f| {
            f.refuse_publishes(n);
        });
    }

    /// The next `n` publishes through any connection are routed, but their confirms are
    /// lost: the publisher sees a failure while the message is in its queue, so the engine's
    /// requeue of the original makes a duplicate.
    pub fn lose_confirms(&self, n: u32) {
        self.fault(
            format!("lose the confirms of the next {n} publishes"),
            |f| f.lose_confirms(n),
        );
    }

    /// The next `n` deliveries are each followed by a second copy of the same message.
    pub fn duplicate_deliveries(&self, n: u32) {
        self.fault(format!("duplicate the next {n} deliveries"), |f| {
            f.duplicate_deliveries(n);
        });
    }

    /// The next `n` publishes through any connection route nowhere, as if their binding
    /// were gone: a `mandatory` one comes back
    /// [`PublishResult::Returned`](retry_core::PublishResult::Returned).
    pub fn return_publishes(&self, n: u32) {
        self.fault(format!("return the next {n} publishes"), |f| {
            f.return_publishes(n);
        });
    }

    /// The next `n` watches of a queue ([`Transport::ready`](retry_core::Transport::ready))
    /// fail with a lost connection.
    pub fn fail_watches(&self, n: u32) {
        self.fault(format!("fail the next {n} watches"), |f| f.fail_watches(n));
    }

    /// The next `n` subscribes ([`Transport::consume`](retry_core::Transport::consume)) fail
    /// with a lost connection.
    pub fn fail_subscribes(&self, n: u32) {
        self.fault(format!("fail the next {n} subscribes"), |f| {
            f.fail_subscribes(n);
        });
    }

    /// The next `n` fetches that find a message give up (time out) before it arrives; the
    /// next fetch on the same connection gets it.
    pub fn late_fetches(&self, n: u32) {
        self.fault(format!("make the next {n} fetches late"), |f| {
            f.late_fetches(n);
        });
    }

    /// The next `n` fetches that find a message lose it on its way, as a `get-ok` is lost
    /// with its channel: the broker puts the message back at its place in the queue (the
    /// head) flagged redelivered, and the fetch fails with
    /// [`TransportError::FetchLost`](retry_core::TransportError::FetchLost).
    ///
    /// ```
    /// use futures::FutureExt;
    /// use retry_core::{Transport, TransportError};
    /// use transport_memory::{Broker, Outgoing, QueueOptions};
    ///
    /// let broker = Broker::new();
    /// broker.declare_queue("work.suspect", QueueOptions::new())?;
    /// for body in ["innocent", "next"] {
    ///     broker.publish(Outgoing::to_queue("work.suspect", body.as_bytes().to_vec()))?;
    /// }
    /// broker.lose_fetches(1);
    ///
    /// let conn = broker.connect();
    /// let lost = conn.fetch("work.suspect").now_or_never().expect("ready");
    /// assert!(matches!(lost, Err(TransportError::FetchLost { .. })));
    /// // Back at the head, before "next", flagged redelivered through no crash of its own.
    /// let again = conn.fetch("work.suspect").now_or_never().expect("ready")?.expect("a message");
    /// assert_eq!(again.message.body(), b"innocent");
    /// assert!(again.facts.redelivered);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn lose_fetches(&self, n: u32) {
        self.fault(format!("lose the next {n} fetches in flight"), |f| {
            f.lost_fetches(n);
        });
    }

    /// The next `n` batches of publisher confirms are completed out of order, each return
    /// handed to whichever confirm completes first, as lapin 4.12 does.
    pub fn misattribute_returns(&self, n: u32) {
        self.fault(
            format!("misattribute the returns of the next {n} confirm batches"),
            |f| {
                f.misattribute_returns(n);
            },
        );
    }

    /// From now on, faults at random with these rates, from a generator seeded with `seed`.
    pub fn random_faults(&self, seed: u64, rates: FaultRates) {
        self.fault(format!("random faults, seed {seed}: {rates:?}"), |f| {
            f.random(seed, rates);
        });
    }

    /// Stops random and pending counted faults.
    pub fn clear_faults(&self) {
        self.fault("clear faults".to_owned(), Faults::clear);
    }
}
