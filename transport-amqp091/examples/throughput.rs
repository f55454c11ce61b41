//! Throughput against the local RabbitMQ: this crate's consumer beside the strongest plain
//! lapin loops, measured in the same run, on the same broker, under the same durability.
//!
//! ```sh
//! cargo run --release -p transport-amqp091 --example throughput              # every path, 3 rounds
//! cargo run --release -p transport-amqp091 --example throughput -- --n 5000 --rounds 5
//! ```
//!
//! Every measurement waits for the broker to be idle (200 ms under 5% of a core, at most
//! 5 s), then gets queues of its own (a topology plan named `bench-<pid>-<round>-<path>`:
//! durable classic queues, the delay queue with a 1 h TTL), prefilled with N persistent
//! 256-byte messages, consumed with prefetch 100, checked (the work queue is empty once its
//! consumer is gone; on the retry path the delay queue holds exactly N clones) and deleted.
//! The clock runs from just before consuming starts until the last settlement is written
//! (for the retry consumer: until `run` returns, which includes sending the last batched
//! acks). Besides msg/s, each measurement reports the CPU time per message of this process
//! and of the broker (when it runs on this machine), from `/proc`.
//!
//! Paths (`--paths`, comma-separated; default all, in this order):
//!
//! | path | what runs |
//! |---|---|
//! | `lapin-ack-each` | success path: plain lapin, one `basic.ack` per delivery |
//! | `lapin-batched` | success path: plain lapin, one `multiple` ack per half prefetch window (the ceiling) |
//! | `ours-success` | success path: the retry consumer with a handler that succeeds |
//! | `lapin-pipelined` | retry path: plain lapin, per delivery publish the clone on a confirm channel of its own (to the same delay queue, by the same route, but without the engine's headers), await its confirm, then ack; up to prefetch deliveries at once |
//! | `ours-retry` | retry path: the retry consumer with a handler that fails the first run; the clone goes to the delay queue |
//!
//! A plain one-message-at-a-time publish-confirm-ack loop is not a baseline (it measures one
//! round trip per message) and is not offered.
//!
//! Rounds are interleaved (every path once per round, the order rotated each round) and the
//! table shows each round, then min, median and max, and the ratios of our consumer to each
//! baseline *in the same round*.
//!
//! Other modes, for `bench/vs-node.sh`, which interleaves a Node.js peer with these paths:
//!
//! * `--tsv --round R --paths P`: measure round R only (R also picks the rotation), print
//!   one line per path: `round path n seconds msg/s load1 client-µs/msg broker-µs/msg`,
//!   tab-separated.
//! * `--report FILE`: print the table from such lines; `node-ack` and `node-retry` lines
//!   (the CPU columns may be left out) are shown as the Node.js peer.
//!
//! `AMQP_URL` picks the broker.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bench_support::BoxError;
use bench_support::args::env_or;
use bench_support::proc::{Clock, Timing, load1, wait_for_idle_broker};
use bench_support::publish::{confirm_channel, persistent, prefill};
use bench_support::queue::message_count;
use bench_support::stats::min_median_max;
use bench_support::url::amqp_url;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Confirmation, Connection, ConnectionProperties};
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, TopologyPlan, Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const PREFETCH: u16 = 100;
const BODY: [u8; 256] = [b'x'; 256];
const DELAY: Duration = Duration::from_secs(3600);

/// The paths this example measures, in their default order.
const PATHS: [&str; 5] = [
    "lapin-ack-each",
    "lapin-batched",
    "ours-success",
    "lapin-pipelined",
    "ours-retry",
];

/// Plain lapin, success path: consume `n` and ack each, or every `batch`-th with `multiple`.
async fn lapin_consume(
    conn: &Connection,
    queue: &str,
    n: u64,
    batch: u64,
) -> Result<Timing, BoxError> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let clock = Clock::start();
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
    let took = clock.stop();
    ch.close(200, "done".into()).await?;
    Ok(took)
}

/// Plain lapin, retry path, as a careful user writes it: deliveries on one channel, clones
/// on a confirm channel of their own; per delivery, publish the clone, await its confirm,
/// then ack the original. Every delivery the prefetch lets in is in flight at once.
async fn lapin_pipelined(
    conn: &Connection,
    queue: &str,
    (exchange, routing_key): (&str, &str),
    n: u64,
) -> Result<Timing, BoxError> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let publisher = confirm_channel(conn).await?;
    let clock = Clock::start();
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
                    let confirm = publisher
                        .basic_publish(
                            exchange.into(),
                            routing_key.into(),
                            BasicPublishOptions { mandatory: true, immediate: false },
                            &d.data,
                            d.properties.clone(),
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
    let took = clock.stop();
    ch.close(200, "done".into()).await?;
    publisher.close(200, "done".into()).await?;
    Ok(took)
}

