//! The harness for transport-nats on the local NATS server with JetStream.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use retry_core::{Capabilities, TopologyPlan, Transport};
use transport_nats::{NatsTransport, stream_name};

use crate::harness::{
    Harness, HarnessCapabilities, Need, ParkedMessage, Stopwatch, TestMessage, Timing,
    TopologyFaults, assert_declares,
};
use crate::rabbitmq::{SLACK, runtime, unique_name};
use crate::suite::{Scenario, run_and_clean_up};
use crate::verdict::Verdict;

pub use test_brokers::{REQUIRE_NATS, nats_url};
pub use transport_nats::testing::{ACK_WAIT, delete_plan, test_config};

/// Connects to `url` with [`test_config`], or, when no server with JetStream answers, skips
/// `what` loudly (and panics instead under [`REQUIRE_NATS`]).
pub async fn detect(what: &str, url: &str) -> Option<NatsTransport> {
    transport_nats::testing::connect_or_skip(what, test_config(url)).await
}

/// Publishes `message` to `queue`'s subject the way a NATS application would: its id as
/// `Nats-Msg-Id`, with the stream's acknowledgement awaited.
pub async fn publish_test_message(client: &async_nats::Client, queue: &str, message: &TestMessage) {
    let body = String::from_utf8_lossy(&message.body);
    test_brokers::nats::publish(client, queue, &message.id, &body, &[]).await;
}

/// Takes every message stored in `queue` (read in order, each deleted once read).
pub async fn take_all(transport: &NatsTransport, queue: &str) -> Vec<ParkedMessage> {
    let mut walk = transport.walk(queue).await.expect("walk the queue");
    let mut out = Vec::new();
    while let Some(d) = walk.next().await.expect("read a stored message") {
        out.push(ParkedMessage {
            id: d.message.properties().message_id.clone(),
            body: d.message.body().to_vec(),
            headers: d.message.headers().clone(),
        });
        walk.ack(d.tag).await.expect("delete a stored message");
    }
    walk.end().await.expect("end the walk");
    out
}

/// NATS JetStream as a harness: transport-nats declares the plans itself; test messages
/// are published with plain async-nats; queues are counted and parked messages read
/// through the transport.
pub struct NatsHarness {
    admin: NatsTransport,
    url: String,
    started: Instant,
    expected: Capabilities,
    plans: Mutex<Vec<TopologyPlan>>,
}

impl std::fmt::Debug for NatsHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsHarness").finish_non_exhaustive()
    }
}

impl NatsHarness {
    /// Runs `scenario` on a harness of its own on the local NATS server, whose connections
    /// must declare `expected`: the runner [`conformance_tests!`](crate::conformance_tests)
    /// takes for this transport. `None` without a server, unless [`REQUIRE_NATS`] is set.
    pub fn run(scenario: Scenario<Self>, expected: Capabilities) -> Option<Verdict> {
        runtime().block_on(async {
            let url = nats_url();
            let admin = detect("the conformance suite on transport-nats", &url).await?;
            assert_declares("transport-nats", admin.capabilities(), expected);
            let h = NatsHarness {
                admin,
                url,
                started: Instant::now(),
                expected,
                plans: Mutex::new(Vec::new()),
            };
            Some(run_and_clean_up(&h, scenario, crate::rabbitmq::SCENARIO_LIMIT).await)
        })
    }
}

#[async_trait]
impl Harness for NatsHarness {
    type Transport = NatsTransport;

    fn name(&self) -> &'static str {
        "transport-nats"
    }

    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities {
            transport: self.expected,
            crash_consumer: true,
            refuse_publishes: true,
            death_records: false,
            timing: Timing::Wall { slack: SLACK },
        }
    }

    fn unsupported(&self, need: Need) -> Option<String> {
        (!self.capabilities().has(need)).then(|| format!("NATS JetStream lacks {need}"))
    }

    fn stopwatch(&self) -> Stopwatch {
        let started = self.started;
        Stopwatch::new(move || started.elapsed())
    }

    fn unique_queue(&self, scenario: &str) -> String {
        unique_name(scenario)
    }

    async fn transport(&self) -> Arc<NatsTransport> {
        let t = NatsTransport::connect(test_config(&self.url))
            .await
            .expect("a NATS connection");
        assert_declares(self.name(), t.capabilities(), self.expected);
        Arc::new(t)
    }

    async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults) {
        self.track(plan);
        self.admin
            .provision(plan)
            .await
            .expect("provision over NATS");
        let js = async_nats::jetstream::new(self.admin.client().clone());
        for queue in &faults.refuse_publishes_to {
            // A stream whose messages may be 1 byte long refuses every clone.
            let mut stream = js
                .get_stream(stream_name(queue))
                .await
                .expect("the stream to make refusing");
            let mut config = stream.info().await.expect("stream info").config.clone();
            config.max_message_size = 1;
            js.update_stream(config)
                .await
                .expect("make the stream refuse publishes");
        }
    }

    fn track(&self, plan: &TopologyPlan) {
        self.plans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(plan.clone());
    }

    async fn prepare(&self, transport: &NatsTransport, plan: &TopologyPlan) {
        transport
            .verify(plan)
            .await
            .expect("the declared topology verifies");
    }

    async fn publish(&self, queue: &str, message: &TestMessage) {
        publish_test_message(self.admin.client(), queue, message).await;
    }

    async fn ready(&self, queue: &str) -> usize {
        let n = self
            .admin
            .count(queue)
            .await
            .unwrap_or_else(|e| panic!("count {queue}: {e}"));
        usize::try_from(n).expect("a count that fits")
    }

    async fn take_parked(&self, plan: &TopologyPlan) -> Vec<ParkedMessage> {
        take_all(&self.admin, plan.parking_queue()).await
    }

    async fn crash(&self, transport: Arc<NatsTransport>) {
        // Nothing settled: the server hands out what it held again after the ack wait.
        transport.close().await;
    }

    async fn close(&self, transport: Arc<NatsTransport>) {
        transport.close().await;
    }

    async fn sleep(&self, duration: Duration) {
        tokio::time::sleep(duration).await;
    }

    async fn cleanup(&self) {
        let plans = std::mem::take(&mut *self.plans.lock().unwrap_or_else(|e| e.into_inner()));
        for plan in &plans {
            delete_plan(self.admin.client(), plan).await;
        }
        self.admin.close().await;
    }
}
