//! NATS JetStream beside the transport under test (feature `nats`): publishing test
//! messages as a NATS application does, deleting streams by name, the local test cluster,
//! and [`RawPublisher`], which publishes header bytes no well-behaved client writes.
//!
//! ```no_run
//! # async fn f() {
//! use test_brokers::nats;
//!
//! let client = match async_nats::connect(test_brokers::nats_url()).await {
//!     Ok(client) => client,
//!     Err(e) => {
//!         test_brokers::no_nats("my NATS test", &e.to_string());
//!         return;
//!     }
//! };
//! // "orders" is a subject a stream captures.
//! nats::publish(&client, "orders", "order-1", "body", &[("tenant", "acme")]).await;
//! nats::delete_streams(&client, ["ORDERS"]).await;
//! # }
//! ```

mod cluster;
mod raw;
mod streams;

pub use cluster::{CLUSTER_URLS, cluster, cluster_sh, try_cluster_sh};
pub use raw::{PubAck, RawPublishError, RawPublisher, header_block};
pub use streams::{delete_streams, delete_streams_blocking, publish};