/// The retry consumer on a transport of its own: consume `n`; `fail` makes every first run
/// fail, so every message is cloned to the delay queue.
async fn ours(policy: RetryPolicy, queue: &str, n: u64, fail: bool) -> Result<Timing, BoxError> {
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
        .with_prefetch(PREFETCH)
        .with_provision(false)
        .with_on_terminal(move |_, _| {
            if s.fetch_add(1, Ordering::Relaxed) + 1 == n {
                d.notify_one();
            }
        })
        .build()?;
    let clock = Clock::start();
    // `run` returns once the last batched acks are written.
    let report = consumer.run(done.notified()).await?;
    let took = clock.stop();
    transport.close().await?;
    let expected = if fail { report.retried } else { report.handled };
    if expected != n || report.accounted() != n {
        return Err(format!("{n} messages, but the consumer reports {report:?}").into());
    }
    Ok(took)
}

/// One measurement of `path` on fresh queues.
async fn measure(conn: &Connection, path: &str, round: usize, n: u64) -> Result<Timing, BoxError> {
    // Setup (declaring, prefilling) comes after the broker is idle, as for the Node.js peer.
    wait_for_idle_broker().await;
    let policy = RetryPolicy::delays([DELAY]).build()?;
    let q = format!("bench-{}-{round}-{path}", std::process::id());
    let plan = TopologyPlan::new(&q, &policy)?;
    // The clone's route, as the engine picks it: the plan's retry exchange, keyed by the
    // delay queue's name.
    let (route, _) = plan.route_for(DELAY).ok_or("the plan has no delay level")?;
    let (exchange, delay_queue) = (route.exchange.to_string(), route.routing_key.to_string());
    let setup = AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?;
    setup.provision(&plan).await?;
    let result = async {
        let publisher = confirm_channel(conn).await?;
        prefill(&publisher, &q, n, |_| (BODY, persistent())).await?;
        publisher.close(200, "prefilled".into()).await?;
        let (took, retry) = match path {
            "lapin-ack-each" => (lapin_consume(conn, &q, n, 1).await?, false),
            "lapin-batched" => (
                lapin_consume(conn, &q, n, u64::from(PREFETCH / 2)).await?,
                false,
            ),
            "ours-success" => (ours(policy.clone(), &q, n, false).await?, false),
            "lapin-pipelined" => (
                lapin_pipelined(conn, &q, (&exchange, &delay_queue), n).await?,
                true,
            ),
            "ours-retry" => (ours(policy.clone(), &q, n, true).await?, true),
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
    setup.teardown(&plan).await?;
    setup.close().await?;
    result
}

/// One measurement: a round, a consumer, its rate, the load average when it ended, and the
/// CPU time per message of the consumer's process and of the broker (`NaN` if unknown).
#[derive(Clone, Debug)]
struct Sample {
    round: usize,
    path: String,
    n: u64,
    rate: f64,
    load: f64,
    client_us: f64,
    broker_us: f64,
}

impl Sample {
    fn new(round: usize, path: &str, n: u64, t: Timing) -> Self {
        let per_message = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
        Sample {
            round,
            path: path.to_owned(),
            n,
            rate: n as f64 / t.wall.as_secs_f64(),
            load: load1().unwrap_or(f64::NAN),
            client_us: per_message(t.cpu.client.unwrap_or_default()),
            broker_us: t.cpu.broker.map_or(f64::NAN, per_message),
        }
    }

    /// `round path n seconds msg/s load1 client-µs/msg broker-µs/msg`, tab-separated.
    fn tsv(&self) -> String {
        format!(
            "{}\t{}\t{}\t{:.4}\t{:.0}\t{:.2}\t{:.1}\t{:.1}",
            self.round,
            self.path,
            self.n,
            self.n as f64 / self.rate,
            self.rate,
            self.load,
            self.client_us,
            self.broker_us
        )
    }
}

/// Reads `tsv` lines; the two CPU columns are optional (a peer may not know them).
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
        });
    }
    Ok(out)
}

/// A consumer in the table: its path and its label.
type Row = (&'static str, &'static str);

