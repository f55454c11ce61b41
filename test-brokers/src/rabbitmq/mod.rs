//! RabbitMQ beside the transport under test (feature `rabbitmq`): what a test needs of the
//! broker that is not the transport's business.
//!
//! * a side connection with lapin, to set up and inspect ([`raw`], [`publish`], [`get`],
//!   [`message_count`], [`declare_durable`], ...), and [`probe`] to find the broker;
//! * topology: [`refusing`] queue arguments and [`redeclare`] to make a queue of a plan
//!   refuse publishes, [`delete_blocking`] and the [`Cleanup`] guard that deletes a test's
//!   topology even when the test panics;
//! * [`rabbitmqctl`] for faults and inspection, and what is built on it ([`list_queues`],
//!   [`list_bindings`], [`close_connection`], [`ready_and_unacked`]);
//! * the local test cluster ([`cluster`], [`cluster_sh`], [`ClusterLease`]) and TLS node
//!   ([`tls_node`]);
//! * [`RawPublisher`], which publishes AMQP 0-9-1 frames lapin cannot write.
//!
//! ```no_run
//! # async fn f() {
//! use test_brokers::rabbitmq;
//!
//! if let Err(why) = rabbitmq::probe(&test_brokers::amqp_url()).await {
//!     test_brokers::no_broker("my RabbitMQ test", &why);
//!     return;
//! }
//! let queue = test_brokers::unique("orders");
//! let mut cleanup = rabbitmq::Cleanup::new(test_brokers::amqp_url());
//! cleanup.queue(&queue);
//! let (_connection, channel) = rabbitmq::raw().await;
//! rabbitmq::declare_durable(&channel, &queue, Default::default()).await;
//! rabbitmq::publish(&channel, &queue, b"hello", "order-1").await;
//! assert_eq!(rabbitmq::message_count(&channel, &queue).await.unwrap(), 1);
//! # }
//! ```

mod cluster;
mod ctl;
mod frames;
mod side;
mod tls;
mod topology;

pub use cluster::{CLUSTER_URLS, ClusterLease, cluster, cluster_sh, try_cluster_sh};
pub use ctl::{
    close_connection, list_bindings, list_queues, list_queues_with, rabbitmqctl, ready_and_unacked,
    ready_and_unacked_settled,
};
pub use frames::{RawProperties, RawPublisher, RawTable};
pub use side::{
    confirm_channel, declare_durable, get, message_count, probe, publish, publish_with, raw, table,
    wait_for_count, wait_get,
};
pub use tls::{TlsNode, tls_node};
pub use topology::{Cleanup, delete_blocking, redeclare, refusing};
