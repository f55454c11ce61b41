//! [`ErasedHarness`]: any harness, its transport behind a [`DynTransport`], so the suite
//! checks that the erasure the registry hands out changes nothing.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use retry_core::{DynTransport, TopologyPlan};

use crate::harness::{
    Harness, HarnessCapabilities, Need, ParkedMessage, Stopwatch, TestMessage, TopologyFaults,
};

/// The harness `H`, whose connections are handed to the scenarios as [`DynTransport`]s:
/// the consumer, the parking lot and every scenario run on the erased transport, and the
/// harness's own moves (crashes, closes) reach the concrete one inside.
///
/// ```no_run
/// use conformance::{ErasedHarness, MemoryHarness};
/// # mod expected { pub const MEMORY: retry_core::Capabilities = retry_core::Capabilities {
/// #   publisher_confirms: true, delivery_count: true, native_delays: false,
/// #   dead_letter_exchange: true, declares_topology: true };
/// #   pub const MEMORY_SKIPS: &[&str] = &[]; }
///
/// conformance::conformance_tests! {
///     /// Every scenario on transport-memory behind a `DynTransport`.
///     mod scenario {
///         harness: ErasedHarness<MemoryHarness>,
///         run: |s| {
///             let h = ErasedHarness::new(MemoryHarness::new(expected::MEMORY));
///             h.inner().block_on(s.run(&h))
///         },
///         skips: expected::MEMORY_SKIPS,
///     }
/// }
/// # fn main() {}
/// ```
#[derive(Debug)]
pub struct ErasedHarness<H> {
    inner: H,
}

impl<H: Harness> ErasedHarness<H> {
    /// `inner`, erased.
    pub fn new(inner: H) -> Self {
        ErasedHarness { inner }
    }

    /// The harness inside.
    pub fn inner(&self) -> &H {
        &self.inner
    }

    /// The concrete connection inside `transport`, which this harness made.
    fn concrete(transport: &DynTransport) -> Arc<H::Transport> {
        transport
            .downcast_ref::<Arc<H::Transport>>()
            .unwrap_or_else(|| panic!("{transport:?} was not made by this harness"))
            .clone()
    }
}

#[async_trait]
impl<H: Harness> Harness for ErasedHarness<H> {
    type Transport = DynTransport;

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> HarnessCapabilities {
        self.inner.capabilities()
    }

    fn unsupported(&self, need: Need) -> Option<String> {
        self.inner.unsupported(need)
    }

    fn stopwatch(&self) -> Stopwatch {
        self.inner.stopwatch()
    }

    fn unique_queue(&self, scenario: &str) -> String {
        self.inner.unique_queue(scenario)
    }

    async fn transport(&self) -> Arc<DynTransport> {
        Arc::new(DynTransport::new(self.inner.transport().await))
    }

    async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults) {
        self.inner.provision(plan, faults).await
    }

    fn track(&self, plan: &TopologyPlan) {
        self.inner.track(plan)
    }

    async fn prepare(&self, transport: &DynTransport, plan: &TopologyPlan) {
        self.inner.prepare(&Self::concrete(transport), plan).await
    }

    async fn publish(&self, queue: &str, message: &TestMessage) {
        self.inner.publish(queue, message).await
    }

    async fn ready(&self, queue: &str) -> usize {
        self.inner.ready(queue).await
    }

    async fn take_parked(&self, plan: &TopologyPlan) -> Vec<ParkedMessage> {
        self.inner.take_parked(plan).await
    }

    async fn crash(&self, transport: Arc<DynTransport>) {
        let concrete = Self::concrete(&transport);
        drop(transport);
        self.inner.crash(concrete).await
    }

    async fn close(&self, transport: Arc<DynTransport>) {
        let concrete = Self::concrete(&transport);
        drop(transport);
        self.inner.close(concrete).await
    }

    async fn sleep(&self, duration: Duration) {
        self.inner.sleep(duration).await
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await
    }
}
