//! The `Harness` trait: what a transport under test gives the scenarios.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use retry_core::{Capabilities, Headers, ParkedRecord, TopologyPlan, Transport};

/// How a harness measures time, and so how strictly scenarios check delays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// A virtual clock that moves only when everything is idle: a delay is observed exactly.
    Virtual,
    /// The wall clock of a real broker. A delay is checked as a lower bound only (an upper
    /// bound would flake on a loaded machine): the next run starts no earlier than the delay
    /// minus `slack` after the failed run started.
    Wall {
        /// How far below the delay an observation may fall. The failed run starts before its
        /// clone is enqueued, so the true wait is never shorter than the delay; the slack
        /// only absorbs the broker's millisecond rounding of TTL expiry.
        slack: Duration,
    },
}

impl Timing {
    /// How far below a delay an observed wait may fall: zero on a virtual clock.
    pub fn slack(self) -> Duration {
        match self {
            Timing::Virtual => Duration::ZERO,
            Timing::Wall { slack } => slack,
        }
    }
}

/// What a harness can do, beyond the transport's own [`Capabilities`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HarnessCapabilities {
    /// What the transport must declare: the value the test that built the harness wrote
    /// down, never read back from the transport under test. The harness checks every
    /// connection it opens against it ([`assert_declares`]), so a transport that declares
    /// less fails instead of quietly skipping the scenarios that need what it dropped.
    pub transport: Capabilities,
    /// A consumer can be made to crash: its future dropped and its connection closed while
    /// it holds deliveries, so the broker hands them out again.
    pub crash_consumer: bool,
    /// Publishes into chosen queues can be refused (a full `reject-publish` queue).
    pub refuse_publishes: bool,
    /// The broker's dead-letter records (`x-death`) reach the handler.
    pub death_records: bool,
    /// How time is measured.
    pub timing: Timing,
}

/// Panics unless `transport` (named `name`) declares exactly the capabilities its test
/// expects. Harnesses call it on every connection they open.
pub fn assert_declares(name: &str, declared: Capabilities, expected: Capabilities) {
    assert_eq!(
        declared, expected,
        "{name} declares capabilities other than the ones its test expects (left: declared, right: expected)"
    );
}

/// Something a scenario needs; a harness that lacks it makes the scenario skip.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Need {
    /// [`HarnessCapabilities::crash_consumer`].
    CrashConsumer,
    /// [`HarnessCapabilities::refuse_publishes`].
    RefusePublishes,
    /// [`Capabilities::declares_topology`]: the transport declares a plan itself.
    DeclaresTopology,
    /// A delayed clone comes back: TTL delay queues dead-letter it back
    /// ([`Capabilities::dead_letter_exchange`]), or the broker holds it for its delay
    /// ([`Capabilities::native_delays`]).
    DelayedRetries,
    /// [`Capabilities::dead_letter_exchange`]: TTL queues dead-letter, as a delay cascade's
    /// levels do into each other.
    DeadLetterExchange,
    /// [`Capabilities::publisher_confirms`]: a refused publish is reported, so the original
    /// can be requeued instead of lost.
    PublisherConfirms,
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Need::CrashConsumer => "crash_consumer",
            Need::RefusePublishes => "refuse_publishes",
            Need::DeclaresTopology => "declares_topology",
            Need::DelayedRetries => "delayed_retries",
            Need::DeadLetterExchange => "dead_letter_exchange",
            Need::PublisherConfirms => "publisher_confirms",
        })
    }
}

impl HarnessCapabilities {
    /// Whether `need` is met.
    pub fn has(&self, need: Need) -> bool {
        match need {
            Need::CrashConsumer => self.crash_consumer,
            Need::RefusePublishes => self.refuse_publishes,
            Need::DeclaresTopology => self.transport.declares_topology,
            Need::DelayedRetries => {
                self.transport.dead_letter_exchange || self.transport.native_delays
            }
            Need::DeadLetterExchange => self.transport.dead_letter_exchange,
            Need::PublisherConfirms => self.transport.publisher_confirms,
        }
    }
}

/// A test message: a message id (which also seeds the engine's jitter) and a body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestMessage {
    /// The `message-id` property.
    pub id: String,
    /// The body, opaque to the engine.
    pub body: Vec<u8>,
}

impl TestMessage {
    /// A message whose body names its id, so a mixed-up body is easy to spot.
    pub fn new(id: impl Into<String>) -> Self {
        let id = id.into();
        let body = format!("body of {id}").into_bytes();
        TestMessage { id, body }
    }
}

