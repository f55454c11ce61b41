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
//!   `retryctl parked` (the `retryctl` crate) is this API from a shell.
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
//! ## Headers, crash attribution, metrics
//!
//! The guide, in the repository's `docs/` folder (plain Markdown, `docs/README.md` is its
//! table of contents), explains the concepts behind these types; the API docs here do not
//! repeat it:
//!
//! * **Attempts and headers** (`docs/concepts.md`): the engine keeps its state on the
//!   message, in `x-retry-*` headers it owns (names in [`headers`]), and never touches the
//!   body. [`DeliveryFacts::decode`] reads them with the broker's own counters; malformed
//!   values are reported in [`Malformed`].
//! * **Suspects and crashes** (`docs/concepts.md`): a redelivered delivery is never blamed
//!   on sight. It is isolated as a suspect ([`Terminal::Isolated`]), suspects run alone
//!   through the process's [`SoloGate`] (bounded by [`ConsumerBuilder::with_solo_limit`]),
//!   and only a suspect that comes back redelivered from the isolation queue counts a crash
//!   ([`Terminal::Diverted`], then parked with [`DeadLetterReason::CrashLoop`]). A process
//!   excuses what it knows was not a crash ([`Engine::excuse`], [`Excuses`]).
//! * **Metrics and tracing** (`docs/operating.md`, which has the table of every series):
//!   [`Consumer`] emits through the [`metrics`](https://docs.rs/metrics) facade and runs
//!   each delivery in a `delivery` tracing span; over a run the counters add up to the
//!   [`RunReport`]. [Storm control](ConsumerBuilder::with_storm_control) is there too.
//! * **Policies and delay strategies** (`docs/policies.md`), **embedding the engine**
//!   (`docs/embedding.md`) and **the parking lot** (`docs/parking-lot.md`).
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
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
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
pub mod tls;
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
    FINGERPRINT_MAX_CHARS, MIN_REPLAY_RATE, ParkedFilter, ParkedMessage, ParkedReason,
    ParkedSummary, ParkingError, ParkingLot, ParkingReport, ParseReasonError, Pick, ReplayOptions,
    error_fingerprint, parked_at, replay_headers,
};
pub use policy::{
    CrashAction, Exhausted, MAX_DELAY_LEVELS, MAX_TTL, PolicyError, Retry, RetryPolicy,
    RetryPolicyBuilder,
};
pub use returns::{Answer, ReturnMatcher};
pub use time::{Timestamp, format_delay};
pub use tls::{TlsConfig, TlsFailure};
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
