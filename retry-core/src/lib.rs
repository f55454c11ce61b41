//! # retry-core
//!
//! The sans-IO heart of a broker-agnostic retry engine: it decides what happens to a message
//! whose handler failed, and what the broker must look like for that to work. It does no IO,
//! reads no clock and spawns nothing; transports (AMQP 0-9-1, AMQP 1.0, in-memory) feed it
//! and carry out what it asks.
//!
//! ## Design
//!
//! * [`RetryPolicy`]: attempts, backoff ([`Backoff`]), seeded [`Jitter`], a cap on elapsed
//!   time, immediate (in-process) retries, a crash limit, and what happens when attempts run
//!   out. Invalid policies are refused by [`RetryPolicyBuilder::build`] with a
//!   [`PolicyError`] naming the field.
//! * [`DeliveryFacts`]: what is known about a delivery, decoded from its [`Headers`] and the
//!   broker's [`BrokerSignals`] without allocating. Malformed values are read as absent and
//!   listed in [`DeliveryFacts::malformed`]; decoding never panics.
//! * [`admit`] and [`decide`]: the pure decision functions.
//! * [`Engine`]: the state machine around them, in the style of `quinn-proto`. `handle_*`
//!   methods feed inputs, each given the time; [`Engine::poll_action`] drains
//!   [`Action`]s; [`Engine::poll_timeout`] is the deadline of the next in-process wait,
//!   where the driver calls [`Engine::handle_timeout`]. It carries the caller's data for
//!   each delivery and hands it back when the delivery is settled.
//!   Every move is *publish, await confirm, then settle the original*; a refused,
//!   returned or failed publish requeues the original. Duplicates are possible, loss is not.
//! * [`TopologyPlan`]: the exchanges, queues (with TTL and dead-letter arguments) and bindings
//!   a work queue needs, as data. The core computes the route of every delay: through one
//!   TTL queue per delay of the policy ([`DelayStrategy::PerDelayQueue`]), or through a
//!   binary cascade of levels shared by every work queue ([`DelayStrategy::Cascade`],
//!   [`CascadePlan`]), which takes any delay to the unit without it waiting behind a
//!   longer one.
//!
//! ## The async edge
//!
//! * [`Transport`]: what a broker binding implements: subscribe to a queue ([`Subscription`],
//!   each with its own channel or link, prefetch and acknowledgement batching), fetch one
//!   message at a time, publish with confirmation ([`PublishResult`]), settle, provision or
//!   verify a plan, and say what it can do ([`Capabilities`]). Time comes from the transport too, so a
//!   simulated broker can run the same code on a virtual clock.
//! * [`Handler`]: the user's code; plain `async fn(Message) -> Result<(), HandlerError>`
//!   functions and closures are handlers.
//! * [`Consumer`]: the driver. It runs up to `prefetch` handlers at once inside one future
//!   (it spawns nothing and depends on no runtime), feeds the engine and carries out its
//!   actions in order, treats panics and timeouts as transient failures, runs suspects alone
//!   (see below), and shuts down gracefully, sending every acknowledgement it owes and
//!   leaving unfinished deliveries to the broker. Settings that could hold a delivery past
//!   the broker's `consumer_timeout` are refused when it is built.
//! * [`ParkingLot`]: the operator's side of the parking queue, on any transport: browse the
//!   [`ParkedRecord`] of each parked message, replay the ones a [`ParkedFilter`] matches to
//!   the work queue with their counters reset and their history kept ([`replay_headers`]),
//!   or purge them. It reads the queue through a [`QueueWalk`] ([`Transport::walk`]), which
//!   leaves what it does not take in place, and holds one message at a time.
//!   `retryctl parked` (transport-amqp091's `cli` feature) is this API on RabbitMQ.
//!
//! ## The run loop
//!
//! A driver owns the IO; the engine owns the decisions. [`Consumer`] is this loop; the
//! engine can also be driven by hand:
//!
//! ```
//! use retry_core::*;
//! use std::time::Duration;
//!
//! let policy = RetryPolicy::delays([Duration::from_secs(30), Duration::from_secs(600)]).build()?;
//! let plan = TopologyPlan::new("comments", &policy)?; // a transport declares this
//! let mut engine = Engine::new(policy, &plan)?;
//! let mut now = Timestamp::from_millis(0);
//!
//! // Receive: decode the facts, hand the delivery in.
//! let headers = Headers::new();
//! let facts = DeliveryFacts::decode(&headers, BrokerSignals::default(), message_identity(None, b"hi"));
//! engine.handle_delivery(now, Lane::Work, facts, ());
//!
//! // Drain actions and carry them out, feeding results back, until the engine is idle.
//! loop {
//!     let Some(action) = engine.poll_action() else {
//!         // Nothing to do now: sleep until an in-process wait ends, or stop when none does.
//!         let Some(due) = engine.poll_timeout() else { break };
//!         now = due;
//!         engine.handle_timeout(now);
//!         continue;
//!     };
//!     match action {
//!         Action::RunHandler { delivery, .. } => {
//!             let outcome = Outcome::Transient("downstream timeout".into()); // run the handler
//!             engine.handle_outcome(now, delivery, outcome)?;
//!         }
//!         Action::Publish { delivery, publish } => {
//!             // Publish the clone to publish.route with confirms, then report the confirm.
//!             assert_eq!(&*publish.route.routing_key, "comments.retry.30s");
//!             engine.handle_confirm(now, delivery, Confirm::Ack)?;
//!         }
//!         Action::Settle { settlement, terminal, .. } => {
//!             // Ack or requeue the original on the broker.
//!             assert_eq!(settlement, Settlement::Ack);
//!             assert!(matches!(terminal, Terminal::Retried { attempts: 1, .. }));
//!         }
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The same loop on a real broker, with plain lapin doing the publishes, confirms and acks,
//! is `transport-amqp091/examples/embedded.rs` (`cargo run -p transport-amqp091 --example
//! embedded`); [`Terminal`]'s `Display` and [`Terminal::is_final`],
//! [`TopologyPlan::lane_queue`] and `Outcome::from(handler_result)` are the helpers it uses.
//!
//! ## Header schema
//!
//! The engine keeps its state on the message, in headers it owns (AMQP 0-9-1 headers, AMQP
//! 1.0 application properties). The body is never touched. Times are integers counting
//! milliseconds since the Unix epoch.
//!
//! | header | type | meaning |
//! |---|---|---|
//! | `x-retry-attempts` | integer | handler runs that failed so far |
//! | `x-retry-crashes` | integer | deliveries lost to a consumer crash so far |
//! | `x-retry-first-failure` | integer (ms) | first failure or crash |
//! | `x-retry-last-failure` | integer (ms) | latest failure or crash |
//! | `x-retry-last-error` | string, ≤ 1024 bytes | the latest failure's cause, cut at a character boundary |
//! | `x-retry-origin-queue` | string | the queue the message was consumed from when it first failed |
//! | `x-retry-origin-exchange` | string | the exchange of that delivery |
//! | `x-retry-origin-routing-key` | string | the routing key of that delivery |
//! | `x-retry-reason` | string | on parked messages: `attempts-exhausted`, `max-elapsed`, `permanent` or `crash-loop` |
//! | `x-retry-delay` | integer (ms) | on delayed copies: the delay they went through |
//! | `x-retry-replays` | integer | on replayed copies: times replayed from the parking queue |
//! | `x-retry-replayed-at` | integer (ms) | on replayed copies: the latest replay |
//! | `x-retry-previous-reason` | string | on replayed copies: the reason it had been parked with |
//! | `x-retry-previous-error` | string | on replayed copies: the last error it had been parked with |
//! | `x-retry-probe` | any | marks a topology probe: consumers acknowledge it without running the handler |
//! | `x-retry-suspect` | integer | on a suspect's copy in the isolation queue: a token unique to that copy, which excuses are keyed by |
//! | `x-retry-publish-id` | integer | a transport's stamp on one publish, so that a returned message names its publish ([`ReturnMatcher`]); clones drop it |
//!
//! Counters above [`MAX_COUNTER`], negative numbers, times past the year 9999, wrong types
//! and garbage bytes are read as absent and reported in [`Malformed`]. The broker's own
//! counters are read too: `x-death` (summed into [`DeliveryFacts::deaths`]), quorum
//! `x-delivery-count` (into [`DeliveryFacts::x_delivery_count`], which the engine trusts only
//! when its plan's queues are quorum queues: on a classic queue only a publisher can have set
//! it), AMQP 1.0 `delivery-count` (into [`DeliveryFacts::delivery_count`]), and the
//! redelivered flag or AMQP 1.0 `first-acquirer`. Clones drop the broker-owned headers listed
//! in [`headers::BROKER_OWNED`].
//!
//! ## Crash attribution
//!
//! The redelivered flag (or a broker delivery count) says a consumer went away holding a
//! delivery. It does not say which delivery killed it: with prefetch 20, one poison message
//! takes 19 bystanders down with it, and a dropped connection or a requeue looks the same.
//! So a redelivered delivery is never blamed on sight:
//!
//! 1. A delivery that arrives redelivered from the work queue is a **suspect**. It is cloned,
//!    with a confirm, into the plan's isolation queue (`Q.suspect`) and the original is
//!    acknowledged ([`Terminal::Isolated`]). No crash is counted and its handler does not run.
//! 2. Suspects **run alone**. When the isolation queue has messages, the consumer stops
//!    starting work-queue handlers, lets the running ones finish and settle, sends its
//!    batched acknowledgements, then fetches exactly one suspect and runs it with nothing
//!    else running; it settles it and fetches the next, until the queue is empty or the
//!    [solo limit](ConsumerBuilder::with_solo_limit) is reached, and the work lane resumes.
//! 3. Only a suspect that comes back **redelivered from the isolation queue** counts a crash:
//!    it was the only thing running when its consumer died. It goes through the crash delay
//!    back to the isolation queue ([`Terminal::Diverted`]), and past the crash limit it is
//!    parked with reason `crash-loop`. A suspect whose connection dropped while it ran, in a
//!    process that saw the drop, or that was requeued after its clone could not be
//!    published, is excused by that process ([`Engine::excuse`], [`Excuses`]): the excuse
//!    is keyed by the token the engine wrote on that very copy (`x-retry-suspect`), so
//!    another message with the same id or body cannot use it, and the process claims the
//!    suspect again before any work runs.
//! 4. A suspect that succeeds is handled; one that fails takes the normal retry path, back
//!    to the work queue through its delay queues.
//!
//! "Alone" holds for the process, since a crash takes the whole process down: consumers
//! of one process pass through one [`SoloGate`] (on the in-memory broker, whose consumers
//! run in virtual time, consumers of one broker do), and while one of them runs suspects, every
//! other one has drained, flushed its acknowledgements and starts nothing. They share
//! their excuses through it too. The [`Consumer`] keeps to the rules that make a crash the
//! only way a suspect can come back redelivered from the isolation queue:
//!
//! * a solo phase ends only with nothing held and no fetch under way; a fetch that fails
//!   keeps the solo phase and is tried again before anything else runs, since a transport
//!   may hold the message of a fetch that gave up, on its way, for the next fetch;
//! * a suspect fetched once shutdown has begun is not run but put back as a fresh copy
//!   ([`Engine::handle_declined`], [`RunReport::declined`]), and a graceful shutdown puts
//!   back fresh the suspects the process excused, which the next process could not know;
//! * a requeue of a suspect that showed a crash keeps that crash: it is recorded nowhere
//!   else.
//!
//! The path of a poison message that kills every consumer running it, with a crash limit
//! of 2:
//!
//! ```text
//!  Q ──run with 19 others: the process dies──▶ Q (redelivered, as are the 19)
//!  Q ──suspect: isolated, 0 crashes──────────▶ Q.suspect
//!  Q.suspect ──runs alone: the process dies──▶ Q.suspect (redelivered)
//!  Q.suspect ──crash 1──▶ Q.crash.<delay> ──TTL──▶ Q.suspect ──runs alone: dies──▶ …
//!  Q.suspect ──crash 2──▶ Q.crash.<delay> ──TTL──▶ Q.suspect ──runs alone: dies──▶ …
//!  Q.suspect ──crash 3 > limit──▶ Q.parking (reason crash-loop, crashes 3)
//! ```
//!
//! The 19 bystanders each cost one solo run and are handled; none of them is ever blamed.
//! Work deliveries prefetched but not started during a solo run that crashes come back
//! redelivered too, and become suspects in turn. On quorum queues the broker's
//! `x-delivery-limit` stays a backstop: the broker parks a message returned that often,
//! whatever the engine decided.
//!
//! ## Metrics
//!
//! [`Consumer`] emits through the [`metrics`](https://docs.rs/metrics) facade, so you pick
//! the exporter (`metrics-exporter-prometheus`, OpenTelemetry, StatsD…): install its
//! recorder before the consumer runs. The handles are registered once when a run starts,
//! with every label value the run can use, so each series exists from the start at 0. With
//! no recorder installed, each emission is a branch on a no-op handle.
//! `transport-amqp091/examples/metrics.rs` serves them to Prometheus.
//!
//! | metric | type | labels | what it counts |
//! |---|---|---|---|
//! | `retry_deliveries_total` | counter | `queue`, `lane` | deliveries taken, from the work queue (`lane="work"`) or the isolation queue (`lane="isolation"`) |
//! | `retry_terminals_total` | counter | `queue`, `lane`, `terminal`, `reason` | deliveries settled, by [`Terminal`]: `handled`, `retried`, `isolated`, `diverted`, `parked`, `dropped`, `requeued`; `reason` is the [`DeadLetterReason`] of `parked` and `dropped`, and the broker's last answer (`nack`, `returned`, `failed`) of `requeued` |
//! | `retry_handler_seconds` | histogram | `queue`, `lane`, `outcome` | handler run time; `outcome` is `success`, `transient`, `permanent`, `retry-after`, `panic` or `timeout` |
//! | `retry_publish_confirm_seconds` | histogram | `queue`, `lane` | from publishing a clone (retry, isolation, diversion, parking) to its confirm |
//! | `retry_in_flight` | gauge | `queue` | deliveries held: running, waiting in-process, publishing or settling |
//! | `retry_handled_attempt` | histogram | `queue`, `lane` | the attempt on which handled messages succeeded (1: first time) |
//! | `retry_storm_paused` | gauge | `queue` | 1 while [storm control](ConsumerBuilder::with_storm_control) holds the work lane back (paused or probing), else 0 |
//!
//! Over a run, `retry_deliveries_total` summed over lanes equals [`RunReport::received`],
//! and each `terminal` of `retry_terminals_total` equals its [`RunReport`] field. Times are
//! read from [`Transport::now`], to the millisecond (virtual time in a simulation).
//!
//! ## Tracing
//!
//! Each delivery runs in a `delivery` span (`tracing`, level INFO); its handler runs,
//! publishes and settlement are inside it. Its fields:
//!
//! | field | value |
//! |---|---|
//! | `queue` | the work queue |
//! | `lane` | `work` or `isolation` |
//! | `message_id` | the message's `message-id` property, when it has one: all the attempts of one message, across deliveries and processes, share it |
//! | `delivery` | the engine's id of this delivery, unique in the process |
//! | `attempt` | the run number of the latest handler run |
//! | `crashes` | crashes counted so far, from its headers |
//! | `outcome` | how the latest handler run ended, as the `outcome` label above |
//! | `terminal` | how the delivery ended ([`Terminal`]) |
//!
//! Storm control logs a pause at WARN and probing and resuming at INFO, and tells
//! [`ConsumerBuilder::with_on_storm`]; [`RunReport::storm_pauses`] counts the pauses.
//!
//! ## Features
//!
//! * `serde`: [`RetryPolicy`] deserializes from TOML or JSON, with human durations; see the
//!   `config` module's documentation for the format.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backoff;
#[cfg(feature = "serde")]
mod config;
mod consumer;
mod decision;
mod engine;
mod excuses;
mod facts;
mod gate;
mod handler;
pub mod headers;
mod jitter;
mod message;
mod node_list;
mod parking;
mod policy;
pub mod returns;
mod time;
mod topology;
mod transport;

