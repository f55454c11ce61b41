//! The harness for transport-memory, and the executor that runs a scenario on its virtual
//! clock.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use async_trait::async_trait;
use retry_core::{Capabilities, Settlement, TopologyPlan, Transport};
use transport_memory::{Broker, MemoryTransport, Outgoing, Overflow, QueueOptions};

use crate::harness::{
    Harness, HarnessCapabilities, ParkedMessage, Stopwatch, TestMessage, Timing, TopologyFaults,
    assert_declares,
};
use crate::suite::{Scenario, SuiteReport, panic_message, run_sequentially};

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

    /// Runs `future` to completion on this harness's virtual clock; see [`block_on`].
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        block_on(&self.broker, future)
    }

    /// Runs `scenarios` one after another, each on a harness of its own that expects
    /// `expected` (see [`new`](Self::new)).
    pub fn run_suite(scenarios: &[Scenario<MemoryHarness>], expected: Capabilities) -> SuiteReport {
        run_sequentially("transport-memory", scenarios, |s| {
            std::panic::catch_unwind(AssertUnwindSafe(|| {
                let h = MemoryHarness::new(expected);
                h.block_on((s.run)(&h))
            }))
            .map_err(|payload| panic_message(payload.as_ref()))
        })
    }
}

/// How many times the clock may move for one future: far more than any scenario needs,
/// so only a runaway loop reaches it.
const MAX_STEPS: u64 = 20_000_000;
/// How many polls in a row without the clock moving: a future that keeps waking itself
/// without waiting on anything is a bug.
const MAX_SPINS: u64 = 1_000_000;

struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs `future` to completion on `broker`'s virtual clock: polls it until it stops
/// waking itself, then moves the clock to the next deadline (a sleep ending, a message
/// expiring) and polls again. Panics if the future waits while nothing is due (it could
/// never finish) or if it never settles.
pub fn block_on<F: Future>(broker: &Broker, future: F) -> F::Output {
    let flag = Arc::new(Flag(AtomicBool::new(true)));
    let waker = Waker::from(Arc::clone(&flag));
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    for _ in 0..MAX_STEPS {
        let mut spins = 0;
        while flag.0.swap(false, Ordering::AcqRel) {
            if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                return out;
            }
            spins += 1;
            assert!(spins < MAX_SPINS, "the future keeps waking itself");
        }
        if broker.step().is_none() {
            panic!(
                "stalled at {:?}: the future waits, and nothing is due on the virtual clock",
                broker.now()
            );
        }
    }
    panic!("the virtual clock moved {MAX_STEPS} times and the future is not done");
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
                    .with_overflow(Overflow::RejectPublish);
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
