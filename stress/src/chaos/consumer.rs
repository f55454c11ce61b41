//! The chaos consumer process (`chaos_consumer`): the real [`Consumer`] on
//! transport-amqp091 or transport-amqp10 (through a [`Journaled`] wrapper), with a handler
//! that does what each message's id says ([`Class`]), journaling every run, outcome and
//! terminal. It stops gracefully when its standard input closes.

use std::fmt::Write as _;
use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use retry_core::{Consumer, HandlerError, Message, RunReport, Terminal, Transport};
use retry_core::{QueueType, TopologyBuilder, TopologyPlan, headers::CRASHES};
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

use super::journal::JournalWriter;
use super::script::{self, Class, Does};
use super::transport::{Journaled, chain, message_id};
use conformance::rabbitmq::runtime;

/// Which transport a consumer process runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// transport-amqp091.
    Amqp091,
    /// transport-amqp10.
    Amqp10,
}

impl Protocol {
    /// Its name on command lines and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Amqp091 => "amqp091",
            Protocol::Amqp10 => "amqp10",
        }
    }

    /// Reads a name.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "amqp091" | "0-9-1" | "091" => Ok(Protocol::Amqp091),
            "amqp10" | "1.0" | "10" => Ok(Protocol::Amqp10),
            _ => Err(format!("unknown protocol {s:?} (amqp091 or amqp10)")),
        }
    }

    /// The URL of the broker on `port` at loopback for this protocol.
    pub fn url(self, port: u16) -> String {
        match self {
            Protocol::Amqp091 => format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            Protocol::Amqp10 => format!("amqp://guest:guest@127.0.0.1:{port}"),
        }
    }
}

/// A consumer process's settings, passed as `key=value` arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerArgs {
    /// The transport.
    pub protocol: Protocol,
    /// The broker's URL for that protocol, or a cluster's node list joined by commas.
    pub url: String,
    /// The work queue.
    pub queue: String,
    /// The journal file.
    pub journal: PathBuf,
    /// The consumer's prefetch.
    pub prefetch: u16,
    /// How long each handler run takes.
    pub handler: Duration,
    /// The policy's crash limit.
    pub crash_limit: u32,
    /// The policy's first delay, also its crash delay.
    pub delay: Duration,
}

impl ConsumerArgs {
    /// The arguments [`parse`](Self::parse) reads back.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            format!("protocol={}", self.protocol.name()),
            format!("url={}", self.url),
            format!("queue={}", self.queue),
            format!("journal={}", self.journal.display()),
            format!("prefetch={}", self.prefetch),
            format!("handler-ms={}", self.handler.as_millis()),
            format!("crash-limit={}", self.crash_limit),
            format!("delay-ms={}", self.delay.as_millis()),
        ]
    }

    /// Reads `key=value` arguments; every key is required.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let args: Vec<String> = args.into_iter().collect();
        let get = |key: &str| {
            args.iter()
                .find_map(|a| a.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                .ok_or_else(|| format!("missing {key}= (got {args:?})"))
        };
        let num = |key: &str| -> Result<u64, String> {
            get(key)?.parse().map_err(|e| format!("{key}: {e}"))
        };
        Ok(ConsumerArgs {
            protocol: Protocol::parse(get("protocol")?)?,
            url: get("url")?.to_owned(),
            queue: get("queue")?.to_owned(),
            journal: PathBuf::from(get("journal")?),
            prefetch: u16::try_from(num("prefetch")?).map_err(|e| format!("prefetch: {e}"))?,
            handler: Duration::from_millis(num("handler-ms")?),
            crash_limit: u32::try_from(num("crash-limit")?)
                .map_err(|e| format!("crash-limit: {e}"))?,
            delay: Duration::from_millis(num("delay-ms")?),
        })
    }
}

/// The `chaos_consumer` binary beside the running one (the `chaos` and `soak` binaries), or
/// what to build when it is missing.
pub fn exe_beside_this_one(this: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("the current executable: {e}"))?
        .with_file_name("chaos_consumer");
    if exe.exists() {
        Ok(exe)
    } else {
        Err(format!(
            "{} is missing: cargo build -p stress --bin {this} --bin chaos_consumer",
            exe.display()
        ))
    }
}

/// The AMQP 0-9-1 configuration for `url`: one URL, or a cluster's node list joined by
/// commas (see [`ConsumerArgs::url`]).
pub fn amqp091_config(url: &str) -> Result<AmqpConfig, String> {
    if url.contains(',') {
        AmqpConfig::cluster(url.split(',').map(str::to_owned))
            .map_err(|e| format!("the node list: {}", chain(&e)))
    } else {
        Ok(AmqpConfig::new(url))
    }
}