pub use backoff::Backoff;
pub use consumer::{
    Consumer, ConsumerBuilder, ConsumerConfigError, ConsumerError, RunReport, StormControl,
    StormEvent,
};
pub use decision::{Admission, AttemptState, Decision, Lane, Outcome, admit, decide};
pub use engine::{
    Action, Confirm, DeliveryId, Engine, EngineError, PlanMismatch, Publish, Settlement, Terminal,
};
pub use excuses::Excuses;
pub use facts::{BrokerSignals, DeliveryFacts, MAX_COUNTER, Malformed, ParkedRecord};
pub use gate::SoloGate;
pub use handler::{FailureKind, Handler, HandlerError};
pub use headers::{DeadLetterReason, HeaderValue, Headers};
pub use jitter::{Jitter, message_identity, splitmix64};
pub use message::{Delivery, Message, MessageParts, NativeParts, Properties};
pub use node_list::{NodeListError, PASSWORD_MASK, redact_url};
pub use parking::{
    ParkedFilter, ParkedMessage, ParkedReason, ParkingError, ParkingLot, ParkingReport,
    ParseReasonError, ReplayOptions, parked_at, replay_headers,
};
pub use policy::{
    CrashAction, Exhausted, MAX_DELAY_LEVELS, MAX_TTL, PolicyError, Retry, RetryPolicy,
    RetryPolicyBuilder,
};
pub use returns::{Answer, ReturnMatcher};
pub use time::{Timestamp, format_delay};
pub use topology::{
    BindingSpec, Cascade, CascadePlan, DEFAULT_CASCADE_PREFIX, DEFAULT_CASCADE_UNIT, DelayStrategy,
    ExchangeBindingSpec, ExchangeKind, ExchangeSpec, MAX_CASCADE_LEVELS, MAX_NAME_LEN, Overflow,
    QueueArguments, QueueRole, QueueSpec, QueueType, Route, TopologyBuilder, TopologyError,
    TopologyPlan,
};
pub use transport::{
    Capabilities, PublishResult, QueueWalk, Subscription, Transport, TransportError,
};

// The README's Rust examples are compiled and run with the doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
