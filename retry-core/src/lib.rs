//! # retry-core
//!
//! A broker-agnostic retry engine for message consumers: the async driver ([`Consumer`]),
//! the traits a broker binding implements ([`Transport`]) and the user's code implements
//! ([`Handler`]), and the operator's side of the parking queue ([`ParkingLot`]). It spawns
//! nothing and depends on no runtime or broker client; transports (AMQP 0-9-1, AMQP 1.0,
//! NATS JetStream, in-memory) carry out what it asks.
//!
//! ## The sans-IO engine
//!
//! The decisions are [`retry_proto`]'s, re-exported here whole under the same names:
//! [`RetryPolicy`], [`DeliveryFacts`], [`admit`] and [`decide`], the [`Engine`] state
//! machine with its [`Action`]s, [`TopologyPlan`], the header schema ([`headers`]) and
//! [`returns`]. `retry_core::Engine` is `retry_proto::Engine`, so code written against either
//! path works with the other. That crate does no IO, reads no clock and has no runtime,
//! futures or timer among its dependencies; a consumer of your own that drives the engine
//! by hand needs only it (its crate docs have the run loop).
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

mod admin;
mod consumer;
mod dynamic;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod gate;
mod handler;
mod node_list;
mod parking;
mod registry;
pub mod tls;
mod transport;

// The sans-IO engine, re-exported whole: `retry_core::Engine` is `retry_proto::Engine`, and
// an item added there appears here without a change.
pub use retry_proto::*;

pub use admin::{
    Admin, Applied, AppliedObject, CheckReport, Checked, DefaultLayout, Depth, Layout, ObjectCheck,
    PlanError, PlanOption, PlanOptions, PlanView,
};
pub use consumer::{
    Consumer, ConsumerBuilder, ConsumerConfigError, ConsumerError, RunReport, StormControl,
    StormEvent,
};
pub use dynamic::{DynSubscription, DynTag, DynTransport};
pub use gate::SoloGate;
pub use handler::Handler;
pub use node_list::{NodeListError, PASSWORD_MASK, redact_url};
pub use parking::{
    FINGERPRINT_MAX_CHARS, MIN_REPLAY_RATE, ParkedFilter, ParkedMessage, ParkedReason,
    ParkedSummary, ParkingError, ParkingLot, ParkingReport, ParseReasonError, Pick, ReplayOptions,
    error_fingerprint, parked_at, replay_headers,
};
pub use registry::{ConnectError, ConnectOptions, Endpoint, Registration, Registry};
pub use tls::{TlsConfig, TlsFailure};
pub use transport::{
    Capabilities, PublishResult, QueueWalk, Subscription, Transport, TransportError,
};

// The README's Rust examples are compiled and run with the doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
