//! # transport-amqp091
//!
//! RabbitMQ (and other AMQP 0-9-1 brokers) for `retry-core`, through lapin 4.
//!
//! * [`AmqpTransport::connect`] opens one connection with a publishing channel in confirm
//!   mode; each subscription ([`AmqpSubscription`]) gets a channel of its own, and suspects
//!   are fetched with `basic.get` on another.
//! * TLS: `amqps://` URLs use rustls (ring). [`AmqpConfig::with_tls`] takes a
//!   [`TlsConfig`](retry_core::TlsConfig): a CA file in place of the platform's roots, a
//!   client certificate and key, and a server-name override (checked, and sent as SNI);
//!   [`AmqpConfig::with_external_auth`] logs in with the certificate (SASL `EXTERNAL`). A
//!   refused handshake fails with
//!   [`TransportError::Tls`](retry_core::TransportError::Tls), naming the node's
//!   `host:port` and the [`TlsFailure`](retry_core::TlsFailure); an `amqps://` node is
//!   never reached in plain TCP.
//! * `provision` declares a [`TopologyPlan`](retry_core::TopologyPlan) idempotently and
//!   reports an existing, differently declared object by name and argument
//!   ([`TransportError::TopologyConflict`](retry_core::TransportError::TopologyConflict)).
//!   A plan's delay cascade ([`TopologyPlan::cascade`](retry_core::TopologyPlan::cascade))
//!   is declared first, exchange-to-exchange bindings included; it is shared by every work
//!   queue that uses it, so [`AmqpTransport::teardown`] leaves it and
//!   [`AmqpTransport::teardown_cascade`] deletes it.
//! * Clones are published `mandatory` with confirms: the original is acknowledged only after
//!   a plain positive confirm. Returned, nacked, timed-out or failed publishes requeue it.
//!   Each clone carries a stamp (`x-retry-publish-id`) by which its confirm is paired with
//!   the broker's `basic.return`s ([`ReturnMatcher`](retry_core::ReturnMatcher)): lapin 4.12
//!   can attach a return to another publish's confirm when several are in flight. A confirm
//!   timeout fails every publish in flight on the channel, which is replaced.
//!   [`embed::Publisher`] publishes the same way for consumers of your own.
//! * Acknowledgements are batched with `multiple` where it is safe, per subscription, and
//!   sent before a consumer stops and when the transport closes; several confirms are in
//!   flight at once. A batch goes out once it fills half the prefetch window, or at once
//!   when the deliveries still in progress (clones waiting for their confirms) leave the
//!   broker no free place in the window, coalesced with whatever finishes while it is being
//!   written. That is what makes the consumer faster than a naive one.
//! * **No message can stop a consumer.** lapin fails a connection on a short string that is
//!   not UTF-8 and overflows its stack on deeply nested headers, both of which RabbitMQ
//!   delivers. Every connection reaches lapin through a tap that reads each message's
//!   frames first ([`inspect`]): a message lapin could not read is rejected from a plan's
//!   work or isolation queue, which dead-letters it into the parking queue as it came, and
//!   handed out anywhere else (a walk) with no properties, [`UNDECODABLE_HEADER`] and
//!   [`RAW_PROPERTIES_HEADER`]. A copy of such a message is refused.
//! * Automatic recovery: consuming resumes after a dropped connection, each recovery is
//!   logged, and a delivery tag from before the drop is never acknowledged on the new
//!   channel. A recovery that stalls in lapin is replaced by a new connection.
//! * Clusters: [`AmqpConfig::cluster`] (or a comma-separated URL) names the nodes; the
//!   connection goes to the first that answers and fails over to another, each failed node
//!   backing off ([`NodeOrder`], [`NodeListError`]). [`AmqpConfig::queue_type`] is quorum
//!   for a cluster.
//! * Operators' tools: [`AmqpTransport`] implements [`Admin`](retry_core::Admin), which
//!   `retryctl` calls through the [`registration`] (a
//!   [`DynTransport::with_admin`](retry_core::DynTransport::with_admin)): a queue's depth by
//!   passive declare, a plan applied object by object (created, verified or declared), and
//!   a plan checked from outside, with a probe sent through each delay queue that must come
//!   back, dead-lettered as expired, where the plan says.
//! * The password never appears in logs, errors or `Debug` output ([`AmqpConfig`]).
//! * `testing` (feature `testing`, deprecated): the helpers for tests against a real broker,
//!   re-exported from the `test-brokers` crate, where they moved.
//!
//! The guide, in the repository's `docs/` folder, covers what this transport does on
//! RabbitMQ (`docs/transports.md`), embedding the engine with the [`embed`] glue
//! (`docs/embedding.md`), node lists, failover and quorum queues (`docs/clusters.md`), TLS
//! (`docs/tls.md`), the
//! parking lot and `retryctl` (`docs/parking-lot.md`), the benchmarks against plain lapin
//! (`docs/benchmarks.md`) and the known limitations (`docs/limitations.md`).
//!
//! The broker behaviour this relies on (RabbitMQ 3.10) is measured in the project's design
//! notes and checked by this crate's integration tests against a real broker.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod acks;
mod admin;
mod config;
mod convert;
pub mod embed;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod handed;
pub mod inspect;
mod kit;
mod link;
mod nodes;
mod provision;
mod publisher;
mod registration;
mod subscription;
mod tag;
mod tap;
#[cfg(feature = "testing")]
#[deprecated(
    since = "0.2.0",
    note = "use the test-brokers crate: test_brokers::rabbitmq"
)]
pub mod testing;
mod tls;
mod transport;
mod undecodable;
mod walk;

pub use config::AmqpConfig;
pub use convert::{FROM_AMQP10, headers_from_table, table_from_headers};
pub use provision::ProvisionReport;
pub use registration::registration;
pub use retry_core::NodeListError;
pub use subscription::AmqpSubscription;
pub use tag::AmqpTag;
pub use transport::AmqpTransport;
pub use transport_kit::settings::{ConnectionSettings, NodeOrder};
pub use undecodable::{RAW_PROPERTIES_HEADER, UNDECODABLE_HEADER};
