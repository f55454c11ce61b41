//! Throughput against the local RabbitMQ: this crate's consumer beside the strongest plain
//! lapin loops and a plain lapin loop doing the seed article's work, measured in the same
//! run, on the same broker, under the same durability, at one or more prefetches.
//!
//! ```sh
//! cargo run --release -p transport-amqp091 --example throughput              # every path, 3 rounds, prefetch 100
//! cargo run --release -p transport-amqp091 --example throughput -- --n 5000 --rounds 5
//! cargo run --release -p transport-amqp091 --example throughput -- --prefetch 20,100,400,1000 --plot rates.svg
//! ```
//!
//! Every measurement waits for the broker to be idle (200 ms under 5% of a core, at most
//! 5 s), then gets queues of its own (a topology plan named
//! `bench-<pid>-<round>-<path>-p<prefetch>`: durable classic queues, the delay queue with a
//! 1 h TTL; `lapin-seed` declares the seed's topology under that name instead), prefilled
//! with N persistent messages of 256 bytes (`--body`), consumed at each prefetch of
//! `--prefetch` (default 100), checked (the work queue is empty once its consumer is gone;
//! on the retry path the delay queue holds exactly N clones) and deleted. The clock runs
//! from just before consuming starts until the last settlement is written (for the retry
//! consumer: until `run` returns, which includes sending the last batched acks). Besides
//! msg/s, each measurement reports the CPU time per message of this process and of the
//! broker (when it runs on this machine), from `/proc`, in whole clock ticks of 10 ms (so
//! short runs read coarse figures), and, when it is the only measurement of its process
//! (`--tsv` with one path, one prefetch, one round), the growth of this process's resident
//! memory while consuming: its peak (`VmHWM`, reset just before consuming starts) minus
//! its resident memory then, which at a large prefetch and body shows the memory each
//! delivery in flight costs.
//!
//! Paths (`--paths`, comma-separated; default all, in this order):
//!
//! | path | what runs |
//! |---|---|
//! | `lapin-ack-each` | success path: plain lapin, one `basic.ack` per delivery |
//! | `lapin-batched` | success path: plain lapin, one `multiple` ack per half prefetch window (the ceiling) |
//! | `ours-success` | success path: the retry consumer with a handler that succeeds |
//! | `lapin-pipelined` | retry path: plain lapin, per delivery publish the clone on a confirm channel of its own (to the same delay queue, by the same route, but without the engine's headers), await its confirm, then ack; up to prefetch deliveries at once |
//! | `lapin-seed` | retry path: plain lapin doing the seed article's work as the Node.js peer's `retry` mode does: the seed's topology (a direct TTL exchange, a TTL queue bound to it whose dead-letter route leads back to the work queue; durable queues expiring after 10 idle minutes), and per delivery a clone with the delivery's properties plus one attempt header, published (not mandatory) through the TTL exchange on a confirm channel, the original acked once its clone is confirmed; pipelined like `lapin-pipelined` |
//! | `ours-retry` | retry path: the retry consumer with a handler that fails the first run; the clone goes to the delay queue |
//!
//! A plain one-message-at-a-time publish-confirm-ack loop is not a baseline (it measures one
//! round trip per message) and is not offered.
//!
//! Rounds are interleaved (every path at every prefetch once per round, the order of these
//! pairs rotated each round). The table has one block per prefetch (and body size): each
//! round, then min, median and max, of msg/s, CPU time per message (ours and the broker's)
//! and memory growth where measured, and the ratios of our consumer to each baseline *in
//! the same round* in each of them; then, with several prefetches, the ratios' medians
//! side by side. `--plot FILE.svg` also draws msg/s against prefetch (log scale), one panel
//! per path, a line per consumer through the medians with bars from min to max, of the
//! body size measured at the most prefetches.
//!
//! Other modes, for `bench/vs-node.sh`, which interleaves a Node.js peer with these paths
//! and runs each measurement as a process of its own:
//!
//! * `--tsv --round R --paths P --prefetch F`: measure round R only (R also picks the
//!   rotation), print one line per path and prefetch: `round path n seconds msg/s load1
//!   client-µs/msg broker-µs/msg prefetch body rss-growth-KiB`, tab-separated, `NaN` where
//!   unknown or not measured.
//! * `--report FILE [--plot FILE.svg]`: print the table (and draw the picture) from such
//!   lines; `node-ack` and `node-retry` lines are shown as the Node.js peer. Lines of eight
//!   columns (from before `--prefetch`) count as prefetch 100 with 256-byte bodies; the CPU
//!   columns may be left out too.
//!
//! `AMQP_URL` picks the broker.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bench_support::BoxError;
use bench_support::args::env_or;
use bench_support::plot::{Panel, Series, log_x_panels};
use bench_support::proc::{Clock, RssGrowth, Timing, load1, wait_for_idle_broker};
use bench_support::publish::{confirm_channel, persistent, prefill};
use bench_support::queue::message_count;
use bench_support::stats::min_median_max;
use bench_support::url::amqp_url;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Confirmation, Connection, ConnectionProperties, ExchangeKind};
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, TopologyPlan, Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// The prefetch and body size without `--prefetch` and `--body`: those of the measurements
/// in docs/benchmarks.md.
const PREFETCH: u16 = 100;
const BODY: usize = 256;
const DELAY: Duration = Duration::from_secs(3600);

