//! Deprecated since 0.2.0: the helpers for tests against a real broker moved to the
//! `test-brokers` crate, once for every transport. This module re-exports them from there for
//! one release; name them through `test_brokers` (the skip policy, [`LogRecorder`]) and
//! `test_brokers::rabbitmq` (the rest) instead.
//!
//! | here | now |
//! |---|---|
//! | `REQUIRE_BROKER`, `broker_required`, `no_broker`, `print_uncaptured`, `REQUIRE_CLUSTER`, `REQUIRE_TLS`, `LogRecorder` | `test_brokers::` the same name |
//! | `rabbitmqctl`, `refusing`, `redeclare`, `cluster`, `cluster_sh`, `try_cluster_sh`, `ClusterLease`, `CLUSTER_URLS`, `tls_node`, `TlsNode`, `RawPublisher`, `RawProperties`, `RawTable` | `test_brokers::rabbitmq::` the same name |
//! | `delete_blocking(&config, plans, queues)` | `test_brokers::rabbitmq::delete_blocking(url, plans, queues)`, or its guard `test_brokers::rabbitmq::Cleanup` |
//!
//! The re-exports do not warn where they are used (Rust reports `#[deprecated]` on a module
//! only for the items defined in it); [`delete_blocking`], defined here, does.

pub use test_brokers::rabbitmq::{
    CLUSTER_URLS, ClusterLease, RawProperties, RawPublisher, RawTable, TlsNode, cluster,
    cluster_sh, rabbitmqctl, redeclare, refusing, tls_node, try_cluster_sh,
};
pub use test_brokers::{
    LogRecorder, REQUIRE_BROKER, REQUIRE_CLUSTER, REQUIRE_TLS, broker_required, no_broker,
    print_uncaptured,
};

/// Deletes what a test declared on the broker at `config`'s first node: `plans`, then their
/// delay cascades, then `queues`, as `test_brokers::rabbitmq::delete_blocking` does with a
/// URL (which it now takes: a plain lapin connection, so the TLS settings of `config` are
/// not used). Blocking, and never fails.
pub fn delete_blocking(
    config: &crate::AmqpConfig,
    plans: &[retry_core::TopologyPlan],
    queues: &[String],
) {
    if let Some(url) = config.nodes().ok().and_then(|n| n.into_iter().next()) {
        test_brokers::rabbitmq::delete_blocking(&url, plans, queues);
    }
}
