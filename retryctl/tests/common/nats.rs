//! The local NATS server with JetStream, for the `retryctl` NATS tests: transport-nats'
//! `testing` helpers, with the ack wait these tests use, and a cleanup guard.

#![allow(dead_code)]

use std::time::Duration;

use retry_core::TopologyPlan;
use transport_nats::{NatsConfig, NatsTransport};

pub use transport_nats::testing::{delete_plan, nats_url as url, publish};

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
        let plan = self.0.clone();
        // A runtime of its own, on a thread of its own: the test's may be gone or busy.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the cleanup");
            runtime.block_on(async {
                if let Ok(Ok(client)) =
                    tokio::time::timeout(Duration::from_secs(10), async_nats::connect(url())).await
                {
                    delete_plan(&client, &plan).await;
                    let _ = client.drain().await;
                }
            });
        })
        .join();
    }
}