/// The paths this example measures, in their default order.
const PATHS: [&str; 6] = [
    "lapin-ack-each",
    "lapin-batched",
    "ours-success",
    "lapin-pipelined",
    "lapin-seed",
    "ours-retry",
];

/// The clocks of one measurement, started together just before consuming starts: wall and
/// CPU time, and the growth of this process's resident memory.
struct Meter {
    clock: Clock,
    rss: RssGrowth,
}

/// What a [`Meter`] measured.
struct Measured {
    timing: Timing,
    /// Peak resident memory above that at the start, bytes; `None` if unknown.
    rss_growth: Option<u64>,
}

impl Meter {
    /// The memory first: resetting the peak is a write to `/proc`, kept off the clocks.
    fn start() -> Self {
        let rss = RssGrowth::start();
        Meter {
            clock: Clock::start(),
            rss,
        }
    }

    fn stop(self) -> Measured {
        let timing = self.clock.stop();
        Measured {
            timing,
            rss_growth: self.rss.peak(),
        }
    }
}

/// Plain lapin, success path: consume `n` and ack each, or every `batch`-th with `multiple`.
async fn lapin_consume(
    conn: &Connection,
    queue: &str,
    n: u64,
    prefetch: u16,
    batch: u64,
) -> Result<Measured, BoxError> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let meter = Meter::start();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "plain".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut count = 0;
    while let Some(d) = consumer.next().await {
        let d = d?;
        count += 1;
        if count % batch == 0 || count == n {
            d.ack(BasicAckOptions {
                multiple: batch > 1,
            })
            .await?;
        }
        if count == n {
            break;
        }
    }
    let took = meter.stop();
    ch.close(200, "done".into()).await?;
    Ok(took)
}

/// How plain lapin publishes a delivery's clone on the retry path.
#[derive(Clone, Copy)]
enum RetryClone {
    /// To the engine's delay queue by the engine's route, `mandatory`, with the delivery's
    /// properties unchanged (none of the engine's headers).
    Pipelined,
    /// The seed article's clone, as the Node.js peer's `retry` mode publishes it: through
    /// the direct TTL exchange by key [`SEED_KEY`], not mandatory, with one header more,
    /// [`SEED_HEADER`], the attempt (1 if absent) plus one.
    Seed,
}

/// The seed's routing key from its TTL exchange to its TTL queue (the peer's `retry-1`).
const SEED_KEY: &str = "retry-1";
/// The seed's attempt header (the peer's).
const SEED_HEADER: &str = "x-retry-attempt";

/// The seed's attempt of a delivery: its [`SEED_HEADER`], an integer of any width, or 1.
fn seed_attempt(headers: Option<&FieldTable>) -> i64 {
    match headers.and_then(|h| h.inner().get(SEED_HEADER)) {
        Some(AMQPValue::ShortShortInt(v)) => i64::from(*v),
        Some(AMQPValue::ShortInt(v)) => i64::from(*v),
        Some(AMQPValue::LongInt(v)) => i64::from(*v),
        Some(AMQPValue::LongLongInt(v)) => *v,
        _ => 1,
    }
}

