//! # retry-proto
//!
//! The sans-IO heart of a broker-agnostic retry engine: it decides what happens to a message
//! whose handler failed, and what the broker must look like for that to work. It does no IO,
//! reads no clock and spawns nothing, and it depends on no async runtime, futures or timer
//! crate: whoever drives it passes the time in and carries out what it asks.
//!
//! `retry-core` builds the async driver ([`Consumer`], the `Transport` trait, the parking
//! lot) on top of this crate and re-exports all of it, so `retry_core::Engine` and
//! `retry_proto::Engine` are the same type. A consumer that drives the engine itself, on a
//! broker client of its own, needs only this crate.
//!
//! [`Consumer`]: https://docs.rs/retry-core/latest/retry_core/struct.Consumer.html
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
//! * [`returns`]: pairing a broker's returned messages with the publishes they answer.
//! * [`Excuses`]: what a process knows was not a crash (a lost fetch, its own shutdown), so
//!   a redelivery it explains is not counted against the message.
//!
//! ## The run loop
//!
//! A driver owns the IO; the engine owns the decisions:
//!
//! ```
//! use retry_proto::*;
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
//! is `examples/06_embedded.rs` (`cargo run -p examples --example 06_embedded`); [`Terminal`]'s `Display` and [`Terminal::is_final`],
//! [`TopologyPlan::lane_queue`] and `Outcome::from(handler_result)` are the helpers it uses.
//!
//! The concepts behind these types (the header schema, suspects and crash attribution, the
//! delay strategies) are in the repository's guide, `docs/concepts.md`,
//! `docs/policies.md` and `docs/embedding.md`.
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
mod decision;
mod engine;
mod excuses;
mod facts;
mod failure;
pub mod headers;
mod jitter;
mod message;
mod policy;
pub mod returns;
mod time;
mod topology;

pub use backoff::Backoff;
pub use decision::{Admission, AttemptState, Decision, Lane, Outcome, admit, decide};
pub use engine::{
    Action, Confirm, DeliveryId, Engine, EngineError, PlanMismatch, Publish, Settlement, Terminal,
};
pub use excuses::Excuses;
pub use facts::{BrokerSignals, DeliveryFacts, MAX_COUNTER, Malformed, ParkedRecord};
pub use failure::{FailureKind, HandlerError};
pub use headers::{DeadLetterReason, HeaderValue, Headers};
pub use jitter::{Jitter, message_identity, splitmix64};
pub use message::{Delivery, Message, MessageParts, NativeParts, Properties};
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

// The README's Rust example is compiled and run with the doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
