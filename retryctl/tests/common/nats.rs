//! The local NATS server with JetStream, for the `retryctl` NATS tests: transport-nats'
//! `testing` glue with the ack wait these tests use, test-brokers' test messages, and a
//! cleanup guard.

#![allow(dead_code)]

use std::time::Duration;

use retry_core::TopologyPlan;
use transport_nats::{NatsConfig, NatsTransport};

pub use test_brokers::nats::publish;
pub use test_brokers::nats_url as url;

/// Connects to the server, or, when none with JetStream answers, skips `what` loudly (and
/// panics instead under `REQUIRE_NATS`).
pub async fn connect(what: &str) -> Option<NatsTransport> {
    let config = NatsConfig::new(url()).with_ack_wait(Duration::from_secs(2));
    transport_nats::testing::connect_or_skip(what, config).await
}

/// Deletes a plan's streams when dropped, whether the test passed or panicked.
pub struct Cleanup(pub TopologyPlan);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let streams = transport_nats::testing::plan_streams(&self.0);
        test_brokers::nats::delete_streams_blocking(&url(), &streams);
    }
}