/// The AMQP 1.0 configuration for `url`, as [`amqp091_config`].
pub fn amqp10_config(url: &str) -> Result<Amqp10Config, String> {
    if url.contains(',') {
        Amqp10Config::cluster(url.split(',').map(str::to_owned))
            .map_err(|e| format!("the node list: {}", chain(&e)))
    } else {
        Ok(Amqp10Config::new(url))
    }
}

/// A chaos run's plan on the cluster: quorum queues, each on all three nodes.
pub fn cluster_plan(plan: TopologyBuilder<'_>) -> TopologyBuilder<'_> {
    plan.with_queue_type(QueueType::Quorum)
        .with_replication_factor(3)
}

/// The connection name (AMQP 0-9-1) or container id (AMQP 1.0) of the consumer process
/// `pid`.
pub fn connection_name(pid: u32) -> String {
    format!("chaos-consumer-{pid}")
}

/// The body of the `chaos_consumer` binary.
pub fn main(args: impl IntoIterator<Item = String>) -> ExitCode {
    let args = match ConsumerArgs::parse(args) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("chaos_consumer: {e}");
            return ExitCode::from(2);
        }
    };
    let journal = match JournalWriter::open(&args.journal) {
        Ok(j) => Arc::new(j),
        Err(e) => {
            eprintln!("chaos_consumer: opening {}: {e}", args.journal.display());
            return ExitCode::from(2);
        }
    };
    // The transports' warnings (connections recovered, rebuilt, failed over) go to standard
    // error, which the driver keeps beside the journal: the soak counts stalls from them.
    let _ = tracing::subscriber::set_global_default(Warnings);
    journal.line(
        "start",
        "-",
        format_args!(
            "protocol={} prefetch={}",
            args.protocol.name(),
            args.prefetch
        ),
    );
    match runtime().block_on(run(&args, Arc::clone(&journal))) {
        Ok(report) => {
            journal.line(
                "exit",
                "-",
                format_args!(
                    "result=ok received={} handled={} suspects={} settle-errors={} receive-errors={} left-unsettled={}",
                    report.received,
                    report.handled,
                    report.suspects,
                    report.settle_errors,
                    report.receive_errors,
                    report.left_unsettled,
                ),
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            journal.line("exit", "-", format_args!("result=err err={e}"));
            eprintln!("chaos_consumer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves when standard input closes: the driver's signal to stop gracefully.
fn stdin_closed() -> impl Future<Output = ()> {
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        let _ = closed_tx.send(());
    });
    async move {
        let _ = closed_rx.await;
    }
}

async fn run(args: &ConsumerArgs, journal: Arc<JournalWriter>) -> Result<RunReport, String> {
    let policy = script::policy(args.crash_limit, args.delay);
    let plan = TopologyPlan::new(&args.queue, &policy).map_err(|e| e.to_string())?;
    let name = connection_name(std::process::id());
    let shutdown = stdin_closed();
    match args.protocol {
        Protocol::Amqp091 => {
            let config = amqp091_config(&args.url)?.with_connection_name(name);
            let inner = AmqpTransport::connect(config)
                .await
                .map_err(|e| format!("connecting: {}", chain(&e)))?;
            journal.line("connected", "-", format_args!(""));
            let transport = Arc::new(Journaled::new(inner, &plan, Arc::clone(&journal)));
            let report = consume(Arc::clone(&transport), args, &journal, shutdown).await;
            let _ = transport.inner().close().await;
            report
        }
        Protocol::Amqp10 => {
            let config = amqp10_config(&args.url)?
                .with_container_id(name)
                .with_publish_timeout(Duration::from_secs(5))
                .with_operation_timeout(Duration::from_secs(10));
            let inner = Amqp10Transport::connect(config)
                .await
                .map_err(|e| format!("connecting: {}", chain(&e)))?;
            journal.line("connected", "-", format_args!(""));
            let transport = Arc::new(Journaled::new(inner, &plan, Arc::clone(&journal)));
            let report = consume(Arc::clone(&transport), args, &journal, shutdown).await;
            transport.inner().close().await;
            report
        }
    }
}

async fn consume<T: Transport>(
    transport: T,
    args: &ConsumerArgs,
    journal: &Arc<JournalWriter>,
    shutdown: impl Future<Output = ()>,
) -> Result<RunReport, String> {
    let policy = script::policy(args.crash_limit, args.delay);
    let isolation = TopologyPlan::new(&args.queue, &policy)
        .expect("the plan was made before")
        .isolation_queue()
        .to_owned();
    let (handler_journal, pause) = (Arc::clone(journal), args.handler);
    let handler = move |msg: Message| {
        let id = message_id(&msg).to_owned();
        let attempt = msg.attempt();
        let lane = if msg.queue() == isolation {
            "isolation"
        } else {
            "work"
        };
        let does = Class::of(&id).map_or(Does::Succeed, |c| c.does(attempt));
        handler_journal.line(
            "run",
            &id,
            format_args!("attempt={attempt} lane={lane} does={}", does.word()),
        );
        if does == Does::Abort {
            // Before the first await: the process dies holding the delivery unsettled.
            std::process::abort();
        }
        let journal = Arc::clone(&handler_journal);
        async move {
            tokio::time::sleep(pause).await;
            let (outcome, result) = match does {
                Does::Succeed | Does::Abort => ("ok", Ok(())),
                Does::Fail => (
                    "transient",
                    Err(HandlerError::transient(format!(
                        "scripted failure on attempt {attempt}"
                    ))),
                ),
                Does::Permanent => (
                    "permanent",
                    Err(HandlerError::permanent(format!(
                        "scripted permanent failure on attempt {attempt}"
                    ))),
                ),
            };
            journal.line(
                "ran",
                &id,
                format_args!("attempt={attempt} outcome={outcome}"),
            );
            result
        }
    };
    let terminal_journal = Arc::clone(journal);
    let work_queue = args.queue.clone();
    let on_cluster = args.url.contains(',');
    Consumer::builder(transport, args.queue.clone(), policy, handler)
        .with_topology(move |plan| if on_cluster { cluster_plan(plan) } else { plan })
        .with_prefetch(args.prefetch)
        .with_handler_timeout(Duration::from_secs(10))
        .with_shutdown_grace(Duration::from_secs(5))
        .with_suspect_poll(Duration::from_millis(100))
        .with_on_terminal(move |msg, terminal| {
            let lane = if msg.queue() == work_queue {
                "work"
            } else {
                "isolation"
            };
            let crashes = msg
                .headers()
                .get(CRASHES)
                .and_then(|v| v.as_u64())
                .unwrap_or(0);
            terminal_journal.line(
                "terminal",
                message_id(msg),
                format_args!(
                    "lane={lane} attempt={} had-crashes={crashes} {}",
                    msg.attempt(),
                    describe(terminal)
                ),
            );
        })
        .build()
        .map_err(|e| chain(&e))?
        .run(shutdown)
        .await
        .map_err(|e| chain(&e))
}

/// A terminal in the journal's words.
pub fn describe(terminal: &Terminal) -> String {
    match terminal {
        Terminal::Handled { attempt } => format!("t=handled runs={attempt}"),
        Terminal::Retried { attempts, delay } => {
            format!("t=retried attempts={attempts} delay={}", delay.as_millis())
        }
        Terminal::Isolated => "t=isolated".to_owned(),
        Terminal::Diverted { crashes, delay } => {
            format!("t=diverted crashes={crashes} delay={}", delay.as_millis())
        }
        Terminal::DeadLettered { reason } => format!("t=parked reason={reason}"),
        Terminal::Dropped { reason } => format!("t=dropped reason={reason}"),
        Terminal::Requeued { cause } => format!("t=requeued cause={cause:?}"),
    }
}

/// A tracing subscriber that writes each event at WARN or above but the engine's note of a
/// parked message to standard error, on one line:
/// `<unix-ms> <pid> <LEVEL> <target> message=<message> key=value ...`.
struct Warnings;

/// The engine's warning for each parked message.
const PARKED: &str = " message=parked in the dead-letter queue";

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl tracing::Subscriber for Warnings {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.is_event() && *metadata.level() <= tracing::Level::WARN
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let meta = event.metadata();
        let mut fields = Fields(format!(
            "{} {} {} {}",
            super::journal::unix_ms(),
            std::process::id(),
            meta.level(),
            meta.target()
        ));
        event.record(&mut fields);
        // Parked messages are the journal's business: the engine's warning for each would
        // be most of the lines.
        if fields.0.contains(PARKED) {
            return;
        }
        eprintln!("{}", fields.0.replace('\n', " "));
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}
