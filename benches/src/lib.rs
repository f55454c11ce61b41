//! The workspace's measurements of its transports, written once and run on each.
//!
//! Three binaries, each taking the transport by name as its first argument:
//!
//! ```sh
//! cargo run --release -p benches --bin throughput -- amqp091      # or amqp10, nats
//! cargo run --release -p benches --bin lateness -- nats
//! cargo run --release -p benches --bin first_delivery             # every transport
//! ```
//!
//! What is ours in each is one generic function over a [`Subject`], whose
//! [`Subject::Transport`] is the concrete transport type (`AmqpTransport`,
//! `Amqp10Transport`, `NatsTransport`): the consumer under test is
//! `retry_core::Consumer<S::Transport, _>`, monomorphised per transport, so no erasure is
//! measured by accident (what a `DynTransport` costs is measured apart, by
//! `cargo bench -p transport-memory --bench erasure`). Beside it, in the same run and on the
//! same server, each transport's module brings the plain client loops a careful user would
//! write ([`amqp091`]: lapin; [`amqp10`]: fe2o3-amqp; [`nats`]: async-nats), and
//! `benches/vs-node.sh` adds the seed article's Node.js consumer on RabbitMQ.
//!
//! A transport of your own is measured by implementing [`Subject`] for it (how to reach its
//! server to declare, fill, count and delete queues, which a benchmark does beside the
//! consumer) and adding its name to the binaries' `match`.

use std::future::Future;
use std::time::Duration;

use retry_core::{RetryPolicy, TopologyPlan, Transport};

pub use bench_support::BoxError;

pub mod amqp091;
pub mod amqp10;
pub mod lateness;
pub mod meter;
pub mod nats;
pub mod ours;
pub mod report;

pub use lateness::{Lateness, Trial};
pub use meter::{Measured, Meter};

/// The transports the binaries measure, by the name they take.
pub const TRANSPORTS: [&str; 3] = ["amqp091", "amqp10", "nats"];

/// The unknown-transport error of the binaries, naming the culprit and what is known.
pub fn unknown_transport(name: &str) -> BoxError {
    format!(
        "unknown transport {name:?}; this benchmark runs on {}",
        TRANSPORTS.join(", ")
    )
    .into()
}

/// The unknown-path error of `S`, naming the culprit and every path `S` knows.
pub fn unknown_path<S: Subject>(path: &str) -> BoxError {
    let peers: Vec<&str> = S::peers().iter().map(|p| p.path).collect();
    format!(
        "unknown path {path:?} on {}; known: ours-success, ours-retry, {}",
        S::NAME,
        peers.join(", ")
    )
    .into()
}

/// Which side of the retry decision a path measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Consume and settle: every handler succeeds.
    Success,
    /// Clone to the delay queue, confirm, then settle the original.
    Retry,
}

/// A plain client loop a [`Subject`] runs beside ours: its name on the command line, its
/// label in the table, which side it measures, and what it does (the table's legend).
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    /// Its name in `--paths` and in result lines.
    pub path: &'static str,
    /// Its row label in the table.
    pub label: &'static str,
    /// The path it is a baseline for.
    pub side: Side,
    /// One line on what it does.
    pub legend: &'static str,
}

/// Where a measurement runs: a consumer on fresh queues of a topology plan, `n` messages of
/// `body` bytes prefilled, at `prefetch`.
#[derive(Clone, Debug)]
pub struct Run<'a> {
    /// The plan, declared and prefilled.
    pub plan: &'a TopologyPlan,
    /// The policy the plan was made from.
    pub policy: &'a RetryPolicy,
    /// Messages in the work queue.
    pub n: u64,
    /// Deliveries in hand at once.
    pub prefetch: u16,
    /// Bytes per body.
    pub body: usize,
}

impl Run<'_> {
    /// The work queue.
    pub fn queue(&self) -> &str {
        self.plan.work_queue()
    }

    /// The delay queue of the plan's first level, where the retry path's clones go.
    pub fn delay_queue(&self) -> Result<&str, BoxError> {
        self.plan
            .queues()
            .iter()
            .find(|q| matches!(q.role, retry_core::QueueRole::Delay { .. }))
            .map(|q| q.name.as_str())
            .ok_or_else(|| "the plan has no delay queue".into())
    }
}

