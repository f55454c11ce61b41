//! Support for tests that need a running broker: one reading of `REQUIRE_BROKER`, a skip
//! notice the test harness cannot swallow, [`rabbitmqctl`] for faults and inspection,
//! [`refusing`] queue arguments and [`redeclare`] to make a queue of a plan refuse publishes,
//! [`delete_blocking`] for a guard that deletes a test's topology even when the test panics,
//! a [`LogRecorder`] to check what was logged, and the local test cluster ([`cluster`],
//! [`cluster_sh`], [`ClusterLease`]).
//! Every broker test in this workspace uses it, and a user's own broker tests can too.
//!
//! Without a broker, a test is skipped loudly; with `REQUIRE_BROKER` set to anything but
//! empty or `0` (as CI sets it), it fails instead, so a broker test can never skip silently.
//!
//! ```no_run
//! use transport_amqp091::testing;
//!
//! fn broker_answers() -> Result<(), String> {
//!     Err("connection refused".into())
//! }
//!
//! if let Err(why) = broker_answers() {
//!     testing::no_broker("my broker test", &why); // panics when REQUIRE_BROKER is set
//!     return;
//! }
//! ```

mod raw;

pub use raw::{RawProperties, RawPublisher, RawTable};

use std::fmt::Write as _;
use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// Deletes what a test declared on the broker at `config`: `plans`, then their delay
/// cascades, then `queues`. It runs on a thread of its own with a runtime of its own and
/// returns when that is done, so a guard's `Drop`, which is synchronous and may run inside
/// the test's runtime (or while it unwinds from a panic), can call it. Each step waits at
/// most 10 s and its errors are ignored: cleaning up must not fail a test, and a cascade
/// shared by two plans is simply found gone the second time.
///
/// ```no_run
/// use retry_core::TopologyPlan;
/// use transport_amqp091::AmqpConfig;
///
/// struct Cleanup(AmqpConfig, TopologyPlan);
///
/// impl Drop for Cleanup {
///     fn drop(&mut self) {
///         transport_amqp091::testing::delete_blocking(&self.0, std::slice::from_ref(&self.1), &[]);
///     }
/// }
/// ```
pub fn delete_blocking(
    config: &crate::AmqpConfig,
    plans: &[retry_core::TopologyPlan],
    queues: &[String],
) {
    use std::time::Duration;
    use tokio::time::timeout;
    let within = Duration::from_secs(10);
    let (config, plans, queues) = (config.clone(), plans.to_vec(), queues.to_vec());
    let deleting = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let Ok(Ok(t)) = timeout(within, crate::AmqpTransport::connect(config)).await else {
                return;
            };
            // The plans first: a cascade may be shared by several of them.
            for plan in &plans {
                let _ = timeout(within, t.teardown(plan)).await;
            }
            for cascade in plans.iter().filter_map(|p| p.cascade()) {
                let _ = timeout(within, t.teardown_cascade(cascade)).await;
            }
            if !queues.is_empty()
                && let Ok(channel) = t.connection().create_channel().await
            {
                for queue in &queues {
                    let _ = channel
                        .queue_delete(queue.as_str().into(), Default::default())
                        .await;
                }
            }
            let _ = t.close().await;
        });
    });
    let _ = deleting.join();
}

/// `args` plus a length limit of zero with `reject-publish`: a queue declared with them
/// refuses every publish with a negative confirm, which is how tests make a clone's publish
/// fail on a real broker.
///
/// ```
/// use lapin::types::{AMQPValue, FieldTable};
/// use transport_amqp091::testing::refusing;
///
/// let args = refusing(FieldTable::default());
/// assert_eq!(
///     args.inner().get("x-overflow"),
///     Some(&AMQPValue::LongString("reject-publish".into()))
/// );
/// ```
pub fn refusing(mut args: lapin::types::FieldTable) -> lapin::types::FieldTable {
    use lapin::types::AMQPValue;
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    args
}

