//! How to run the conformance suite on a transport of your own, as a complete example that
//! runs: `cargo test -p conformance --test fourth_transport`.
//!
//! Three steps:
//!
//! 1. a [`Transport`] (here [`Fourth`], a newtype over transport-memory's connection that
//!    forwards every call, and cannot declare topology: its `provision` only verifies);
//! 2. a [`Harness`] for it (here [`FourthHarness`]), which gives scenarios connections,
//!    declares their topology, publishes test messages, reads the parking queue, injects
//!    faults and tells the time, plus a runner that runs one scenario on a harness of its
//!    own;
//! 3. [`conformance::conformance_tests!`] with the harness, the runner and the scenarios
//!    the transport is expected to skip: one `#[test]` per scenario, here run twice: on
//!    [`Fourth`] itself and behind a [`DynTransport`] ([`conformance::ErasedHarness`]), as
//!    a registry hands it out;
//! 4. a [`Registration`] (here [`registration`], for `fourth://` URLs), which a program
//!    adds to its registry with one line, and then connects to by URL.
//!
//! `docs/new-transport.md` is the whole recipe.
//!
//! A transport over a real broker has the same shape: its runner builds a tokio runtime,
//! connects, and runs the scenario with `conformance::suite::run_and_clean_up`, as
//! `conformance::rabbitmq::run_scenario` does for RabbitMQ.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use conformance::harness::assert_declares;
use conformance::suite::Scenario;
use conformance::{
    ErasedHarness, Harness, HarnessCapabilities, MemoryHarness, ParkedMessage, Stopwatch,
    TestMessage, TopologyFaults, Verdict,
};
use futures::future::BoxFuture;
use retry_core::{
    Capabilities, ConnectError, ConnectOptions, Delivery, DynTransport, Endpoint, Message, Publish,
    PublishResult, Registration, Settlement, Timestamp, TopologyPlan, Transport, TransportError,
};
use transport_memory::{Broker, MemoryTransport};

/// What [`Fourth`] declares, written down here rather than asked of it: the harness checks
/// every connection against it, so a transport that loses a capability fails its tests
/// instead of quietly skipping more.
const EXPECTED: Capabilities = Capabilities {
    publisher_confirms: true,
    delivery_count: true,
    native_delays: false,
    dead_letter_exchange: true,
    declares_topology: false,
};

/// The scenarios [`Fourth`] is expected to skip, for the capabilities it lacks: both need a
/// transport that declares a plan (the delay cascade's bindings included) itself.
const EXPECTED_SKIPS: &[&str] = &[
    "no_head_of_line_blocking_any_delay",
    "transport_declares_topology",
];

/// The transport under test: one connection to the in-memory broker, every call forwarded,
/// except that it does not declare topology (it verifies instead).
struct Fourth(MemoryTransport);

#[async_trait]
impl Transport for Fourth {
    type Tag = <MemoryTransport as Transport>::Tag;
    type Subscription = <MemoryTransport as Transport>::Subscription;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            declares_topology: false,
            ..self.0.capabilities()
        }
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.verify(plan).await
    }

    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.0.verify(plan).await
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self::Subscription, TransportError> {
        self.0.consume(queue, prefetch).await
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<Self::Tag>>, TransportError> {
        self.0.fetch(queue).await
    }

    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        self.0.ready(queue, poll).await
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        self.0.publish(original, publish).await
    }

    async fn settle(&self, tag: &Self::Tag, settlement: Settlement) -> Result<(), TransportError> {
        self.0.settle(tag, settlement).await
    }

    // The broker's virtual clock: without these two the engine would read the wall clock.
    fn now(&self) -> Timestamp {
        self.0.now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.0.sleep(duration)
    }
}

/// [`Fourth`] as the scenarios see it. Everything around the transport under test
/// (declaring topology, publishing test messages, reading queues) goes through a
/// transport-memory harness on the same broker.
struct FourthHarness {
    memory: MemoryHarness,
}

