//! The local NATS server with JetStream, for the `retryctl` NATS tests: connecting (or
//! skipping loudly without a server, failing instead under `REQUIRE_NATS`), publishing test
//! messages as a NATS application does, and deleting a plan's streams.

#![allow(dead_code)]

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::message::PublishMessage;
use retry_core::TopologyPlan;
use transport_amqp091::testing::print_uncaptured;
use transport_nats::{NatsConfig, NatsTransport, stream_name};

/// Makes the NATS tests fail, instead of skip, without a server (as the conformance suite).
pub const REQUIRE_NATS: &str = "REQUIRE_NATS";

/// The server's URL: `NATS_URL`, loopback by default.
pub fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Connects to the server, or, when none with JetStream answers, skips `what` loudly (and
/// panics instead under [`REQUIRE_NATS`]).
pub async fn connect(what: &str) -> Option<NatsTransport> {
    let config = NatsConfig::new(url()).with_ack_wait(Duration::from_secs(2));
    let at = config.url();
    let why =
        match tokio::time::timeout(Duration::from_secs(15), NatsTransport::connect(config)).await {
            Ok(Ok(t)) => return Some(t),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer within 15 s".to_owned(),
        };
    if std::env::var_os(REQUIRE_NATS).is_some() {
        panic!(
            "{REQUIRE_NATS} is set, but no NATS server with JetStream answers for {what}: {why}"
        );
    }
    print_uncaptured(&format!(
        "\n!!! SKIPPED {what}: no NATS server with JetStream at {at} ({why}).\n\
         !!! Start `nats-server -js`, or set {REQUIRE_NATS}=1 to make this a failure.\n"
    ));
    None
}

/// Publishes `body` to `queue`'s subject as a NATS application would: `id` as its
/// `Nats-Msg-Id`, `headers` as they are, the stream's acknowledgement awaited.
pub async fn publish(
    client: &async_nats::Client,
    queue: &str,
    id: &str,
    body: &str,
    headers: &[(&str, &str)],
) {
    let js = async_nats::jetstream::new(client.clone());
    let mut map = HeaderMap::new();
    map.insert("Nats-Msg-Id", id);
    for (name, value) in headers {
        map.insert(*name, *value);
    }
    let message = PublishMessage::build()
        .payload(body.to_owned().into())
        .headers(map);
    js.send_publish(queue.to_owned(), message)
        .await
        .expect("publish a test message")
        .await
        .unwrap_or_else(|e| panic!("the stream of {queue} acknowledges {id}: {e}"));
}

/// Deletes every stream of `plan`.
pub async fn delete_plan(client: &async_nats::Client, plan: &TopologyPlan) {
    let js = async_nats::jetstream::new(client.clone());
    for queue in plan.queues() {
        let _ = js.delete_stream(stream_name(&queue.name)).await;
    }
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