/// Replaces the queue `queue` of the provisioned `plan`: deletes it, declares it again with
/// its plan arguments passed through `args` (for instance [`refusing`]), and binds it again
/// as the plan does, since deleting a queue drops its bindings. Messages in it are lost.
///
/// Panics if the plan has no queue of that name.
///
/// ```no_run
/// # async fn f(channel: lapin::Channel, plan: retry_core::TopologyPlan) -> Result<(), lapin::Error> {
/// use transport_amqp091::testing::{redeclare, refusing};
///
/// // The first delay queue now refuses every clone sent to it.
/// let delay_queue = plan.delay_routes()[0].1.routing_key.to_string();
/// redeclare(&channel, &plan, &delay_queue, refusing).await?;
/// # Ok(()) }
/// ```
pub async fn redeclare(
    channel: &lapin::Channel,
    plan: &retry_core::TopologyPlan,
    queue: &str,
    args: impl FnOnce(lapin::types::FieldTable) -> lapin::types::FieldTable,
) -> Result<(), lapin::Error> {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
    let spec = plan
        .queues()
        .iter()
        .find(|q| q.name == queue)
        .unwrap_or_else(|| panic!("the plan has no queue {queue:?}"));
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await?;
    let options = QueueDeclareOptions {
        durable: spec.durable,
        ..QueueDeclareOptions::default()
    };
    let arguments = args(crate::table_from_headers(&spec.arguments.to_headers()));
    channel
        .queue_declare(queue.into(), options, arguments)
        .await?;
    for binding in plan.bindings().iter().filter(|b| b.queue == queue) {
        channel
            .queue_bind(
                queue.into(),
                binding.exchange.as_str().into(),
                binding.routing_key.as_str().into(),
                QueueBindOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// The environment variable that makes broker tests mandatory.
pub const REQUIRE_BROKER: &str = "REQUIRE_BROKER";

/// Whether `REQUIRE_BROKER` is set to something other than empty or `0`.
pub fn broker_required() -> bool {
    std::env::var(REQUIRE_BROKER).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The environment variable with the test cluster's node list (`tests/cluster.sh urls`).
pub const CLUSTER_URLS: &str = "AMQP_CLUSTER_URLS";

/// The environment variable that makes cluster tests mandatory.
pub const REQUIRE_CLUSTER: &str = "REQUIRE_CLUSTER";

/// The test cluster's node URLs from `AMQP_CLUSTER_URLS`, or `None` after a loud notice that
/// `what` is skipped. With `REQUIRE_CLUSTER` set (as CI sets it) a missing list panics.
///
/// ```no_run
/// let Some(urls) = transport_amqp091::testing::cluster("my cluster test") else {
///     return;
/// };
/// assert_eq!(urls.len(), 3);
/// ```
pub fn cluster(what: &str) -> Option<Vec<String>> {
    match std::env::var(CLUSTER_URLS) {
        Ok(urls) if !urls.trim().is_empty() => {
            Some(urls.split(',').map(|u| u.trim().to_owned()).collect())
        }
        _ => {
            let required = std::env::var(REQUIRE_CLUSTER).is_ok_and(|v| !v.is_empty() && v != "0");
            assert!(
                !required,
                "{REQUIRE_CLUSTER} is set but {CLUSTER_URLS} is not, for {what}: start the cluster with tests/cluster.sh up"
            );
            print_uncaptured(&format!(
                "\n!!! SKIPPED {what}: no cluster ({CLUSTER_URLS} is unset; `tests/cluster.sh up` starts one, `tests/cluster.sh urls` prints it)\n"
            ));
            None
        }
    }
}

/// The environment variable that makes TLS tests mandatory (CI sets it after
/// `tests/tls-node.sh up`).
pub const REQUIRE_TLS: &str = "REQUIRE_TLS";

/// The private TLS node of `tests/tls-node.sh` and its throwaway certificates.
#[derive(Clone, Debug)]
pub struct TlsNode {
    /// The directory of `ca.pem`, `server.pem`, `client.pem`/`client.key`, `expired.pem`/
    /// `expired.key` and `other-ca.pem` (`RTLS_CERTS`, default `/tmp/retry-tls/certs`).
    pub certs: std::path::PathBuf,
    /// The node's plain-TCP port (AMQP 0-9-1 and 1.0).
    pub plain_port: u16,
    /// The node's TLS port (AMQP 0-9-1 and 1.0).
    pub tls_port: u16,
    /// The common name of `client.pem`, the user it logs in as with `EXTERNAL`.
    pub client_cn: String,
}

impl TlsNode {
    /// A file of the certificate directory.
    pub fn cert(&self, name: &str) -> std::path::PathBuf {
        self.certs.join(name)
    }
}

/// The TLS node of `tests/tls-node.sh`, or `None` after a loud notice that `what` is
/// skipped when its TLS port does not answer. With `REQUIRE_TLS` set (as CI sets it) a
/// missing node panics.
///
/// ```no_run
/// let Some(node) = transport_amqp091::testing::tls_node("my TLS test") else {
///     return;
/// };
/// let url = format!("amqps://guest:guest@localhost:{}/%2f", node.tls_port);
/// # drop(url);
/// ```
pub fn tls_node(what: &str) -> Option<TlsNode> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let port = |name: &str, default: &str| -> u16 {
        var(name, default)
            .parse()
            .unwrap_or_else(|e| panic!("{name}: not a port: {e}"))
    };
    let node = TlsNode {
        certs: var("RTLS_CERTS", "/tmp/retry-tls/certs").into(),
        plain_port: port("RTLS_PLAIN_PORT", "5675"),
        tls_port: port("RTLS_TLS_PORT", "5676"),
        client_cn: var("RTLS_CLIENT_CN", "retry-tls-client"),
    };
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], node.tls_port));
    let answers =
        std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2)).is_ok();
    if answers && node.cert("ca.pem").is_file() {
        return Some(node);
    }
    let required = std::env::var(REQUIRE_TLS).is_ok_and(|v| !v.is_empty() && v != "0");
    assert!(
        !required,
        "{REQUIRE_TLS} is set but no TLS node answers on {addr} with certificates in {}, for {what}: start it with tests/tls-node.sh up",
        node.certs.display()
    );
    print_uncaptured(&format!(
        "\n!!! SKIPPED {what}: no TLS node on {addr} (`tests/tls-node.sh up` starts one)\n"
    ));
    None
}

