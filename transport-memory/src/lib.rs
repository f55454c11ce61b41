//! # transport-memory
//!
//! A deterministic in-memory model of the RabbitMQ 3.10 behaviour the retry engine relies
//! on, with a virtual clock and fault injection, and a simulation API that runs the real
//! consumer driver ([`retry_core::Consumer`]) on it. A day of retries runs in
//! milliseconds, and the same script gives the same trace, byte for byte.
//!
//! The crate's README (`transport-memory/README.md`) is the simulation API in full, and the
//! guide, in the repository's `docs/` folder, explains what it simulates: suspects, crashes
//! and crash loops (`docs/concepts.md`).
//!
//! ## Design
//!
//! Three layers, each usable on its own, each in its own folder of `src/`. A layer uses the
//! ones below it and never the ones above:
//!
//! ```text
//! simulation/   Simulation, Script, Report, the executor, Broker::block_on
//!     │ runs the retry driver on
//! transport/    MemoryTransport, MemorySubscription: the engine's Transport; builds its
//!     │         Delivery and DeliveryFacts, declares its TopologyPlan
//!     │ a client of
//! broker/       Broker: the RabbitMQ model and its virtual clock; knows nothing of the
//!               retry engine, and hands messages out as plain data
//! ```
//!
//! * [`Broker`] (`broker/`): exchanges (direct, fanout, topic, the default exchange),
//!   bindings, queues with the arguments a [`TopologyPlan`](retry_core::TopologyPlan) uses,
//!   publisher confirms, consumers with prefetch, and a virtual clock. All state sits behind
//!   one mutex, split by what owns it: the topology (exchanges, bindings, routing), the
//!   queues, the connections (consumers, prefetch, unacknowledged deliveries) and the
//!   clock's timers; one core moves each message along publish → route → deliver → settle →
//!   dead-letter. Time moves only when [`Broker::step`], [`Broker::advance`] or a
//!   [`Simulation`] moves it, and every deadline (a message expiring, a sleep ending, a
//!   consumer timeout) fires at its exact virtual time. The broker gives each message a
//!   [`MessageKey`] at publish, which every copy of it carries.
//! * [`MemoryTransport`] (`transport/`): one client connection, implementing
//!   [`Transport`](retry_core::Transport). Its [`now`](retry_core::Transport::now) and
//!   [`sleep`](retry_core::Transport::sleep) are the broker's virtual clock; each
//!   subscription ([`MemorySubscription`]) is a consumer of its own whose `recv` is a future
//!   woken when a delivery arrives; `fetch` is `basic.get`; `ready` wakes exactly when a
//!   message becomes ready in the watched queue; and it recovers a closed connection the
//!   way lapin's automatic recovery does. A clone the engine publishes of a delivery keeps
//!   the delivery's [`MessageKey`]. It implements [`Admin`](retry_core::Admin) for
//!   operators' tools: a queue's ready count, a plan applied object by object, and a check
//!   that the plan's exchanges and queues exist.
//! * [`Simulation`] (`simulation/`): a single-threaded executor that polls consumer futures
//!   until none can make progress, then moves the clock to the earliest deadline and fires
//!   it, until nothing is left (or a virtual-time horizon is reached). Handlers follow
//!   per-message [`Script`]s; a [`Step::Crash`] kills the consumer process, dropping its
//!   future with its deliveries unsettled, and a new process starts after a restart delay.
//!   The [`Report`] says where every message ended, what each run did and when, and carries
//!   the [`Trace`]. [`Broker::block_on`] runs a single future the same way.
//!
//! The [`Trace`] belongs to the broker and every layer writes to it, so its events include
//! the driver's outcomes ([`EventKind::Terminal`]).
//!
//! ## A crash loop in a unit test
//!
//! ```
//! use retry_core::RetryPolicy;
//! use transport_memory::{Fate, Script, Simulation, Step};
//! use std::time::Duration;
//!
//! let policy = RetryPolicy::delays([60, 600, 3600].map(Duration::from_secs)).build()?;
//! let mut sim = Simulation::builder("comments", policy).with_prefetch(1).build()?;
//! sim.publish("poison", Script::always(Step::Crash))?;       // kills its consumer every time
//! sim.publish("flaky", Script::fail_times(2))?;              // fails twice, then succeeds
//!
//! let report = sim.run_until_quiet();
//! // Its first crash only makes it a suspect; then it runs alone. Three solo crashes are
//! // survived (the default crash limit); the fourth parks the message.
//! let poison = report.message("poison").unwrap();
//! assert_eq!(poison.fate, Fate::Parked { reason: "crash-loop".into() });
//! assert_eq!((poison.runs.len(), poison.crashes), (5, 4));
//! assert!(poison.runs[1..].iter().all(|run| run.solo));
//! assert!(matches!(report.fate("flaky"), Some(Fate::Handled { attempt: 3, .. })));
//! let totals = report.totals();
//! assert_eq!(totals.published, totals.handled + totals.parked);
//! println!("{}", report.trace); // every publish, delivery, ack, expiry and crash, timed
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## One consumer on the virtual clock
//!
//! A consumer can also be run by hand on the virtual clock: [`Broker::block_on`] polls it
//! until it stalls, then moves the clock to the next deadline, as the simulation does for
//! many consumers:
//!
//! ```
//! use std::time::Duration;
//! use retry_core::{Consumer, HandlerError, Message, RetryPolicy};
//! use transport_memory::{Broker, Outgoing};
//!
//! async fn handle(msg: Message) -> Result<(), HandlerError> {
//!     match msg.attempt() {
//!         1 => Err(HandlerError::transient("cold start")),
//!         _ => Ok(()),
//!     }
//! }
//!
//! let broker = Broker::new();
//! let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
//! let consumer = Consumer::builder(broker.connect(), "comments", policy, handle)
//!     .build()?;
//! broker.provision(consumer.plan())?;
//! broker.publish(Outgoing::to_queue("comments", b"hello".to_vec()))?;
//!
//! let stop = broker.sleep(Duration::from_secs(3600)); // shut down after an hour
//! let report = broker.block_on(consumer.run(stop))?;
//! assert_eq!((report.retried, report.handled), (1, 1));
//! // The retry came back after exactly 30 s of virtual time.
//! let trace = broker.trace().render();
//! assert!(trace.contains("00:00:30.000  dead-ltr"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## RabbitMQ behaviour modelled
//!
//! * Exchanges: direct, fanout, topic (`*` one word, `#` zero or more, the empty key no
//!   words: [`topic_matches`]) and the default exchange, with idempotent bindings.
//!   Exchange-to-exchange bindings ([`Broker::bind_exchange`]) are followed as RabbitMQ
//!   follows them: each exchange reached routes the same key through its own bindings, at
//!   most once per routing (so a cycle of bindings ends), and a queue reached by several
//!   paths gets one copy. The default exchange can be neither end of one. This carries the
//!   engine's delay cascade ([`Broker::provision_cascade`]): topic levels that skip a level
//!   through an exchange binding, and a delivery exchange that routes by destination.
//! * `x-message-ttl` and per-message `expiration`, the lower winning; only the head of a
//!   queue expires, so a long TTL at the head holds back shorter ones behind it (which is
//!   why the engine uses one queue per delay, or a cascade of levels each with a single
//!   TTL). A zero TTL delivers to a waiting consumer or expires at once. The expiration
//!   property is removed on dead-lettering and kept in `x-death` as
//!   `original-expiration`.
//! * `x-dead-letter-exchange` (`""` is the default exchange) and
//!   `x-dead-letter-routing-key` (without one, a dead letter keeps its own routing key, and
//!   is routed through exchange-to-exchange bindings like any publish); `x-death` as an
//!   array of tables, one per {queue, reason}, with `count`, `reason` (`expired`,
//!   `rejected`, `maxlen`, `delivery_limit`), `queue`, `exchange`, `routing-keys` and
//!   `time` (whole seconds), the latest death moved to the front with its count grown and
//!   its other fields kept from the first such death; `x-first-death-queue`, `-reason` and
//!   `-exchange`; dead-letter cycles without a rejection are dropped.
//! * `x-max-length` with `x-overflow` `drop-head` (dead-letter the oldest, reason `maxlen`)
//!   or `reject-publish` (nack the publish); only ready messages count. A classic queue
//!   refuses the publish that would exceed the limit, a quorum queue only once it is over
//!   it (so with `x-max-length: 0` it takes one message), as RabbitMQ 3.10 does.
//! * Quorum queues: `x-delivery-count` (absent on a consumer's first delivery, 0 on a
//!   first `basic.get`, then counting returns),
//!   `x-delivery-limit` (dead-letter with reason `delivery_limit`), at-least-once
//!   dead-lettering (kept until routable) where RabbitMQ honours it.
//! * Publisher confirms: ack, nack when a queue refuses, a return for an unroutable
//!   `mandatory` publish (the engine's clones are mandatory), a channel error for a
//!   missing exchange.
//! * Consumers: prefetch per consumer, round-robin between consumers of a queue, `basic.get`,
//!   unacknowledged deliveries returned to their place in the queue flagged redelivered when
//!   their connection closes, an unknown delivery tag closing the channel, and
//!   `consumer_timeout` (30 min by default) closing the channel of a consumer that holds a
//!   delivery too long.
//!
//! Not modelled: headers exchanges, alternate exchanges, unbinding, deleting exchanges or
//! queues, `CC`/`BCC` routing headers, priorities, `x-max-length-bytes`,
//! `reject-publish-dlx`, queue expiry (`x-expires`), lazy or stream queues, server-named
//! queues, multiple channels per connection, broker restarts and durability, transactions,
//! and flow control.
//!
//! ## Faults
//!
//! [`Broker::lose_publishes`], [`Broker::refuse_publishes`], [`Broker::lose_confirms`],
//! [`Broker::return_publishes`], [`Broker::misattribute_returns`],
//! [`Broker::duplicate_deliveries`], [`Broker::fail_watches`], [`Broker::fail_subscribes`],
//! [`Broker::late_fetches`] and [`Broker::lose_fetches`] affect the next N operations;
//! [`Broker::random_faults`] draws them from a seeded generator ([`FaultRates`]);
//! [`Broker::close_connection`] drops a connection. A late fetch keeps its message for the
//! next fetch on the connection (as transport-amqp10 does) and fails with
//! [`TransportError::Timeout`](retry_core::TransportError::Timeout); a lost fetch loses it
//! on the way, as a `get-ok` lost with its channel: the broker puts the message back at its
//! place (the head of the queue) flagged redelivered, and the fetch fails with
//! [`TransportError::FetchLost`](retry_core::TransportError::FetchLost). In a simulation,
//! [`SimEvent`]s schedule them (and graceful restarts) at virtual times, and
//! [`SimulationBuilder::with_crash_rate`] and
//! [`SimulationBuilder::with_connection_drop_rate`] add seeded crashes and disconnections to
//! handler runs.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod broker;
mod registration;
mod simulation;
mod transport;

