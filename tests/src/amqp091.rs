//! The harness for transport-amqp091 on the local RabbitMQ.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use retry_core::{Capabilities, TopologyPlan, Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

use crate::harness::{
    Harness, HarnessCapabilities, ParkedMessage, Stopwatch, TestMessage, Timing, TopologyFaults,
    assert_declares,
};
use crate::rabbitmq::{Admin, BrokerEnv, run_scenario, unique_name};
use crate::suite::Scenario;
use crate::verdict::Verdict;

pub use crate::rabbitmq::SLACK;

/// RabbitMQ over AMQP 0-9-1 as a harness: consumers on transport-amqp091 connections,
/// topology, test messages and inspection through an [`Admin`] connection of its own.
#[derive(Debug)]
pub struct Amqp091Harness {
    env: BrokerEnv,
    admin: Admin,
    started: Instant,
    expected: Capabilities,
}

impl Amqp091Harness {
    /// Connects the admin connection. Every transport-amqp091 connection, the admin's
    /// included, must declare exactly `expected` (the test's own record of what
    /// transport-amqp091 supports; see [`HarnessCapabilities::transport`]): panics if one
    /// does not.
    pub async fn connect(env: BrokerEnv, expected: Capabilities) -> Self {
        let admin = Admin::connect(&env.amqp091_url).await;
        assert_declares("transport-amqp091", admin.capabilities(), expected);
        Amqp091Harness {
            env,
            admin,
            started: Instant::now(),
            expected,
        }
    }

    /// The admin connection.
    pub fn admin(&self) -> &Admin {
        &self.admin
    }

    /// Runs `scenario` on a harness of its own on the local RabbitMQ, whose connections
    /// must declare `expected` (see [`connect`](Self::connect)), and deletes what it
    /// declared: the runner [`conformance_tests!`](crate::conformance_tests) takes for this
    /// transport. `None` without a broker, unless `REQUIRE_BROKER` is set; see
    /// [`run_scenario`].
    pub fn run(scenario: Scenario<Self>, expected: Capabilities) -> Option<Verdict> {
        run_scenario(
            "the conformance suite on transport-amqp091",
            false,
            scenario,
            move |env| Self::connect(env, expected),
        )
    }
}

#[async_trait]
impl Harness for Amqp091Harness {
    type Transport = AmqpTransport;

    fn name(&self) -> &'static str {
        "transport-amqp091"
    }

    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities {
            transport: self.expected,
            crash_consumer: true,
            refuse_publishes: true,
            death_records: true,
            timing: Timing::Wall { slack: SLACK },
        }
    }

    fn stopwatch(&self) -> Stopwatch {
        let started = self.started;
        Stopwatch::new(move || started.elapsed())
    }

    fn unique_queue(&self, scenario: &str) -> String {
        unique_name(scenario)
    }

    async fn transport(&self) -> Arc<AmqpTransport> {
        let config = AmqpConfig::new(&self.env.amqp091_url)
            .with_connection_name(unique_name("consumer"))
            .with_confirm_timeout(Duration::from_secs(10));
        let t = AmqpTransport::connect(config)
            .await
            .expect("an AMQP 0-9-1 connection");
        assert_declares(self.name(), t.capabilities(), self.expected);
        Arc::new(t)
    }

    async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults) {
        self.admin.provision(plan, faults).await;
    }

    fn track(&self, plan: &TopologyPlan) {
        self.admin.track(plan);
    }

    async fn prepare(&self, _transport: &AmqpTransport, _plan: &TopologyPlan) {}

    async fn publish(&self, queue: &str, message: &TestMessage) {
        self.admin.publish(queue, message).await;
    }

    async fn ready(&self, queue: &str) -> usize {
        self.admin.ready(queue).await
    }

    async fn take_parked(&self, plan: &TopologyPlan) -> Vec<ParkedMessage> {
        self.admin.take_all(plan.parking_queue()).await
    }

    async fn crash(&self, transport: Arc<AmqpTransport>) {
        // Straight to the connection: the transport's own close would send its batched
        // acknowledgements first, which a crashing process never does.
        let _ = transport
            .connection()
            .close(320, "consumer process crashed".into())
            .await;
    }

    async fn close(&self, transport: Arc<AmqpTransport>) {
        AmqpTransport::close(&transport)
            .await
            .expect("close the connection");
    }

    async fn sleep(&self, duration: Duration) {
        tokio::time::sleep(duration).await;
    }

    async fn cleanup(&self) {
        self.admin.cleanup().await;
    }
}