/// Plain lapin, retry path, as a careful user writes it: deliveries on one channel, clones
/// on a confirm channel of their own; per delivery, publish the clone (as `clone` says) to
/// `exchange` by `routing_key`, await its confirm, then ack the original. Every delivery the
/// prefetch lets in is in flight at once.
async fn lapin_retry(
    conn: &Connection,
    queue: &str,
    (exchange, routing_key): (&str, &str),
    clone: RetryClone,
    n: u64,
    prefetch: u16,
) -> Result<Measured, BoxError> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let publisher = confirm_channel(conn).await?;
    let meter = Meter::start();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "plain-retry".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut in_flight = FuturesUnordered::new();
    let (mut received, mut settled) = (0, 0);
    while settled < n {
        tokio::select! {
            d = consumer.next(), if received < n => {
                let d = d.ok_or("the consumer ended early")??;
                received += 1;
                let publisher = publisher.clone();
                let (exchange, routing_key) = (exchange.to_owned(), routing_key.to_owned());
                in_flight.push(async move {
                    let (mandatory, properties) = match clone {
                        RetryClone::Pipelined => (true, d.properties.clone()),
                        RetryClone::Seed => {
                            let old = d.properties.headers().as_ref();
                            let mut headers = old.cloned().unwrap_or_default();
                            headers.insert(
                                SEED_HEADER.into(),
                                AMQPValue::LongLongInt(seed_attempt(old) + 1),
                            );
                            (false, d.properties.clone().with_headers(headers))
                        }
                    };
                    let confirm = publisher
                        .basic_publish(
                            exchange.into(),
                            routing_key.into(),
                            BasicPublishOptions { mandatory, immediate: false },
                            &d.data,
                            properties,
                        )
                        .await?
                        .await?;
                    if !matches!(confirm, Confirmation::Ack(None)) {
                        return Err(BoxError::from(format!("clone not confirmed: {confirm:?}")));
                    }
                    d.ack(BasicAckOptions::default()).await?;
                    Ok(())
                });
            }
            Some(done) = in_flight.next() => {
                done?;
                settled += 1;
            }
        }
    }
    let took = meter.stop();
    ch.close(200, "done".into()).await?;
    publisher.close(200, "done".into()).await?;
    Ok(took)
}

/// The retry consumer on a transport of its own: consume `n`; `fail` makes every first run
/// fail, so every message is cloned to the delay queue.
async fn ours(
    policy: RetryPolicy,
    queue: &str,
    n: u64,
    prefetch: u16,
    fail: bool,
) -> Result<Measured, BoxError> {
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?);
    let settled = Arc::new(AtomicU64::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let (s, d) = (Arc::clone(&settled), Arc::clone(&done));
    let handler = move |m: Message| async move {
        if fail && m.attempt() == 1 {
            Err(HandlerError::transient("first run fails"))
        } else {
            Ok(())
        }
    };
    let consumer = Consumer::builder(Arc::clone(&transport), queue, policy, handler)
        .with_prefetch(prefetch)
        .with_provision(false)
        .with_on_terminal(move |_, _| {
            if s.fetch_add(1, Ordering::Relaxed) + 1 == n {
                d.notify_one();
            }
        })
        .build()?;
    let meter = Meter::start();
    // `run` returns once the last batched acks are written.
    let report = consumer.run(done.notified()).await?;
    let took = meter.stop();
    (*transport).close().await?;
    let expected = if fail { report.retried } else { report.handled };
    if expected != n || report.accounted() != n {
        return Err(format!("{n} messages, but the consumer reports {report:?}").into());
    }
    Ok(took)
}

/// The seed article's topology, declared as the Node.js peer declares it: the work queue, a
/// direct TTL exchange, and a TTL queue bound to it by [`SEED_KEY`] whose messages
/// dead-letter through the default exchange back to the work queue; queues durable and
/// expiring after 10 idle minutes (so that a crashed run leaves nothing for long), the
/// exchange durable. The TTL is the same 1 h as the engine's delay, so that no clone
/// comes back during a measurement.
struct SeedTopology {
    queue: String,
    exchange: String,
    delay_queue: String,
}

impl SeedTopology {
    /// The peer's names, after the work queue's.
    fn new(queue: &str) -> Self {
        SeedTopology {
            queue: queue.to_owned(),
            exchange: format!("{queue}-ttl"),
            delay_queue: format!("{queue}-retry-1-1h"),
        }
    }

    async fn declare(&self, conn: &Connection) -> Result<(), BoxError> {
        let ch = conn.create_channel().await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut expires = FieldTable::default();
        expires.insert("x-expires".into(), AMQPValue::LongInt(600_000));
        ch.queue_declare(self.queue.as_str().into(), durable, expires.clone())
            .await?;
        ch.exchange_declare(
            self.exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
        let mut delay = expires;
        let ttl = i64::try_from(DELAY.as_millis())?;
        delay.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
        delay.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        delay.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.queue.as_str().into()),
        );
        ch.queue_declare(self.delay_queue.as_str().into(), durable, delay)
            .await?;
        ch.queue_bind(
            self.delay_queue.as_str().into(),
            self.exchange.as_str().into(),
            SEED_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        ch.close(200, "declared".into()).await?;
        Ok(())
    }

