//! Helpers for tests against a real NATS server (feature `testing`): finding it or skipping
//! loudly (`REQUIRE_NATS`), publishing test messages as a NATS application does, publishing
//! header bytes no well-behaved client writes ([`RawPublisher`]), deleting a plan's streams.
//! Not for production code.
//!
//! ```no_run
//! # async fn demo() {
//! use transport_nats::testing;
//!
//! let Some(transport) = testing::connect_or_skip("my test", testing::test_config(&testing::nats_url())).await
//! else {
//!     return; // no server, and REQUIRE_NATS is not set: skipped, loudly
//! };
//! testing::publish(transport.client(), "orders", "order-1", "body", &[]).await;
//! # }
//! ```

use std::io::Write as _;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::message::PublishMessage;
use retry_core::TopologyPlan;

use crate::{NatsConfig, NatsTransport, stream_name};

mod raw;

pub use raw::{PubAck, RawPublishError, RawPublisher, header_block};

/// Makes the NATS tests fail, instead of skip, without a server: CI sets it.
pub const REQUIRE_NATS: &str = "REQUIRE_NATS";

/// The server's URL: `NATS_URL`, loopback by default.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

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

/// Connects with `config`, or, when no server with JetStream answers, skips `what` with a
/// loud notice past the test harness's capture (and panics instead under
/// [`REQUIRE_NATS`]).
pub async fn connect_or_skip(what: &str, config: NatsConfig) -> Option<NatsTransport> {
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
    // `eprint!` is captured for passing tests; a write to the handle is not.
    let mut stderr = std::io::stderr().lock();
    let _ = write!(
        stderr,
        "\n!!! SKIPPED {what}: no NATS server with JetStream at {at} ({why}).\n\
         !!! Start `nats-server -js`, or set {REQUIRE_NATS}=1 to make this a failure.\n"
    );
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