/// A message taken from a parking queue.
#[derive(Clone, Debug, PartialEq)]
pub struct ParkedMessage {
    /// Its `message-id`, if it has one.
    pub id: Option<String>,
    /// Its body.
    pub body: Vec<u8>,
    /// Its headers, the engine's diagnostics among them.
    pub headers: Headers,
}

impl ParkedMessage {
    /// The engine's record: why, when and from where it was parked.
    pub fn record(&self) -> ParkedRecord<'_> {
        ParkedRecord::decode(&self.headers)
    }
}

/// Changes to a plan's queues when a harness declares it, to provoke broker behaviour.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopologyFaults {
    /// Queues that refuse every publish: declared with `x-max-length: 0` and
    /// `x-overflow: reject-publish`.
    pub refuse_publishes_to: Vec<String>,
}

/// A clock a handler can read from any task: time since the harness started.
#[derive(Clone)]
pub struct Stopwatch(Arc<dyn Fn() -> Duration + Send + Sync>);

impl Stopwatch {
    /// A stopwatch reading `elapsed`.
    pub fn new(elapsed: impl Fn() -> Duration + Send + Sync + 'static) -> Self {
        Stopwatch(Arc::new(elapsed))
    }

    /// Time since the harness started.
    pub fn elapsed(&self) -> Duration {
        (self.0)()
    }
}

impl fmt::Debug for Stopwatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Stopwatch").field(&self.elapsed()).finish()
    }
}

/// One transport under test, as the scenarios see it: fresh connections, topology under
/// unique names, test messages in, parked messages out, faults, and a clock.
///
/// Each scenario gets a harness of its own, built by the runner its test was given (see
/// [`conformance_tests!`](crate::conformance_tests)), which calls
/// [`cleanup`](Self::cleanup) when the scenario ends, passed or failed (see
/// [`run_and_clean_up`](crate::suite::run_and_clean_up)), so scenarios can run side by
/// side, one test thread each, on one broker. Methods panic with a message naming what
/// failed: they are test code, and a panic fails the scenario that called them.
///
/// To run the suite on a new transport, implement this trait for a harness of it and
/// give it to [`conformance_tests!`](crate::conformance_tests); the crate docs walk
/// through it, and `tests/tests/fourth_transport.rs` is a complete example.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The transport under test.
    type Transport: Transport;

    /// The transport's name in messages, such as `transport-amqp091`.
    fn name(&self) -> &'static str;

    /// What the harness and its transport can do.
    fn capabilities(&self) -> HarnessCapabilities;

    /// Why `need` is not met, or `None` when it is. The default names the missing
    /// capability; harnesses say why their broker lacks it.
    fn unsupported(&self, need: Need) -> Option<String> {
        (!self.capabilities().has(need)).then(|| format!("{} lacks {need}", self.name()))
    }

    /// The harness's clock, for handlers and scenarios.
    fn stopwatch(&self) -> Stopwatch;

    /// A work-queue name no other scenario or test run uses, short enough for every name
    /// derived from it.
    fn unique_queue(&self, scenario: &str) -> String;

    /// A new connection.
    async fn transport(&self) -> Arc<Self::Transport>;

    /// Declares `plan` (with `faults` applied) the way a deployment would, and remembers it
    /// for [`cleanup`](Self::cleanup).
    async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults);

    /// Remembers a plan something else declares (a transport's own `provision`), for
    /// [`cleanup`](Self::cleanup).
    fn track(&self, plan: &TopologyPlan);

    /// Makes `transport` ready to carry `plan`'s routes without declaring anything, for
    /// consumers built with `provision(false)` over a topology the harness altered.
    async fn prepare(&self, transport: &Self::Transport, plan: &TopologyPlan);

    /// Publishes a test message to `queue` through the default exchange, with a confirm.
    async fn publish(&self, queue: &str, message: &TestMessage);

    /// Messages ready in `queue`. Panics when the queue does not exist.
    async fn ready(&self, queue: &str) -> usize;

    /// Takes every message out of `plan`'s parking queue.
    async fn take_parked(&self, plan: &TopologyPlan) -> Vec<ParkedMessage>;

    /// Crashes the connection of a consumer whose future was dropped: the broker gets back
    /// what it held unsettled, flagged redelivered. Nothing is flushed first.
    async fn crash(&self, transport: Arc<Self::Transport>);

    /// Closes a connection whose consumer stopped normally.
    async fn close(&self, transport: Arc<Self::Transport>);

    /// Sleeps on the harness's clock.
    async fn sleep(&self, duration: Duration);

    /// Deletes everything this harness declared or tracked.
    async fn cleanup(&self);
}