    async fn delete(&self, conn: &Connection) -> Result<(), BoxError> {
        let ch = conn.create_channel().await?;
        for queue in [&self.queue, &self.delay_queue] {
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        ch.exchange_delete(self.exchange.as_str().into(), Default::default())
            .await?;
        ch.close(200, "deleted".into()).await?;
        Ok(())
    }
}

/// The queues of one measurement: the engine's plan, provisioned by a transport of its own
/// (boxed: a transport is large beside the seed's names), or the seed's topology.
enum Topology {
    Plan(Box<(AmqpTransport, TopologyPlan)>),
    Seed(SeedTopology),
}

impl Topology {
    async fn delete(self, conn: &Connection) -> Result<(), BoxError> {
        match self {
            Topology::Plan(provisioned) => {
                let (setup, plan) = *provisioned;
                setup.teardown(&plan).await?;
                setup.close().await?;
            }
            Topology::Seed(seed) => seed.delete(conn).await?,
        }
        Ok(())
    }
}

/// What one measurement runs: a path at a prefetch, with bodies of `body` bytes.
#[derive(Clone, Debug)]
struct Setting {
    path: String,
    prefetch: u16,
    body: usize,
}

/// One measurement of a setting on fresh queues.
async fn measure(
    conn: &Connection,
    setting: &Setting,
    round: usize,
    n: u64,
) -> Result<Measured, BoxError> {
    let Setting {
        path,
        prefetch,
        body,
    } = setting;
    let prefetch = *prefetch;
    // Setup (declaring, prefilling) comes after the broker is idle, as for the Node.js peer.
    wait_for_idle_broker().await;
    let policy = RetryPolicy::delays([DELAY]).build()?;
    let q = format!("bench-{}-{round}-{path}-p{prefetch}", std::process::id());
    let (topology, (exchange, delay_queue)) = if path == "lapin-seed" {
        let seed = SeedTopology::new(&q);
        seed.declare(conn).await?;
        let route = (seed.exchange.clone(), seed.delay_queue.clone());
        (Topology::Seed(seed), route)
    } else {
        let plan = TopologyPlan::new(&q, &policy)?;
        // The clone's route, as the engine picks it: the plan's retry exchange, keyed by the
        // delay queue's name.
        let (route, _) = plan.route_for(DELAY).ok_or("the plan has no delay level")?;
        let route = (route.exchange.to_string(), route.routing_key.to_string());
        let setup = AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?;
        setup.provision(&plan).await?;
        (Topology::Plan(Box::new((setup, plan))), route)
    };
    let result = async {
        let publisher = confirm_channel(conn).await?;
        let payload = vec![b'x'; *body];
        prefill(&publisher, &q, n, |_| (&payload, persistent())).await?;
        publisher.close(200, "prefilled".into()).await?;
        let route = (exchange.as_str(), delay_queue.as_str());
        let half_window = u64::from(prefetch / 2).max(1);
        let (took, retry) = match path.as_str() {
            "lapin-ack-each" => (lapin_consume(conn, &q, n, prefetch, 1).await?, false),
            "lapin-batched" => (
                lapin_consume(conn, &q, n, prefetch, half_window).await?,
                false,
            ),
            "ours-success" => (ours(policy.clone(), &q, n, prefetch, false).await?, false),
            "lapin-pipelined" => (
                lapin_retry(conn, &q, route, RetryClone::Pipelined, n, prefetch).await?,
                true,
            ),
            "lapin-seed" => (
                lapin_retry(conn, &q, (&exchange, SEED_KEY), RetryClone::Seed, n, prefetch).await?,
                true,
            ),
            "ours-retry" => (ours(policy.clone(), &q, n, prefetch, true).await?, true),
            other => return Err(format!("unknown path {other:?}; known: {PATHS:?}").into()),
        };
        // Nothing lost, nothing left: every delivery was settled, every clone arrived.
        let counting = conn.create_channel().await?;
        let left = message_count(&counting, &q).await?;
        let clones = message_count(&counting, &delay_queue).await?;
        counting.close(200, "counted".into()).await?;
        let want = if retry { n } else { 0 };
        if left != 0 || u64::from(clones) != want {
            return Err(format!(
                "{path}: {left} message(s) left in {q}, {clones} clone(s) in {delay_queue} (want 0 and {want})"
            )
            .into());
        }
        Ok::<_, BoxError>(took)
    }
    .await;
    topology.delete(conn).await?;
    result
}

/// One measurement: a round, a consumer and its setting, its rate, the load average when it
/// ended, the CPU time per message of the consumer's process and of the broker, and the
/// growth of the consumer process's resident memory (`NaN` if unknown or not measured).
#[derive(Clone, Debug)]
struct Sample {
    round: usize,
    path: String,
    n: u64,
    rate: f64,
    load: f64,
    client_us: f64,
    broker_us: f64,
    prefetch: u16,
    body: usize,
    rss_kib: f64,
}

impl Sample {
    /// `memory`: whether the growth of resident memory means anything, that is whether
    /// this measurement is the only one of its process (another's freed memory would be
    /// reused without showing).
    fn new(round: usize, setting: &Setting, n: u64, m: Measured, memory: bool) -> Self {
        let per_message = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
        let t = m.timing;
        Sample {
            round,
            path: setting.path.clone(),
            n,
            rate: n as f64 / t.wall.as_secs_f64(),
            load: load1().unwrap_or(f64::NAN),
            client_us: per_message(t.cpu.client.unwrap_or_default()),
            broker_us: t.cpu.broker.map_or(f64::NAN, per_message),
            prefetch: setting.prefetch,
            body: setting.body,
            rss_kib: match m.rss_growth {
                Some(bytes) if memory => bytes as f64 / 1024.0,
                _ => f64::NAN,
            },
        }
    }