/// Runs the workspace's `tests/cluster.sh` with `args` (`stop rtest1`, `kill rtest2`,
/// `start-all`, ...) and panics with its output if it fails. Blocking: call it from
/// `spawn_blocking` in async code.
///
/// ```no_run
/// transport_amqp091::testing::cluster_sh(&["stop", "rtest1"]);
/// transport_amqp091::testing::cluster_sh(&["start", "rtest1"]);
/// ```
pub fn cluster_sh(args: &[&str]) {
    if let Err(e) = try_cluster_sh(args) {
        panic!("{e}");
    }
}

/// Runs `tests/cluster.sh` with `args` as [`cluster_sh`] does, returning its failure
/// (the command and what it printed) instead of panicking.
///
/// ```no_run
/// if let Err(e) = transport_amqp091::testing::try_cluster_sh(&["kill", "rtest2"]) {
///     eprintln!("{e}");
/// }
/// ```
pub fn try_cluster_sh(args: &[&str]) -> Result<(), String> {
    let out = cluster_script(args)
        .output()
        .map_err(|e| format!("tests/cluster.sh {args:?} did not run: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "tests/cluster.sh {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The test cluster for one test at a time (tests that stop and kill nodes must not overlap
/// within a test binary): every node is started when the lease is taken and again when it
/// is dropped, passed or failed, so that one test's failure never becomes the next one's.
///
/// ```no_run
/// # async fn f() {
/// let _lease = transport_amqp091::testing::ClusterLease::take().await;
/// // ... stop and kill nodes ...
/// # }
/// ```
pub struct ClusterLease {
    _one: tokio::sync::MutexGuard<'static, ()>,
}

impl ClusterLease {
    /// Waits for the other tests of this process to give the cluster back, then starts
    /// every node.
    pub async fn take() -> Self {
        static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let one = ONE_AT_A_TIME.lock().await;
        tokio::task::spawn_blocking(|| cluster_sh(&["start-all"]))
            .await
            .expect("tests/cluster.sh start-all");
        ClusterLease { _one: one }
    }
}

impl Drop for ClusterLease {
    /// Starts every node again; a failure is not reported (a `Drop` must not panic, and the
    /// next lease starts them anyway).
    fn drop(&mut self) {
        let _ = cluster_script(&["start-all"]).output();
    }
}

/// The workspace's `tests/cluster.sh` with `args`, ready to run.
fn cluster_script(args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new("bash");
    command
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/cluster.sh"))
        .args(args);
    command
}

/// Writes to the process's standard error directly: `eprint!` is captured by the test
/// harness for passing tests, a write to the handle is not.
pub fn print_uncaptured(text: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(text.as_bytes());
    let _ = stderr.flush();
}

/// A broker test found no broker (`why`): with `REQUIRE_BROKER` set this panics; otherwise
/// it prints a loud notice that `what` is skipped, past the harness's capture, and returns
/// so that the test can return early.
pub fn no_broker(what: &str, why: &str) {
    if broker_required() {
        panic!("{REQUIRE_BROKER} is set, but no broker answers for {what}: {why}");
    }
    print_uncaptured(&format!(
        "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\
         !!! SKIPPED {what}: no broker ({why}).\n\
         !!! Start RabbitMQ (with rabbitmq_amqp1_0 enabled), or set {REQUIRE_BROKER}=1 to\n\
         !!! make this a failure.\n\
         !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
    ));
}

/// Runs `rabbitmqctl` (as on the machine the broker runs on) with `args` and returns what it
/// printed; panics, naming the command and its error output, if it cannot run or fails.
///
/// ```no_run
/// let users = transport_amqp091::testing::rabbitmqctl(&["list_users", "-q"]);
/// assert!(users.contains("guest"));
/// ```
pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A `tracing` subscriber that keeps every event and span, at every level and from every
/// crate, as a line of text: to check what reaches the logs, such as that no password does.
///
/// ```
/// use transport_amqp091::testing::LogRecorder;
///
/// let recorder = LogRecorder::default();
/// tracing::subscriber::with_default(recorder.clone(), || {
///     tracing::warn!(url = "amqp://app:****@broker", "connection lost");
/// });
/// assert_eq!(recorder.containing("connection lost").len(), 1);
/// assert!(recorder.containing("secret").is_empty());
/// assert_eq!(recorder.at_least(tracing::Level::WARN).len(), 1);
/// assert!(recorder.at_least(tracing::Level::ERROR).is_empty());
/// ```
#[derive(Clone, Debug, Default)]
pub struct LogRecorder {
    lines: Arc<Mutex<Vec<Recorded>>>,
    /// The most verbose level kept; `None` keeps every level, and spans.
    verbosity: Option<Level>,
}

/// One recorded line, with its event's level (`None` for a span).
#[derive(Debug)]
struct Recorded {
    level: Option<Level>,
    text: String,
    at: std::time::SystemTime,
}

impl LogRecorder {
    /// A recorder of events at `level` or more severe only, and no spans: for a whole test
    /// process, where lapin's frame-by-frame TRACE lines would be too many.
    ///
    /// ```
    /// use transport_amqp091::testing::LogRecorder;
    ///
    /// let recorder = LogRecorder::up_to(tracing::Level::INFO);
    /// tracing::subscriber::with_default(recorder.clone(), || {
    ///     tracing::debug!("frame sent");
    ///     tracing::info!("connected");
    /// });
    /// assert_eq!(recorder.len(), 1);
    /// ```
    pub fn up_to(level: Level) -> Self {
        LogRecorder {
            verbosity: Some(level),
            ..LogRecorder::default()
        }
    }

    /// How many lines were recorded.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The recorded lines that contain `text`.
    pub fn containing(&self, text: &str) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|line| line.text.contains(text))
            .map(|line| line.text.clone())
            .collect()
    }

    /// The recorded events at `level` or more severe (`WARN` gives warnings and errors).
    pub fn at_least(&self, level: Level) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|line| line.level.is_some_and(|l| l <= level))
            .map(|line| line.text.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Recorded>> {
        self.lines.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The recorded events at `level` or more severe, each after the UTC time of day it was
    /// recorded at (`HH:MM:SS.mmm`), for a failing test's message.
    ///
    /// ```
    /// use transport_amqp091::testing::LogRecorder;
    ///
    /// let recorder = LogRecorder::up_to(tracing::Level::INFO);
    /// tracing::subscriber::with_default(recorder.clone(), || tracing::warn!("node down"));
    /// let lines = recorder.timed(tracing::Level::WARN);
    /// // "12:34:56.789 WARN <module> message=node down"
    /// let (time, rest) = lines[0].split_once(' ').unwrap();
    /// assert_eq!((time.len(), &time[2..3], &time[8..9]), (12, ":", "."), "{lines:?}");
    /// assert!(rest.starts_with("WARN ") && rest.ends_with(" message=node down"), "{lines:?}");
    /// ```
    pub fn timed(&self, level: Level) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|line| line.level.is_some_and(|l| l <= level))
            .map(|line| {
                let ms = line
                    .at
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() % 86_400_000);
                format!(
                    "{:02}:{:02}:{:02}.{:03} {}",
                    ms / 3_600_000,
                    ms / 60_000 % 60,
                    ms / 1_000 % 60,
                    ms % 1_000,
                    line.text
                )
            })
            .collect()
    }

    fn keep(&self, level: Option<Level>, line: Line) {
        self.lock().push(Recorded {
            level,
            text: line.0,
            at: std::time::SystemTime::now(),
        });
    }
}

/// One line being written: a prefix, then ` name=value` per field.
struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }

    /// An error with its whole chain of causes, as a subscriber that prints sources does.
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let _ = write!(self.0, " {}={value}", field.name());
        let mut cause = value.source();
        while let Some(e) = cause {
            let _ = write!(self.0, ": {e}");
            cause = e.source();
        }
    }
}

impl Subscriber for LogRecorder {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        match self.verbosity {
            None => true,
            Some(level) => metadata.is_event() && *metadata.level() <= level,
        }
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut line = Line(format!("span {}", span.metadata().name()));
        span.record(&mut line);
        self.keep(None, line);
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, values: &Record<'_>) {
        let mut line = Line("record".into());
        values.record(&mut line);
        self.keep(None, line);
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = Line(format!("{} {}", meta.level(), meta.target()));
        event.record(&mut line);
        self.keep(Some(*meta.level()), line);
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
