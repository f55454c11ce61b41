//! # stress
//!
//! The retry engine's transports under faults at scale, beside the conformance suite (the
//! crate `conformance`, folder `tests/`) whose harnesses it builds on. The suite proves that
//! every transport gives the same outcomes scenario by scenario; this crate proves that
//! nothing is lost or wrongly blamed when processes die, connections drop and brokers
//! restart under load, and that the memory model behaves as RabbitMQ does.
//!
//! * [`chaos`]: consumer processes on a private RabbitMQ node under SIGKILLs, forced
//!   connection closes and a broker restart, with a journal of every delivery, publish,
//!   settlement and terminal per message, reconciled at the end. The `chaos` binary runs it
//!   at full scale and `tests/chaos.rs` bounded for CI; the `soak` binary runs it for a set
//!   time and judges one consumer's resources.
//! * [`differential`]: one scripted workload with a crash, a refused publish, per-message
//!   TTLs and retries through every delay level, run on transport-memory and on RabbitMQ,
//!   on classic and quorum queues, with every delivery ([`recording`]) compared between the
//!   two (`tests/differential.rs`).
//! * [`process`]: what the `crashing_consumer` binary and `tests/crash_loop.rs` share: a
//!   consumer process that aborts on a poison message, restarted by the test until the
//!   poison is parked, on RabbitMQ and on NATS.
//! * The scripts: `cluster.sh` (a three-node RabbitMQ cluster), `nats-cluster.sh` (a
//!   three-node NATS JetStream cluster), `tls-node.sh` (a RabbitMQ node with a TLS listener)
//!   and `chaos-node.sh` (the chaos harness's private node). `.ci/run` starts the first
//!   three for the transports' cluster and TLS tests.
//!
//! ```text
//! cargo test -p stress                               # the bounded chaos run, the crash loop, the differential check
//! cargo run -p stress --bin chaos -- --help          # chaos at full scale
//! cargo run --release -p stress --bin soak -- --help # the soak (an hour by hand, 5 minutes in CI)
//! ```
//!
//! The guide's [Running the tests](../docs/testing.md) says which brokers each needs.
//! Every run uses loopback addresses only, and bounded loops.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod chaos;
pub mod differential;
pub mod process;
pub mod recording;