/// A transport as the benchmarks drive it: the concrete [`Transport`] under test, and how
/// to reach its server for what a benchmark does beside the consumer (declaring, filling,
/// counting and deleting queues), plus the plain client loops that are its baselines.
///
/// Each method returns a `Send` future, so that the binaries can run them on any runtime
/// thread. A measurement is written once, generic over the subject:
///
/// ```no_run
/// use std::time::Duration;
///
/// use benches::amqp091::Amqp091;
/// use benches::{Run, Subject, ours};
/// use retry_core::{RetryPolicy, TopologyPlan};
///
/// async fn success_rate<S: Subject>(queue: &str) -> Result<f64, benches::BoxError> {
///     let subject = S::open().await?;
///     let policy = RetryPolicy::delays([Duration::from_secs(3600)]).build()?;
///     let plan = TopologyPlan::new(queue, &policy)?;
///     subject.declare(&plan).await?;
///     subject.prefill(queue, 1_000, 256).await?;
///     let run = Run { plan: &plan, policy: &policy, n: 1_000, prefetch: 100, body: 256 };
///     let measured = ours::throughput(&subject, &run, false).await;
///     subject.delete(&plan).await?;
///     Ok(1_000.0 / measured?.timing.wall.as_secs_f64())
/// }
///
/// # async fn demo() -> Result<(), benches::BoxError> {
/// println!("{:.0} msg/s", success_rate::<Amqp091>("bench-doc").await?);
/// # Ok(()) }
/// ```
pub trait Subject: Sized + Send + Sync {
    /// The transport under test, concrete.
    type Transport: Transport;

    /// The name the binaries take (`amqp091`).
    const NAME: &'static str;

    /// The server's command name in `/proc`, for its CPU time (`beam.smp`).
    const SERVER: &'static str;

    /// The plain client's name in tables (`lapin`).
    const PLAIN: &'static str;

    /// Connects what the benchmark uses beside the consumer, from the environment's URL.
    fn open() -> impl Future<Output = Result<Self, BoxError>> + Send;

    /// A new transport for one consumer.
    fn connect(&self) -> impl Future<Output = Result<Self::Transport, BoxError>> + Send;

    /// Declares `plan`'s queues, empty.
    fn declare(&self, plan: &TopologyPlan) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Publishes `n` persistent messages of `body` bytes to `queue`, each confirmed.
    fn prefill(
        &self,
        queue: &str,
        n: u64,
        body: usize,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Publishes one persistent message with `body` per id, message id the id, at `rate`
    /// per second; returns once every one is confirmed.
    fn publish_paced(
        &self,
        queue: &str,
        ids: Vec<u64>,
        body: &[u8],
        rate: f64,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// How many messages `queue` holds, asked until there are `expected` or a few seconds
    /// have passed (settlements reach a server asynchronously).
    fn count(
        &self,
        queue: &str,
        expected: u64,
    ) -> impl Future<Output = Result<u64, BoxError>> + Send;

    /// Deletes `plan`'s queues and whatever a peer declared beside them.
    fn delete(&self, plan: &TopologyPlan) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// The plain client loops measured beside ours, in their default order.
    fn peers() -> &'static [Peer];

    /// Runs the peer named `path` on `run`'s prefilled work queue; returns what it measured
    /// and the queue its clones went to (the plan's delay queue unless the peer declared
    /// its own), for the check that nothing was lost.
    fn peer(
        &self,
        path: &str,
        run: &Run<'_>,
    ) -> impl Future<Output = Result<(Measured, String), BoxError>> + Send;

    /// The server's own floor for the lateness of a delayed retry, in the table's words
    /// (`plain lapin, TTL queue + DLX`): see [`Subject::floor`].
    const FLOOR: &'static str;

    /// Whether [`Subject::floor`] can give each message a delay of its own (a
    /// [`Trial::jitter`] run); if not, the `lateness` binary refuses `--jitter`.
    const FLOOR_JITTERS: bool;

    /// The server's floor for [`ours::lateness`]: the same trial (its plan declared and
    /// empty, the same messages published at the same rate with
    /// [`Subject::publish_paced`]) through a plain client that delays each first delivery
    /// by the server's own means and times its second, noting each first failure and second
    /// run on a [`lateness::Clock`]. Whatever it declares beside the plan,
    /// [`Subject::delete`] deletes.
    fn floor(&self, trial: &Trial<'_>) -> impl Future<Output = Result<Lateness, BoxError>> + Send;

    /// The plain client's time to first delivery: from just before it connects to the
    /// first message in hand on `queue`, which holds one; the message is then settled and
    /// the client closed. The plain half of the `first_delivery` binary, beside
    /// [`ours::first_delivery`].
    fn plain_first_delivery(
        &self,
        queue: &str,
    ) -> impl Future<Output = Result<Duration, BoxError>> + Send;
}

/// A measurement that has not finished by then failed.
pub const BOUND: Duration = Duration::from_secs(300);

/// How long a queue's count may take to settle after a measurement (a server handles
/// settlements and the end of a connection asynchronously).
pub const SETTLING: Duration = Duration::from_secs(5);
