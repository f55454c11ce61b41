//! What tests against a real NATS server need of this transport (feature `testing`): its
//! configuration for tests ([`test_config`]), a transport or a loud skip
//! ([`connect_or_skip`]), and a plan's streams deleted ([`delete_plan`]). The broker-level
//! helpers (`REQUIRE_NATS`, the server's URL, test messages, the raw publisher of header
//! bytes) moved to the `test-brokers` crate (`test_brokers`, `test_brokers::nats`); they
//! are re-exported here for one release. Not for production code.
//!
//! ```no_run
//! # async fn demo() {
//! use transport_nats::testing;
//!
//! let config = testing::test_config(&test_brokers::nats_url());
//! let Some(transport) = testing::connect_or_skip("my test", config).await else {
//!     return; // no server, and REQUIRE_NATS is not set: skipped, loudly
//! };
//! test_brokers::nats::publish(transport.client(), "orders", "order-1", "body", &[]).await;
//! # }
//! ```

use std::time::Duration;

use retry_core::TopologyPlan;

use crate::{NatsConfig, NatsTransport, stream_name};

// Deprecated since 0.2.0, kept for one release: moved to `test_brokers::nats` and
// `test_brokers` under the same names. Re-exports cannot carry `#[deprecated]` (Rust ignores
// it on a `use`), so these do not warn where they are used.
pub use test_brokers::nats::{PubAck, RawPublishError, RawPublisher, header_block, publish};
pub use test_brokers::{REQUIRE_NATS, nats_url};

/// The ack wait of the tests' connections: a crashed consumer's deliveries come back this
/// long after the crash.
pub const ACK_WAIT: Duration = Duration::from_secs(2);

/// The tests' configuration for `url`: a short ack wait, so crashes are found quickly, and a
/// short pull wait, so a cancelled subscription ends quickly.
pub fn test_config(url: &str) -> NatsConfig {
    NatsConfig::new(url)
        .with_ack_wait(ACK_WAIT)
        .with_pull_wait(Duration::from_millis(500))
        .with_publish_timeout(Duration::from_secs(5))
}

/// Connects with `config`, or, when no server with JetStream answers within 15 s, skips
/// `what` as `test_brokers::no_nats` does: a loud notice past the test harness's capture,
/// or a panic under `REQUIRE_NATS`.
pub async fn connect_or_skip(what: &str, config: NatsConfig) -> Option<NatsTransport> {
    let at = config.url();
    let why =
        match tokio::time::timeout(Duration::from_secs(15), NatsTransport::connect(config)).await {
            Ok(Ok(t)) => return Some(t),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer within 15 s".to_owned(),
        };
    test_brokers::no_nats(what, &format!("at {at}: {why}"));
    None
}

/// Deletes every stream of `plan`.
pub async fn delete_plan(client: &async_nats::Client, plan: &TopologyPlan) {
    test_brokers::nats::delete_streams(client, plan_streams(plan)).await;
}

/// The streams of `plan`, by name: what [`delete_plan`] deletes, for
/// `test_brokers::nats::delete_streams_blocking` in a guard's `Drop`.
pub fn plan_streams(plan: &TopologyPlan) -> Vec<String> {
    plan.queues().iter().map(|q| stream_name(&q.name)).collect()
}
