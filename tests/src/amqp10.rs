//! The harness for transport-amqp10 on the local RabbitMQ's AMQP 1.0 plugin.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use retry_core::{Capabilities, Settlement, Subscription, TopologyPlan, Transport};
use transport_amqp10::{Amqp10Config, Amqp10Transport};

use crate::harness::{
    Harness, HarnessCapabilities, Need, ParkedMessage, Stopwatch, TestMessage, Timing,
    TopologyFaults, assert_declares,
};
use crate::rabbitmq::{Admin, BrokerEnv, SLACK, run_scenario, unique_name};
use crate::suite::Scenario;
use crate::verdict::Verdict;

/// RabbitMQ 3.x over AMQP 1.0 as a harness. The plugin cannot declare queues with
/// arguments, so topology is declared over AMQP 0-9-1 by an [`Admin`] connection, as a
/// deployment would; test messages are published there too. Parked messages are read over
/// AMQP 1.0, because the engine's headers travel as application properties, which reach
/// AMQP 0-9-1 as opaque bytes.
#[derive(Debug)]
pub struct Amqp10Harness {
    env: BrokerEnv,
    admin: Admin,
    started: Instant,
    expected: Capabilities,
}

impl Amqp10Harness {
    /// Connects the admin connection, and checks that an AMQP 1.0 connection declares
    /// exactly `expected` (the test's own record of what transport-amqp10 supports on this
    /// broker; see [`HarnessCapabilities::transport`]), as every later one must: panics if
    /// one does not.
    pub async fn connect(env: BrokerEnv, expected: Capabilities) -> Self {
        let admin = Admin::connect(&env.amqp091_url).await;
        let h = Amqp10Harness {
            env,
            admin,
            started: Instant::now(),
            expected,
        };
        let probe = h.transport().await;
        probe.close().await;
        h
    }

    fn config(&self) -> Amqp10Config {
        // A refused send is never answered on RabbitMQ 3.x: keep its timeout short.
        Amqp10Config::new(&self.env.amqp10_url)
            .with_publish_timeout(Duration::from_secs(2))
            .with_operation_timeout(Duration::from_secs(10))
    }

    /// Runs `scenario` on a harness of its own on the local RabbitMQ, whose connections
    /// must declare `expected` (see [`connect`](Self::connect)), and deletes what it
    /// declared: the runner [`conformance_tests!`](crate::conformance_tests) takes for this
    /// transport. `None` without a broker, unless `REQUIRE_BROKER` is set; see
    /// [`run_scenario`].
    pub fn run(scenario: Scenario<Self>, expected: Capabilities) -> Option<Verdict> {
        run_scenario(
            "the conformance suite on transport-amqp10",
            true,
            scenario,
            move |env| Self::connect(env, expected),
        )
    }
}

#[async_trait]
impl Harness for Amqp10Harness {
    type Transport = Amqp10Transport;

    fn name(&self) -> &'static str {
        "transport-amqp10"
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
        if self.capabilities().has(need) {
            return None;
        }
        Some(match need {
            Need::DeclaresTopology => "RabbitMQ 3.x's AMQP 1.0 plugin cannot declare queues with arguments; provision verifies, and the topology is declared over AMQP 0-9-1".to_owned(),
            other => format!("RabbitMQ 3.x over AMQP 1.0 lacks {other}"),
        })
    }

    fn stopwatch(&self) -> Stopwatch {
        let started = self.started;
        Stopwatch::new(move || started.elapsed())
    }

    fn unique_queue(&self, scenario: &str) -> String {
        unique_name(scenario)
    }

    async fn transport(&self) -> Arc<Amqp10Transport> {
        let t = Amqp10Transport::connect(self.config())
            .await
            .expect("an AMQP 1.0 connection");
        assert_declares(self.name(), t.capabilities(), self.expected);
        Arc::new(t)
    }

    async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults) {
        self.admin.provision(plan, faults).await;
    }

    fn track(&self, plan: &TopologyPlan) {
        self.admin.track(plan);
    }

    async fn prepare(&self, transport: &Amqp10Transport, plan: &TopologyPlan) {
        transport
            .verify(plan)
            .await
            .expect("the declared topology verifies over AMQP 1.0");
    }

    async fn publish(&self, queue: &str, message: &TestMessage) {
        self.admin.publish(queue, message).await;
    }

    async fn ready(&self, queue: &str) -> usize {
        self.admin.ready(queue).await
    }

    async fn take_parked(&self, plan: &TopologyPlan) -> Vec<ParkedMessage> {
        let queue = plan.parking_queue();
        let n = self.admin.ready(queue).await;
        if n == 0 {
            return Vec::new();
        }
        let reader = Amqp10Transport::connect(self.config())
            .await
            .expect("an AMQP 1.0 reader");
        let prefetch = u16::try_from(n).unwrap_or(u16::MAX);
        let parked = reader
            .consume(queue, prefetch)
            .await
            .expect("consume the parking queue");
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let d = match tokio::time::timeout(Duration::from_secs(10), parked.recv()).await {
                Ok(Ok(Some(d))) => d,
                other => panic!(
                    "read {} of {n} parked messages over AMQP 1.0, then: {other:?}",
                    out.len()
                ),
            };
            reader
                .settle(&d.tag, Settlement::Ack)
                .await
                .expect("accept a parked message");
            out.push(ParkedMessage {
                id: d.message.properties().message_id.clone(),
                body: d.message.body().to_vec(),
                headers: d.message.headers().clone(),
            });
        }
        reader.close().await;
        out
    }

    async fn crash(&self, transport: Arc<Amqp10Transport>) {
        // Detaching and closing without settling: the broker releases what the links held.
        transport.close().await;
    }

    async fn close(&self, transport: Arc<Amqp10Transport>) {
        transport.close().await;
    }

    async fn sleep(&self, duration: Duration) {
        tokio::time::sleep(duration).await;
    }

    async fn cleanup(&self) {
        self.admin.cleanup().await;
    }
}
