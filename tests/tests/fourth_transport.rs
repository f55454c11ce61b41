//! How to run the conformance suite on a transport of your own, as a complete example that
//! runs: `cargo test -p conformance --test fourth_transport`.
//!
//! Five steps:
//!
//! 1. a [`Transport`] (here [`Fourth`], transport-memory's connection decorated with
//!    `transport_kit::forward`: it cannot declare topology, and its `provision` only
//!    verifies; every other call reaches transport-memory unchanged);
//! 2. a [`Harness`] for it (here [`FourthHarness`]), which gives scenarios connections,
//!    declares their topology, publishes test messages, reads the parking queue, injects
//!    faults and tells the time, plus a runner that runs one scenario on a harness of its
//!    own;
//! 3. [`conformance::conformance_tests!`] with the harness, the runner and the scenarios
//!    the transport is expected to skip: one `#[test]` per scenario, here run twice: on
//!    [`Fourth`] itself and behind a [`DynTransport`] ([`conformance::ErasedHarness`]), as
//!    a registry hands it out;
//! 4. a [`Registration`] (here [`registration`], for `fourth://` URLs), which a program
//!    adds to its registry with one line, and then connects to by URL;
//! 5. [`Admin`] for it (here transport-memory's, forwarded by the layer, with `apply`
//!    refused), with which its registration gives it `retryctl` and the console: a binary
//!    of its own calls `retryctl::main_with` with a registry that has it.
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
use retry_core::{
    Admin, AppliedObject, Capabilities, ConnectError, ConnectOptions, Depth, DynTransport,
    Endpoint, Registration, RetryPolicy, TopologyPlan, Transport, TransportError,
};
use transport_kit::forward::{Decorate, Decorated};
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

/// The transport under test: one connection to the in-memory broker, every call forwarded
/// by the layer, except what [`NoDeclare`] changes.
type Fourth = Decorated<MemoryTransport, NoDeclare>;

/// What [`Fourth`] changes of transport-memory: it does not declare topology, so its
/// `provision` verifies instead, and what `retryctl` and the console ask it to create is
/// refused. The rest, the broker's virtual clock and solo gate included, is forwarded.
struct NoDeclare;

impl Decorate<MemoryTransport> for NoDeclare {
    type Mark = ();

    fn capabilities(&self, inner: &MemoryTransport) -> Capabilities {
        Capabilities {
            declares_topology: false,
            ..inner.capabilities()
        }
    }

    async fn provision(
        &self,
        inner: &MemoryTransport,
        plan: &TopologyPlan,
    ) -> Result<(), TransportError> {
        inner.verify(plan).await
    }

    async fn apply(
        &self,
        _: &MemoryTransport,
        _: &TopologyPlan,
    ) -> Result<Vec<AppliedObject>, TransportError> {
        Err(TransportError::Unsupported {
            what: "creating queues with the fourth transport".into(),
            why: "it declares nothing: declare the plan with the broker's own tools, then check \
                  it with `retryctl topology verify`"
                .into(),
        })
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
        let t = Fourth::new(self.memory.broker().connect(), NoDeclare);
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
        let connection = transport.inner();
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
    registration_on(Broker::new())
}

/// [`registration`], every connection to `broker`.
fn registration_on(broker: Broker) -> Registration {
    Registration::new(
        "fourth",
        "the fourth transport",
        ["fourth"],
        move |_: Endpoint| {
            let connection = Fourth::new(broker.connect(), NoDeclare);
            async move { Ok(DynTransport::with_admin(connection)) }
        },
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

/// With [`Admin`] and its registration, the fourth transport gets `retryctl` without a change
/// to it: a binary of its own would call `retryctl::main_with(registry)`; this test runs the
/// same command with `retryctl::run_with` and its arguments, on one broker it looks at.
#[test]
fn the_fourth_transport_gets_retryctl_from_its_registration() {
    use std::process::ExitCode;
    use transport_memory::Outgoing;

    let broker = Broker::new();
    let registry = retry_transports::registry().with(registration_on(broker.clone()));
    let policy_file = std::env::temp_dir().join(format!(
        "fourth-transport-policy-{}.toml",
        std::process::id()
    ));
    std::fs::write(
        &policy_file,
        "[backoff]\nkind = \"list\"\ndelays = [\"200ms\", \"400ms\"]\n",
    )
    .expect("write the policy file");
    let policy_path = policy_file.to_str().expect("a UTF-8 path");
    let retryctl = |args: &[&str]| {
        let all = ["retryctl", "--url", "fourth://broker"].iter().chain(args);
        retryctl::run_with(all, registry.clone())
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let depth = |queue: &str| runtime.block_on(broker.connect().depth(queue)).unwrap();

    // Nothing declared yet: verify finds no work queue, and the fourth transport refuses to
    // create one (exit 2), as its `Admin` says.
    let verify = ["topology", "verify", "orders", "--policy", policy_path];
    assert_eq!(retryctl(&verify), ExitCode::from(1));
    let apply = ["topology", "apply", "orders", "--policy", policy_path];
    assert_eq!(retryctl(&apply), ExitCode::from(2));
    assert_eq!(depth("orders"), Depth::Missing);

    // Declared with the broker's own tools, the plan verifies.
    let policy = RetryPolicy::delays([200, 400].map(Duration::from_millis))
        .build()
        .unwrap();
    let plan = TopologyPlan::new("orders", &policy).unwrap();
    runtime
        .block_on(Transport::provision(&broker.connect(), &plan))
        .unwrap();
    assert_eq!(retryctl(&verify), ExitCode::SUCCESS);

    // A parked message is listed, and replayed to the work queue.
    broker
        .publish(Outgoing::to_queue("orders.parking", b"order 7".to_vec()).with_message_id("o-7"))
        .expect("park a message");
    assert_eq!(retryctl(&["parked", "list", "orders"]), ExitCode::SUCCESS);
    assert_eq!(
        retryctl(&["parked", "replay", "orders", "--all"]),
        ExitCode::SUCCESS
    );
    assert_eq!(depth("orders.parking"), Depth::Ready(0));
    assert_eq!(depth("orders"), Depth::Ready(1));
    let _ = std::fs::remove_file(&policy_file);
}