    /// `round path n seconds msg/s load1 client-µs/msg broker-µs/msg prefetch body
    /// rss-growth-KiB`, tab-separated; unknown figures are `NaN`.
    fn tsv(&self) -> String {
        format!(
            "{}\t{}\t{}\t{:.4}\t{:.0}\t{:.2}\t{:.1}\t{:.1}\t{}\t{}\t{:.0}",
            self.round,
            self.path,
            self.n,
            self.n as f64 / self.rate,
            self.rate,
            self.load,
            self.client_us,
            self.broker_us,
            self.prefetch,
            self.body,
            self.rss_kib,
        )
    }
}

/// Reads `tsv` lines. Only the first six columns are needed: a missing or unparsable CPU or
/// memory figure is unknown, and lines from before `--prefetch` and `--body` (eight
/// columns) were measured at prefetch 100 with 256-byte bodies.
fn parse_tsv(text: &str) -> Result<Vec<Sample>, BoxError> {
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
    {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() < 6 {
            return Err(format!("not a result line: {line:?}").into());
        }
        let float = |i: usize| f.get(i).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
        out.push(Sample {
            round: f[0].parse()?,
            path: f[1].to_owned(),
            n: f[2].parse()?,
            rate: f[4].parse()?,
            load: float(5),
            client_us: float(6),
            broker_us: float(7),
            prefetch: f.get(8).map_or(Ok(PREFETCH), |v| v.parse())?,
            body: f.get(9).map_or(Ok(BODY), |v| v.parse())?,
            rss_kib: float(10),
        });
    }
    Ok(out)
}

/// A consumer in the table: its path and its label.
type Row = (&'static str, &'static str);

/// What the table shows: per section, its title, its short name, our consumer, and the
/// baselines it is compared to.
const SECTIONS: [(&str, &str, &str, &[Row]); 2] = [
    (
        "success path (consume + ack)",
        "success",
        "ours-success",
        &[
            ("lapin-batched", "lapin batched (ceiling)"),
            ("lapin-ack-each", "lapin ack-each"),
            ("node-ack", "node peer"),
        ],
    ),
    (
        "retry path (clone, confirm, then ack)",
        "retry",
        "ours-retry",
        &[
            ("lapin-pipelined", "lapin pipelined"),
            ("lapin-seed", "lapin seed"),
            ("node-retry", "node peer (seed)"),
        ],
    ),
];

/// What the labels of [`SECTIONS`] stand for, printed above the table.
const LEGEND: &str = "\
lapin batched (ceiling): plain lapin, one `multiple` ack per half prefetch window
lapin ack-each:          plain lapin, one basic.ack per delivery
lapin pipelined:         plain lapin, clone to the engine's delay queue (no headers), confirm, ack; up to prefetch at once
lapin seed:              plain lapin doing the seed article's work as the node peer does, pipelined like the above
node peer (seed):        the seed article's consumer on Node.js amqplib (its `retry` mode)
ours:                    the retry consumer of this crate
";

const LABEL: usize = 46;

/// A figure of a ratio row, for the summary: its label, and min, median and max over the
/// rounds.
type Ratio = (String, (f64, f64, f64));

/// The table: an overview, then per body size and prefetch one block (see [`block`]), then,
/// if there are several, the ratios' medians side by side.
fn table(samples: &[Sample]) -> String {
    let mut out = String::new();
    let mut groups: BTreeMap<(usize, u16), Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        groups.entry((s.body, s.prefetch)).or_default().push(s);
    }
    let rounds: BTreeSet<usize> = samples.iter().map(|s| s.round).collect();
    let n = samples.first().map_or(0, |s| s.n);
    let prefetches: BTreeSet<u16> = samples.iter().map(|s| s.prefetch).collect();
    let _ = writeln!(
        out,
        "{n} persistent messages, durable queues, prefetch {}, {} interleaved round(s)",
        prefetches
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        rounds.len()
    );
    let loads: Vec<f64> = samples
        .iter()
        .map(|s| s.load)
        .filter(|l| !l.is_nan())
        .collect();
    if !loads.is_empty() {
        let (lo, _, hi) = min_median_max(loads);
        let _ = writeln!(
            out,
            "load average (1 min) during the run: {lo:.2} to {hi:.2}"
        );
    }
    out.push('\n');
    out.push_str(LEGEND);
    let mut summary: Vec<((usize, u16), Vec<Ratio>)> = Vec::new();
    for (&(body, prefetch), group) in &groups {
        let _ = writeln!(out, "\n=== prefetch {prefetch}, {body}-byte bodies ===");
        let (text, ratios) = block(group);
        out.push_str(&text);
        summary.push(((body, prefetch), ratios));
    }
    if summary.len() > 1 {
        out.push_str(&overview(&summary));
    }
    out
}

