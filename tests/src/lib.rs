//! # conformance
//!
//! The proof that transports can be swapped: one suite of scenarios, the same expected
//! outcomes, run on every transport of the retry engine, and a harness to run it on a new
//! one.
//!
//! ## Running it
//!
//! The crate lives in the folder `tests/` but is called `conformance`, so `-p` takes that
//! name:
//!
//! ```text
//! cargo test -p conformance                          # everything
//! cargo test -p conformance seeded_storm             # one scenario, on every transport
//! cargo test -p conformance --test memory            # one transport (memory, amqp091, amqp10, nats)
//! cargo test -p conformance --test amqp10 scenario::retry_after   # one scenario, one transport
//! cargo test -p conformance scenario:: -- --nocapture # what each scenario observed
//! ```
//!
//! Every scenario is a test of its own on every transport, named `scenario::NAME` in the
//! transport's test target (`memory`, `amqp091`, `amqp10`, `nats`, `erased`, and
//! `fourth_transport`, the example below). A filter matches any test whose name contains it: `success` also runs
//! `transient_then_success`, `scenario::success` only the one. The RabbitMQ targets use the broker at `AMQP_URL` / `AMQP10_URL`
//! (loopback by default); without one they skip with a loud message, and with
//! `REQUIRE_BROKER=1` they fail instead. A scenario that skips on a transport prints why,
//! past the output capture, in every run.
//!
//! The guide's `docs/testing.md` says which brokers the tests need and what CI runs. This
//! crate also compiles the guide's Rust snippets as doc tests (`cargo test --doc -p
//! conformance`).
//!
//! ## Design
//!
//! After object_store's `integration.rs`: each scenario in [`scenarios`] is a
//! `pub async fn NAME<H: Harness>(h: &H) -> Verdict`, generic over a [`Harness`], which
//! gives it fresh connections of the transport under test, declares uniquely named
//! topology, publishes test messages, reads the parking queue, injects faults (a crashed
//! consumer, refused publishes) and tells the time. A scenario first checks the harness's
//! [`HarnessCapabilities`] and returns [`Verdict::Skipped`] with the reason when something
//! it needs is missing; otherwise it runs the real [`Consumer`](retry_core::Consumer) with a
//! scripted handler and checks the terminals, the handler runs, the headers, the parked
//! diagnostics and the queues, and panics on the first thing that is wrong.
//!
//! [`conformance_tests!`] turns the scenarios into tests for one transport: a module with
//! one `#[test]` per scenario. Each test builds a harness of its own, runs its scenario and
//! cleans up, passed or failed; each asserts that the scenario skipped if and only if the
//! transport's expected skips list it, and one more test per module checks that every
//! expected skip names a real scenario. The scenarios are named in one place,
//! [`for_each_scenario!`], beside their definitions, and the crate does not compile while
//! a public function of [`scenarios`] is missing from it: no transport can miss a
//! scenario.
//!
//! Harnesses:
//!
//! * [`MemoryHarness`]: transport-memory, one broker per scenario, on a virtual clock
//!   ([`Broker::block_on`](transport_memory::Broker::block_on)): delays are checked exactly and a 10 s delay takes no time.
//! * [`Amqp091Harness`]: transport-amqp091 on the local RabbitMQ.
//! * [`Amqp10Harness`]: transport-amqp10 on the local RabbitMQ's AMQP 1.0 plugin, with
//!   topology declared over AMQP 0-9-1 (the plugin cannot declare queues with arguments).
//! * [`NatsHarness`]: transport-nats on the local NATS server with JetStream (`NATS_URL`,
//!   `REQUIRE_NATS`), which declares its plans itself.
//! * [`ErasedHarness`]: any of these with its transport behind a
//!   [`DynTransport`](retry_core::DynTransport), as a registry hands it out
//!   (`tests/erased.rs` runs the suite on transport-memory that way).
//!
//! The RabbitMQ harnesses run each scenario on a tokio runtime of their own
//! ([`rabbitmq::run_scenario`]), within a time limit, and delete the scenario's queues and
//! exchanges when it ends. On a real broker delays are checked as lower bounds only (see
//! [`Timing`]); an upper bound on the wall clock would flake on a loaded machine.
//!
//! A harness is built with the transport capabilities its test expects, written in the
//! test rather than asked of the transport under test: every connection it opens must
//! declare exactly those, and each test asserts whether its scenario skipped against the
//! expected skips, so a transport that loses a capability fails instead of quietly
//! skipping.
//!
//! Beside the suite: [`storm`] is the many-message scenario on its own, with the pure
//! engine's expected decisions per message and an explicit bound on duplicated messages (0
//! unless the caller injects faults that can duplicate).
//!
//! What runs the transports under faults at scale lives in the `stress` crate beside this
//! one (the folder `stress/`): the chaos harness with its journal per message, the soak,
//! the differential check of the memory model against RabbitMQ, the crashing consumer and
//! the scripts that start private nodes and clusters. It builds on this crate's harnesses.
//!
//! ## Running the suite on a fourth transport
//!
//! 1. Implement [`retry_core::Transport`] for the new transport.
//! 2. Implement [`Harness`] for a harness of it: how to open a connection, declare a plan
//!    (with [`TopologyFaults`] applied when it can refuse publishes), publish a test
//!    message, count a queue, take the parked messages, crash a connection, sleep, and
//!    clean up. [`HarnessCapabilities`] says which faults it can inject; leave out what it
//!    cannot, and the scenarios that need it skip, with the reason.
//! 3. Write a runner that runs one scenario on a harness of its own: on a virtual clock
//!    like [`MemoryHarness::run`], or on a tokio runtime with
//!    [`suite::run_and_clean_up`] like [`rabbitmq::run_scenario`].
//! 4. In a test target, invoke [`conformance_tests!`] with the harness type, the runner and
//!    the scenarios the transport is expected to skip.
//!
//! `tests/tests/fourth_transport.rs` does exactly this for a transport of its own, a
//! newtype over transport-memory's connection that cannot declare topology, and runs
//! every scenario on it: `cargo test -p conformance --test fourth_transport`. Its last
//! step, the same for transport-memory:
//!
//! ```
//! use conformance::MemoryHarness;
//! use retry_core::Capabilities;
//!
//! // What transport-memory must declare, written down rather than asked of it.
//! const MEMORY: Capabilities = Capabilities {
//!     publisher_confirms: true,
//!     delivery_count: true,
//!     native_delays: false,
//!     dead_letter_exchange: true,
//!     declares_topology: true,
//! };
//!
//! conformance::conformance_tests! {
//!     /// Every scenario on transport-memory: `scenario::success`, `scenario::seeded_storm`, ...
//!     mod scenario {
//!         harness: MemoryHarness,
//!         run: |s| MemoryHarness::run(s, MEMORY),
//!         skips: &[],
//!     }
//! }
//! # fn main() {}
//! ```
//!
//! One scenario can also be run by hand:
//!
//! ```
//! # use conformance::{MemoryHarness, Verdict, scenarios};
//! # use retry_core::Capabilities;
//! # let expected = Capabilities {
//! #     publisher_confirms: true,
//! #     delivery_count: true,
//! #     native_delays: false,
//! #     dead_letter_exchange: true,
//! #     declares_topology: true,
//! # };
//! let h = MemoryHarness::new(expected);
//! let verdict = h.block_on(scenarios::crash_limit_parked(&h));
//! assert!(matches!(verdict, Verdict::Passed { .. }));
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod amqp091;
pub mod amqp10;
pub mod drive;
pub mod erased;
#[cfg(doctest)]
mod guide;
pub mod harness;
pub mod journal;
pub mod memory;
pub mod nats;
pub mod rabbitmq;
pub mod scenarios;
pub mod storm;
pub mod suite;
pub mod support;
mod verdict;

pub use amqp10::Amqp10Harness;
pub use amqp091::Amqp091Harness;
pub use erased::ErasedHarness;
pub use harness::{
    Harness, HarnessCapabilities, Need, ParkedMessage, Stopwatch, TestMessage, Timing,
    TopologyFaults,
};
pub use journal::{Journal, RunInfo, RunRecord, ScriptedHandler, Step, TerminalRecord};
pub use memory::MemoryHarness;
pub use nats::NatsHarness;
pub use verdict::Verdict;