/// What the table shows: per section, its title, our consumer, and the baselines it is
/// compared to.
const SECTIONS: [(&str, &str, &[Row]); 2] = [
    (
        "success path (consume + ack)",
        "ours-success",
        &[
            ("lapin-batched", "lapin, multiple ack/50 (ceiling)"),
            ("lapin-ack-each", "lapin, ack each"),
            ("node-ack", "Node.js amqplib peer"),
        ],
    ),
    (
        "retry path (clone, confirm, then ack)",
        "ours-retry",
        &[
            ("lapin-pipelined", "lapin, pipelined to prefetch"),
            ("node-retry", "Node.js amqplib peer"),
        ],
    ),
];

const LABEL: usize = 36;

/// The table: per consumer a rate per round, then ratios of ours to each baseline, round by
/// round, then CPU time per message.
fn table(samples: &[Sample]) -> String {
    let mut by: BTreeMap<(&str, usize), &Sample> = BTreeMap::new();
    let mut rounds: Vec<usize> = samples.iter().map(|s| s.round).collect();
    rounds.sort_unstable();
    rounds.dedup();
    for s in samples {
        by.insert((s.path.as_str(), s.round), s);
    }
    let series = |path: &str, f: fn(&Sample) -> f64| -> Vec<Option<f64>> {
        rounds
            .iter()
            .map(|r| by.get(&(path, *r)).map(|s| f(s)).filter(|v| !v.is_nan()))
            .collect()
    };
    let present = |path: &str| rounds.iter().any(|r| by.contains_key(&(path, *r)));

    let mut out = String::new();
    let n = samples.first().map_or(0, |s| s.n);
    let _ = writeln!(
        out,
        "{n} persistent 256-byte messages, durable queues, prefetch {PREFETCH}, {} interleaved round(s)",
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
        if !known.is_empty() {
            let (lo, mid, hi) = min_median_max(known);
            let _ = write!(out, "{:>9}{:>9}{:>9}", fmt(lo), fmt(mid), fmt(hi));
        }
        out.push('\n');
    };

    for (title, ours, baselines) in SECTIONS {
        let shown: Vec<(&str, &str)> = baselines
            .iter()
            .copied()
            .chain([(ours, "retry consumer (ours)")])
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
        if present(ours) {
            for (path, label) in baselines.iter().filter(|(p, _)| present(p)) {
                let ratios: Vec<Option<f64>> = series(ours, |s| s.rate)
                    .into_iter()
                    .zip(series(path, |s| s.rate))
                    .map(|(a, b)| Some(a? / b?))
                    .collect();
                row(&mut out, &format!("  ours / {label}"), &ratios, "x");
            }
        }
        let cpu: Vec<_> = shown
            .iter()
            .filter(|(p, _)| series(p, |s| s.client_us).iter().any(Option::is_some))
            .collect();
        if !cpu.is_empty() {
            let _ = writeln!(
                out,
                "  CPU time per message, µs (consumer process / broker)"
            );
            for (path, label) in cpu {
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
        }
    }
    out
}

struct Args {
    n: u64,
    rounds: usize,
    round: Option<usize>,
    paths: Vec<String>,
    tsv: bool,
    report: Option<String>,
}

const USAGE: &str = "usage: throughput [N] [--n N] [--rounds R] [--round R] [--paths P,P,..] [--tsv] [--report FILE]";

fn args() -> Result<Args, BoxError> {
    let mut a = Args {
        n: 20_000,
        rounds: env_or("ROUNDS", 3)?,
        round: None,
        paths: PATHS.iter().map(|p| (*p).to_owned()).collect(),
        tsv: false,
        report: None,
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
            "--tsv" => a.tsv = true,
            "--report" => a.report = Some(argv.value(&arg)?),
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
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = args()?;
    if let Some(file) = &args.report {
        print!("{}", table(&parse_tsv(&std::fs::read_to_string(file)?)?));
        return Ok(());
    }
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let rounds: Vec<usize> = match args.round {
        Some(r) => vec![r],
        None => (1..=args.rounds).collect(),
    };
    let mut samples = Vec::new();
    for &round in &rounds {
        // Rotate the order each round, so no path always runs first.
        let k = args.paths.len();
        for i in 0..k {
            let path = &args.paths[(i + round - 1) % k];
            let sample = Sample::new(
                round,
                path,
                args.n,
                measure(&conn, path, round, args.n).await?,
            );
            if args.tsv {
                println!("{}", sample.tsv());
            } else {
                eprintln!(
                    "round {round}: {path:<16} {:>8.0} msg/s (load {:.2})",
                    sample.rate, sample.load
                );
            }
            samples.push(sample);
        }
    }
    conn.close(200, "done".into()).await?;
    if !args.tsv {
        print!("\n{}", table(&samples));
    }
    Ok(())
}
