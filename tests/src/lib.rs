//! # conformance
//!
//! The proof that transports can be swapped: one suite of scenarios, the same expected
//! outcomes, run on every transport of the retry engine.
//!
//! ## Design
//!
//! After object_store's `integration.rs`: each scenario in [`scenarios`] is a
//! `pub async fn` generic over a [`Harness`], which gives it fresh connections of the
//! transport under test, declares uniquely named topology, publishes test messages, reads
//! the parking queue, injects faults (a crashed consumer, refused publishes) and tells the
//! time. A scenario first checks the harness's [`HarnessCapabilities`] and returns
//! [`Verdict::Skipped`] with the reason when something it needs is missing; otherwise it
//! runs the real [`Consumer`](retry_core::Consumer) with a scripted handler and checks the
//! terminals, the handler runs, the headers, the parked diagnostics and the queues, and
//! panics on the first thing that is wrong.
//!
//! Harnesses:
//!
//! * [`MemoryHarness`]: transport-memory, one broker per scenario, on a virtual clock
//!   ([`memory::block_on`]): delays are checked exactly and a 10 s delay takes no time.
//! * [`Amqp091Harness`]: transport-amqp091 on the local RabbitMQ.
//! * [`Amqp10Harness`]: transport-amqp10 on the local RabbitMQ's AMQP 1.0 plugin, with
//!   topology declared over AMQP 0-9-1 (the plugin cannot declare queues with arguments).
//!
//! On a real broker delays are checked as lower bounds only (see [`Timing`]); an upper
//! bound on the wall clock would flake on a loaded machine.
//!
//! [`suite`] lists the scenarios and runs them: one after another on the virtual clock, all
//! at once on a real broker, each with a harness of its own that is cleaned up when the
//! scenario ends, passed or not. The [`SuiteReport`](suite::SuiteReport) prints one line per
//! scenario: passed (with what it observed), skipped (with why) or failed.
//!
//! [`storm`] is the many-message scenario on its own, with the pure engine's expected
//! decisions per message and an explicit bound on duplicated messages (0 unless the caller
//! injects faults that can duplicate). [`process`] is what the `crashing_consumer` binary
//! and its test share: a consumer process that aborts on a poison message, restarted by the
//! test until the poison is parked.
//!
//! [`differential`] checks the memory model against RabbitMQ directly, not each against the
//! engine: one scripted workload with a crash, a refused publish, per-message TTLs and
//! retries through every delay level, on classic and on quorum queues, run on both. A
//! [`Recorded`](recording::Recorded) transport logs every delivery as the broker produced
//! it, and each delivery (named by message id and its index among that message's
//! deliveries) must match between the two runs: the queue it came from and its exchange and
//! routing key, the redelivered flag, `x-delivery-count`, every `x-death` record (queue,
//! reason, count, exchange, routing keys, original expiration; times dropped, the unique
//! queue name normalised) and the `x-first-death-*` headers, and per queue the order of
//! arrival; so must every message's decisions.
//!
//! A harness is built with the transport capabilities its test expects, written in the
//! test rather than asked of the transport under test: every connection it opens must
//! declare exactly those, and each suite run asserts the exact set of scenarios that
//! skipped, so a transport that loses a capability fails instead of quietly skipping.
//!
//! `cargo test -p conformance` runs it all; the RabbitMQ targets skip with a loud message
//! when no broker answers on `AMQP_URL` / `AMQP10_URL` (loopback by default), and fail
//! instead when `REQUIRE_BROKER` is set.
//!
//! ## Example
//!
//! One scenario on the in-memory broker:
//!
//! ```
//! use conformance::{MemoryHarness, Verdict, scenarios};
//! use retry_core::Capabilities;
//!
//! // What transport-memory must declare, written down rather than asked of it.
//! let expected = Capabilities {
//!     publisher_confirms: true,
//!     delivery_count: true,
//!     native_delays: false,
//!     dead_letter_exchange: true,
//!     declares_topology: true,
//! };
//! let h = MemoryHarness::new(expected);
//! let verdict = h.block_on(scenarios::crash_limit_parked(&h));
//! assert!(matches!(verdict, Verdict::Passed { .. }));
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod amqp091;
pub mod amqp10;
pub mod differential;
pub mod drive;
pub mod harness;
pub mod journal;
pub mod memory;
pub mod process;
pub mod rabbitmq;
pub mod recording;
pub mod scenarios;
pub mod storm;
pub mod suite;

pub use amqp10::Amqp10Harness;
pub use amqp091::Amqp091Harness;
pub use harness::{
    Harness, HarnessCapabilities, Need, ParkedMessage, Stopwatch, TestMessage, Timing,
    TopologyFaults,
};
pub use journal::{Journal, RunInfo, RunRecord, ScriptedHandler, Step, TerminalRecord};
pub use memory::MemoryHarness;
pub use scenarios::Verdict;