/// The ratios of every block side by side: median (min-max) per body size and prefetch.
fn overview(summary: &[((usize, u16), Vec<Ratio>)]) -> String {
    const CELL: usize = 18;
    const LABEL: usize = 54;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n=== ratios by prefetch, median (min-max) over the rounds ==="
    );
    let _ = write!(out, "{:<LABEL$}", "");
    for ((body, prefetch), _) in summary {
        let _ = write!(out, "{:>CELL$}", format!("p{prefetch} {body}B"));
    }
    out.push('\n');
    let mut labels: Vec<&str> = Vec::new();
    for (_, ratios) in summary {
        for (label, _) in ratios {
            if !labels.contains(&label.as_str()) {
                labels.push(label);
            }
        }
    }
    for label in labels {
        let _ = write!(out, "{label:<LABEL$}");
        for (_, ratios) in summary {
            let cell = ratios.iter().find(|(l, _)| l == label).map_or_else(
                || "-".to_owned(),
                |(_, (lo, mid, hi))| format!("{mid:.2} ({lo:.2}-{hi:.2})"),
            );
            let _ = write!(out, "{cell:>CELL$}");
        }
        out.push('\n');
    }
    out
}

/// One body size and prefetch: per section a rate per consumer and round, then ratios of
/// ours to each baseline round by round, then CPU time per message and its ratios, then
/// the growth of resident memory and its ratios where measured. Returns the text and the
/// ratio rows' min, median and max.
fn block(samples: &[&Sample]) -> (String, Vec<Ratio>) {
    let mut by: BTreeMap<(&str, usize), &Sample> = BTreeMap::new();
    let rounds: Vec<usize> = samples
        .iter()
        .map(|s| s.round)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    for s in samples {
        by.insert((s.path.as_str(), s.round), s);
    }
    let series = |path: &str, f: fn(&Sample) -> f64| -> Vec<Option<f64>> {
        rounds
            .iter()
            .map(|r| by.get(&(path, *r)).map(|s| f(s)).filter(|v| !v.is_nan()))
            .collect()
    };
    let known = |path: &str, f: fn(&Sample) -> f64| series(path, f).iter().any(Option::is_some);
    let present = |path: &str| rounds.iter().any(|r| by.contains_key(&(path, *r)));

    let mut out = String::new();
    let mut ratios: Vec<Ratio> = Vec::new();
    let mut header = format!("{:<LABEL$}", "");
    for r in &rounds {
        let _ = write!(header, "{:>9}", format!("round {r}"));
    }
    let _ = write!(header, "{:>9}{:>9}{:>9}", "min", "median", "max");
    let row = |out: &mut String, label: &str, values: &[Option<f64>], unit: &str| {
        let _ = write!(out, "{label:<LABEL$}");
        let fmt = |v: f64| match unit {
            "x" => format!("{v:.2}x"),
            "us" => format!("{v:.1}"),
            _ => format!("{v:.0}"),
        };
        for v in values {
            let _ = write!(out, "{:>9}", v.map_or("-".into(), fmt));
        }
        let known: Vec<f64> = values.iter().flatten().copied().collect();
        let summary = (!known.is_empty()).then(|| min_median_max(known));
        if let Some((lo, mid, hi)) = summary {
            let _ = write!(out, "{:>9}{:>9}{:>9}", fmt(lo), fmt(mid), fmt(hi));
        }
        out.push('\n');
        summary
    };
    // Ours over a baseline, round by round, as a row; kept for the overview under the
    // section's name. A ratio to 0 (CPU time under a clock tick) is unknown.
    let mut ratio_row = |out: &mut String,
                         (section, ours, base): (&str, &str, &str),
                         label: String,
                         f: fn(&Sample) -> f64| {
        let values: Vec<Option<f64>> = series(ours, f)
            .into_iter()
            .zip(series(base, f))
            .map(|(a, b)| Some(a? / b?).filter(|r| r.is_finite()))
            .collect();
        if let Some(summary) = row(out, &label, &values, "x") {
            ratios.push((format!("{section}: {}", label.trim()), summary));
        }
    };

    for (title, section, ours, baselines) in SECTIONS {
        let shown: Vec<(&str, &str)> = baselines
            .iter()
            .copied()
            .chain([(ours, "ours")])
            .filter(|(p, _)| present(p))
            .collect();
        if shown.is_empty() {
            continue;
        }
        let _ = writeln!(out, "\n{title}, msg/s");
        let _ = writeln!(out, "{header}");
        for (path, label) in &shown {
            row(
                &mut out,
                &format!("  {label}"),
                &series(path, |s| s.rate),
                "",
            );
        }
        let compared: Vec<&Row> = baselines
            .iter()
            .filter(|(p, _)| present(ours) && present(p))
            .collect();
        for (path, label) in &compared {
            let label = format!("  ours / {label}, msg/s");
            ratio_row(&mut out, (section, ours, path), label, |s| s.rate);
        }
        if shown.iter().any(|(p, _)| known(p, |s| s.client_us)) {
            let _ = writeln!(
                out,
                "  CPU time per message, µs (consumer process / broker)"
            );
            for (path, label) in shown.iter().filter(|(p, _)| known(p, |s| s.client_us)) {
                row(
                    &mut out,
                    &format!("    {label}"),
                    &series(path, |s| s.client_us),
                    "us",
                );
                row(
                    &mut out,
                    "      broker",
                    &series(path, |s| s.broker_us),
                    "us",
                );
            }
            for (path, label) in &compared {
                for (what, f) in [
                    ("client", (|s| s.client_us) as fn(&Sample) -> f64),
                    ("broker", |s| s.broker_us),
                ] {
                    if known(ours, f) && known(path, f) {
                        let label = format!("  ours / {label}, {what} CPU");
                        ratio_row(&mut out, (section, ours, path), label, f);
                    }
                }
            }
        }
        if shown.iter().any(|(p, _)| known(p, |s| s.rss_kib)) {
            let _ = writeln!(
                out,
                "  resident memory growth while consuming, KiB (peak - start)"
            );
            for (path, label) in shown.iter().filter(|(p, _)| known(p, |s| s.rss_kib)) {
                row(
                    &mut out,
                    &format!("    {label}"),
                    &series(path, |s| s.rss_kib),
                    "",
                );
            }
            for (path, label) in &compared {
                if known(ours, |s| s.rss_kib) && known(path, |s| s.rss_kib) {
                    let label = format!("  ours / {label}, memory");
                    ratio_row(&mut out, (section, ours, path), label, |s| s.rss_kib);
                }
            }
        }
    }
    (out, ratios)
}

