//! Helpers for tests that run against real brokers: RabbitMQ over AMQP 0-9-1 (and the same
//! broker's AMQP 1.0 plugin) and NATS JetStream. Every broker test in this workspace uses
//! them, whatever transport it tests, and a user's own broker tests can too. Not for
//! production code.
//!
//! # Design
//!
//! A broker test must never pass by doing nothing. Without its broker it is skipped
//! *loudly*, with a notice written past the test harness's output capture; and where a
//! broker is expected (CI sets `REQUIRE_BROKER=1`, `REQUIRE_NATS=1`, ...) the same test
//! fails instead. That policy lives here once ([`no_broker`], [`no_nats`], [`skip`]), with
//! the URLs tests connect to ([`amqp_url`], [`amqp10_url`], [`nats_url`], [`authority`]) and
//! the names they declare ([`unique`]).
//!
//! What a test needs of a broker *beside* the transport under test is broker-level, not
//! transport-level: a side connection to publish, count and inspect with the broker's own
//! client, the broker's command line, its clusters, and clients that write bytes no
//! well-behaved client writes. So this crate depends on the broker clients (lapin,
//! async-nats) and on `retry-proto` for topology plans, and on no transport crate; a
//! transport keeps only the glue that builds its own configuration and transport.
//!
//! * the crate root: the skip policy, URLs and names, [`poll_until`], and [`LogRecorder`],
//!   a `tracing` subscriber to check what was logged;
//! * [`rabbitmq`] (feature `rabbitmq`): a lapin side connection and its helpers,
//!   `rabbitmqctl` and the listings built on it, the local test cluster, the TLS node, and
//!   [`rabbitmq::RawPublisher`] for AMQP 0-9-1 frames lapin cannot write;
//! * [`nats`] (feature `nats`): publishing and deleting streams with async-nats, the local
//!   test cluster, and [`nats::RawPublisher`] for header blocks async-nats cannot write.
//!
//! # Example
//!
//! ```no_run
//! use test_brokers::{LogRecorder, no_broker, unique};
//!
//! fn connect(url: &str) -> Result<(), String> {
//!     Err(format!("connection refused at {url}"))
//! }
//!
//! // In a test: without a broker, skip loudly (or fail when REQUIRE_BROKER is set).
//! if let Err(why) = connect(&test_brokers::amqp_url()) {
//!     no_broker("my broker test", &why);
//!     return;
//! }
//! // A queue no other test run uses, and a record of what the code under test logs.
//! let queue = unique("orders");
//! let logs = LogRecorder::up_to(tracing::Level::INFO);
//! tracing::subscriber::with_default(logs.clone(), || tracing::info!(%queue, "declared"));
//! assert_eq!(logs.containing("declared").len(), 1);
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod env;
mod log;
mod skip;
mod wait;

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

pub use env::{amqp_url, amqp10_url, authority, nats_url, unique};
pub use log::LogRecorder;
pub use skip::{
    REQUIRE_BROKER, REQUIRE_CLUSTER, REQUIRE_NATS, REQUIRE_NATS_CLUSTER, REQUIRE_TLS,
    broker_required, no_broker, no_nats, print_uncaptured, required, skip,
};
pub use wait::poll_until;
