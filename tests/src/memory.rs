//! The harness for transport-memory: a scenario runs on the broker's virtual clock
//! ([`Broker::block_on`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use retry_core::{Capabilities, Settlement, TopologyPlan, Transport};
use transport_memory::{Broker, MemoryTransport, Outgoing, QueueOptions, QueueOverflow};

use crate::harness::{
    Harness, HarnessCapabilities, ParkedMessage, Stopwatch, TestMessage, Timing, TopologyFaults,
    assert_declares,
};
use crate::suite::Scenario;
use crate::verdict::Verdict;

/// The in-memory broker as a harness: a fresh broker per harness, so scenarios share
/// nothing, and time that moves only when everything is waiting.
#[derive(Debug)]
pub struct MemoryHarness {
    broker: Broker,
    start: retry_core::Timestamp,
    expected: Capabilities,
}

impl MemoryHarness {
    /// A harness on a new broker, whose transport must declare exactly `expected` (the
    /// test's own record of what transport-memory supports; see
    /// [`HarnessCapabilities::transport`]). Panics if it does not.
    pub fn new(expected: Capabilities) -> Self {
        let broker = Broker::new();
        let start = broker.now();
        assert_declares(
            "transport-memory",
            broker.connect().capabilities(),
            expected,
        );
        MemoryHarness {
            broker,
            start,
            expected,
        }
    }

    /// The broker.
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// Runs `future` to completion on this harness's virtual clock; see
    /// [`Broker::block_on`].
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.broker.block_on(future)
    }

    /// Runs `scenario` on a harness of its own that expects `expected` (see
    /// [`new`](Self::new)), on its virtual clock: the runner
    /// [`conformance_tests!`](crate::conformance_tests) takes for transport-memory. There
    /// is nothing to clean up: the broker goes with the harness.
    pub fn run(scenario: Scenario<MemoryHarness>, expected: Capabilities) -> Verdict {
        let h = MemoryHarness::new(expected);
        h.block_on(scenario.run(&h))
    }
}

#[async_trait]
impl Harness for MemoryHarness {
    type Transport = MemoryTransport;

    fn name(&self) -> &'static str {
        "transport-memory"
    }

    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities {
            transport: self.expected,
            crash_consumer: true,
            refuse_publishes: true,
            death_records: true,
            timing: Timing::Virtual,
        }
    }

    fn stopwatch(&self) -> Stopwatch {
        let broker = self.broker.clone();
        let start = self.start;
        Stopwatch::new(move || broker.now().saturating_duration_since(start))
    }

    fn unique_queue(&self, scenario: &str) -> String {
        // Each harness has a broker of its own.
        format!("cf-{scenario}")
    }

    async fn transport(&self) -> Arc<MemoryTransport> {
        let t = self.broker.connect();
        assert_declares(self.name(), t.capabilities(), self.expected);
        Arc::new(t)
    }

    async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults) {
        // The shared delay cascade as the transport declares it; the plan's own objects
        // below, with the faults asked for.
        if let Some(cascade) = plan.cascade() {
            self.broker
                .provision_cascade(cascade)
                .expect("declare the delay cascade");
        }
        for x in plan.exchanges() {
            self.broker
                .declare_exchange(&x.name, x.kind)
                .expect("declare exchange");
        }
        for q in plan.queues() {
            let mut options = QueueOptions::from(&q.arguments);
            if faults.refuse_publishes_to.contains(&q.name) {
                options = options
                    .with_max_length(0)
                    .with_overflow(QueueOverflow::RejectPublish);
            }
            self.broker
                .declare_queue(&q.name, options)
                .expect("declare queue");
        }
        for b in plan.bindings() {
            self.broker
                .bind(&b.exchange, &b.queue, &b.routing_key)
                .expect("bind");
        }
    }

    fn track(&self, _plan: &TopologyPlan) {}

    async fn prepare(&self, _transport: &MemoryTransport, _plan: &TopologyPlan) {}

    async fn publish(&self, queue: &str, message: &TestMessage) {
        let confirm = self
            .broker
            .publish(Outgoing::to_queue(queue, message.body.clone()).with_message_id(&message.id))
            .expect("publish");
        assert_eq!(
            confirm,
            retry_core::Confirm::Ack,
            "publish to {queue} confirmed"
        );
    }

    async fn ready(&self, queue: &str) -> usize {
        self.broker
            .ready(queue)
            .unwrap_or_else(|| panic!("queue {queue} does not exist"))
    }

    async fn take_parked(&self, plan: &TopologyPlan) -> Vec<ParkedMessage> {
        // Taken with gets, as the RabbitMQ harnesses take them.
        let reader = self.broker.connect();
        let mut out = Vec::new();
        while let Some(d) = reader
            .fetch(plan.parking_queue())
            .await
            .expect("read the parking queue")
        {
            reader
                .settle_now(&d.tag, Settlement::Ack)
                .expect("ack a parked message");
            out.push(ParkedMessage {
                id: d.message.properties().message_id.clone(),
                body: d.message.body().to_vec(),
                headers: d.message.headers().clone(),
            });
        }
        out
    }

    async fn crash(&self, transport: Arc<MemoryTransport>) {
        self.broker
            .close_connection(transport.connection_id(), "consumer process crashed");
    }

    async fn close(&self, transport: Arc<MemoryTransport>) {
        // Dropping the last handle closes the connection, as a clean exit does.
        drop(transport);
    }

    async fn sleep(&self, duration: Duration) {
        self.broker.sleep(duration).await;
    }

    async fn cleanup(&self) {}
}