/// Draws msg/s against prefetch, a panel per section of [`SECTIONS`], as an SVG at `file`:
/// per consumer a line through the medians and a bar from min to max. Of several body sizes,
/// the one measured at the most prefetches is drawn (the others are memory runs).
fn plot(samples: &[Sample], file: &str) -> Result<(), BoxError> {
    let mut prefetches: BTreeMap<usize, BTreeSet<u16>> = BTreeMap::new();
    for s in samples {
        prefetches.entry(s.body).or_default().insert(s.prefetch);
    }
    let body = prefetches
        .iter()
        .max_by_key(|(body, p)| (p.len(), std::cmp::Reverse(**body)))
        .map(|(body, _)| *body)
        .ok_or("no results to plot")?;
    let rounds = samples
        .iter()
        .map(|s| s.round)
        .collect::<BTreeSet<_>>()
        .len();
    let n = samples.first().map_or(0, |s| s.n);
    let panels: Vec<Panel> = SECTIONS
        .iter()
        .map(|(title, _, ours, baselines)| Panel {
            caption: (*title).to_owned(),
            series: baselines
                .iter()
                .copied()
                .chain([(*ours, "ours")])
                .map(|(path, label)| Series {
                    label: label.to_owned(),
                    points: prefetches[&body]
                        .iter()
                        .filter_map(|&p| {
                            let rates: Vec<f64> = samples
                                .iter()
                                .filter(|s| s.path == path && s.body == body && s.prefetch == p)
                                .map(|s| s.rate)
                                .collect();
                            (!rates.is_empty()).then(|| {
                                let (lo, mid, hi) = min_median_max(rates);
                                (f64::from(p), lo, mid, hi)
                            })
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect();
    let title = format!(
        "msg/s by prefetch: {n} persistent {body}-byte messages, {rounds} round(s); line: median, bars: min to max"
    );
    log_x_panels(file.as_ref(), &title, "prefetch (log)", "msg/s", &panels)?;
    Ok(())
}

struct Args {
    n: u64,
    rounds: usize,
    round: Option<usize>,
    paths: Vec<String>,
    prefetch: Vec<u16>,
    body: usize,
    tsv: bool,
    report: Option<String>,
    plot: Option<String>,
}

const USAGE: &str = "usage: throughput [N] [--n N] [--rounds R] [--round R] [--paths P,P,..] \
                     [--prefetch P,P,..] [--body BYTES] [--tsv] [--report FILE] [--plot FILE.svg]";

fn args() -> Result<Args, BoxError> {
    let mut a = Args {
        n: 20_000,
        rounds: env_or("ROUNDS", 3)?,
        round: None,
        paths: PATHS.iter().map(|p| (*p).to_owned()).collect(),
        prefetch: vec![PREFETCH],
        body: BODY,
        tsv: false,
        report: None,
        plot: None,
    };
    let mut argv = bench_support::args::Args::new(USAGE);
    while let Some(arg) = argv.next() {
        match arg.as_str() {
            "--n" => a.n = argv.value(&arg)?,
            "--rounds" => a.rounds = argv.value(&arg)?,
            "--round" => a.round = Some(argv.value(&arg)?),
            "--paths" => {
                a.paths = argv
                    .value::<String>(&arg)?
                    .split(',')
                    .map(str::to_owned)
                    .collect();
            }
            "--prefetch" => {
                a.prefetch = argv
                    .value::<String>(&arg)?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?;
            }
            "--body" => a.body = argv.value(&arg)?,
            "--tsv" => a.tsv = true,
            "--report" => a.report = Some(argv.value(&arg)?),
            "--plot" => a.plot = Some(argv.value(&arg)?),
            n if n.parse::<u64>().is_ok() => a.n = n.parse()?,
            other => return Err(argv.unknown(other)),
        }
    }
    if let Some(unknown) = a.paths.iter().find(|p| !PATHS.contains(&p.as_str())) {
        return Err(format!("unknown path {unknown:?}; known: {}", PATHS.join(",")).into());
    }
    if a.rounds == 0 || a.n == 0 || a.round == Some(0) {
        return Err(format!("N, the rounds and the round number start at 1; {USAGE}").into());
    }
    if a.prefetch.contains(&0) {
        return Err(format!("a prefetch of 0 is unlimited, not a window; {USAGE}").into());
    }
    if a.tsv && a.plot.is_some() {
        return Err(format!("--plot draws a table's results, not --tsv lines; {USAGE}").into());
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = args()?;
    if let Some(file) = &args.report {
        let samples = parse_tsv(&std::fs::read_to_string(file)?)?;
        print!("{}", table(&samples));
        if let Some(svg) = &args.plot {
            plot(&samples, svg)?;
        }
        return Ok(());
    }
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let rounds: Vec<usize> = match args.round {
        Some(r) => vec![r],
        None => (1..=args.rounds).collect(),
    };
    let settings: Vec<Setting> = args
        .prefetch
        .iter()
        .flat_map(|&prefetch| {
            args.paths.iter().map(move |path| Setting {
                path: path.clone(),
                prefetch,
                body: args.body,
            })
        })
        .collect();
    // Memory growth means something only in a process of one measurement.
    let memory = settings.len() == 1 && rounds.len() == 1;
    let mut samples = Vec::new();
    for &round in &rounds {
        // Rotate the order each round, so no path always runs first.
        let k = settings.len();
        for i in 0..k {
            let setting = &settings[(i + round - 1) % k];
            let measured = measure(&conn, setting, round, args.n).await?;
            let sample = Sample::new(round, setting, args.n, measured, memory);
            if args.tsv {
                println!("{}", sample.tsv());
            } else {
                eprintln!(
                    "round {round}: {:<16} prefetch {:<5} {:>8.0} msg/s (load {:.2})",
                    setting.path, setting.prefetch, sample.rate, sample.load
                );
            }
            samples.push(sample);
        }
    }
    conn.close(200, "done".into()).await?;
    if !args.tsv {
        print!("\n{}", table(&samples));
        if let Some(svg) = &args.plot {
            plot(&samples, svg)?;
        }
    }
    Ok(())
}