pub use broker::clock::Sleep;
pub use broker::error::BrokerError;
pub use broker::exchange::topic_matches;
pub use broker::fault::FaultRates;
pub use broker::message::{MessageKey, Outgoing, QueuedMessage};
pub use broker::queue::{QueueOptions, QueueOverflow};
pub use broker::trace::{
    DeathReason, Event, EventKind, MessageRef, PublishOutcome, Publisher, Trace,
};
pub use broker::{Broker, BrokerBuilder, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_START, QueueStats};
pub use registration::registration;
pub use simulation::builder::{DEFAULT_HORIZON, SimulationBuilder};
pub use simulation::error::SimulationError;
pub use simulation::report::{
    ConsumerReport, ConsumerState, Fate, MessageEvent, MessageReport, Report, Run, Stop, Totals,
};
pub use simulation::script::{Script, Step};
pub use simulation::simulator::{SimEvent, Simulation};
pub use transport::connection::MemoryTransport;
pub use transport::delivery::DeliveryTag;
pub use transport::subscription::MemorySubscription;

/// The former name of [`QueueOverflow`], renamed so that it is not confused with
/// [`retry_core::Overflow`] (a plan's `x-overflow` argument).
///
/// ```
/// # #![allow(deprecated)]
/// use transport_memory::{Overflow, QueueOptions, QueueOverflow};
///
/// let old: Overflow = QueueOverflow::RejectPublish;
/// let options = QueueOptions::default().with_max_length(10).with_overflow(old);
/// # let _ = options;
/// ```
#[deprecated(
    note = "renamed QueueOverflow (retry_core::Overflow is the topology plan's x-overflow); Overflow goes in the next release"
)]
pub type Overflow = QueueOverflow;

// The README's Rust examples are compiled and run with the doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