impl FourthHarness {
    /// The runner for `conformance_tests!`: a harness (and a broker) per scenario, run on
    /// the broker's virtual clock. Nothing to clean up.
    fn run(scenario: Scenario<Self>) -> Verdict {
        let h = FourthHarness {
            memory: MemoryHarness::new(transport_memory_capabilities()),
        };
        h.memory.block_on(scenario.run(&h))
    }
}

/// What transport-memory itself declares, for the inner harness.
fn transport_memory_capabilities() -> Capabilities {
    Capabilities {
        declares_topology: true,
        ..EXPECTED
    }
}

#[async_trait]
impl Harness for FourthHarness {
    type Transport = Fourth;

    fn name(&self) -> &'static str {
        "fourth-transport"
    }

    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities {
            transport: EXPECTED,
            ..self.memory.capabilities()
        }
    }

    fn stopwatch(&self) -> Stopwatch {
        self.memory.stopwatch()
    }

    fn unique_queue(&self, scenario: &str) -> String {
        self.memory.unique_queue(scenario)
    }

    async fn transport(&self) -> Arc<Fourth> {
        let t = Fourth(self.memory.broker().connect());
        assert_declares(self.name(), t.capabilities(), EXPECTED);
        Arc::new(t)
    }

    async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults) {
        self.memory.provision(plan, faults).await;
    }

    fn track(&self, plan: &TopologyPlan) {
        self.memory.track(plan);
    }

    async fn prepare(&self, _transport: &Fourth, _plan: &TopologyPlan) {}

    async fn publish(&self, queue: &str, message: &TestMessage) {
        self.memory.publish(queue, message).await;
    }

    async fn ready(&self, queue: &str) -> usize {
        self.memory.ready(queue).await
    }

    async fn take_parked(&self, plan: &TopologyPlan) -> Vec<ParkedMessage> {
        self.memory.take_parked(plan).await
    }

    async fn crash(&self, transport: Arc<Fourth>) {
        let connection = &transport.0;
        connection
            .broker()
            .close_connection(connection.connection_id(), "consumer process crashed");
    }

    async fn close(&self, transport: Arc<Fourth>) {
        drop(transport);
    }

    async fn sleep(&self, duration: Duration) {
        self.memory.sleep(duration).await;
    }

    async fn cleanup(&self) {
        self.memory.cleanup().await;
    }
}

conformance::conformance_tests! {
    /// Every scenario on [`Fourth`].
    mod scenario {
        harness: FourthHarness,
        run: FourthHarness::run,
        skips: EXPECTED_SKIPS,
    }
}

conformance::conformance_tests! {
    /// Every scenario on [`Fourth`] behind a [`DynTransport`].
    mod erased_scenario {
        harness: ErasedHarness<FourthHarness>,
        run: |s| {
            let h = ErasedHarness::new(FourthHarness {
                memory: MemoryHarness::new(transport_memory_capabilities()),
            });
            h.inner().memory.block_on(s.run(&h))
        },
        skips: EXPECTED_SKIPS,
    }
}

/// [`Fourth`] for a registry: `fourth://`, a connection to a new in-memory broker each
/// time, with no settings.
fn registration() -> Registration {
    Registration::new(
        "fourth",
        "the fourth transport",
        ["fourth"],
        |_: Endpoint| async { Ok(DynTransport::new(Fourth(Broker::new().connect()))) },
    )
}

/// One line joins the registry of the workspace's transports; the URL then picks it, and
/// the registry checks what it is given before connecting.
#[test]
fn the_fourth_transport_joins_a_registry_with_one_line() {
    let mut registry = retry_transports::registry();
    registry.register(registration());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let t = registry.connect("fourth://").await.expect("connects");
        assert!(t.downcast_ref::<Fourth>().is_some(), "{t:?}");
        assert_eq!(t.capabilities(), EXPECTED);
        let err = registry
            .connect_with(
                "fourth://",
                ConnectOptions::new().with_setting("window", "9"),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ConnectError::UnknownSetting { key, .. } if key == "window"),
            "{err}"
        );
        // The built-in transports are still there.
        assert_eq!(
            registry.resolve("memory://", None).unwrap().name(),
            "memory"
        );
    });
}
