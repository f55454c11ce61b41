//! How late a delayed retry comes back, through this crate's consumer and through the
//! broker alone, measured in the same run.
//!
//! ```sh
//! cargo run --release -p transport-amqp091 --example lateness                 # 2000 at 500/s, 3 rounds
//! cargo run --release -p transport-amqp091 --example lateness -- --n 500 --rate 250 --rounds 1
//! ```
//!
//! Every message fails its first run and is retried once through a 1 s delay level; its
//! lateness is `second run - first failure - 1 s`. Messages are published at a steady rate
//! (default 2,000 at 500 msg/s, persistent, into durable queues) by a publisher of their own
//! while the consumer runs, with prefetch 100.
//!
//! * `plain`: the broker's floor. A plain lapin consumer; on the first delivery it notes the
//!   time, publishes a copy (publisher confirms) into a queue with a 1 s `x-message-ttl`
//!   that dead-letters back into the work queue, then acks. The copy's second delivery ends
//!   the measurement.
//! * `ours`: the retry consumer, with a handler that fails the first run (noting the time)
//!   and succeeds the second; the engine's plan has one delay level, 1 s.
//!
//! The two run one after the other in each round, the order alternating; the table shows
//! p50, p99 and max per round and over all rounds, and ours minus plain. Each round uses
//! queues of its own and deletes them. `AMQP_URL` picks the broker.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bench_support::BoxError;
use bench_support::args::Args;
use bench_support::proc::load1_shown;
use bench_support::publish::{confirm_channel, publish_paced};
use bench_support::stats::percentiles;
use bench_support::url::amqp_url;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, TopologyPlan, Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const PREFETCH: u16 = 100;
const DELAY: Duration = Duration::from_secs(1);
const BODY: [u8; 256] = [b'x'; 256];
/// The header the plain consumer marks its copies with.
const RETRIED: &str = "x-bench-retried";

/// First-failure times by message id, and the lateness of each second run.
#[derive(Default)]
struct Clock {
    first: HashMap<String, Instant>,
    late: Vec<Duration>,
    early: u64,
}

impl Clock {
    fn failed(&mut self, id: &str) {
        self.first.insert(id.to_owned(), Instant::now());
    }

    /// A second run of `id`: how late it is. A copy that comes back before its delay is
    /// counted apart (it should never happen).
    fn returned(&mut self, id: &str) {
        let Some(first) = self.first.remove(id) else {
            return;
        };
        match first.elapsed().checked_sub(DELAY) {
            Some(late) => self.late.push(late),
            None => self.early += 1,
        }
    }
}

async fn declare(ch: &Channel, name: &str, arguments: FieldTable) -> Result<(), BoxError> {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        arguments,
    )
    .await?;
    Ok(())
}

/// The broker's floor: a plain lapin consumer and a 1 s TTL queue dead-lettering back.
async fn plain(conn: &Connection, tag: &str, n: u64, rate: f64) -> Result<Clock, BoxError> {
    let (work, delay) = (format!("late-{tag}-plain"), format!("late-{tag}-plain.1s"));
    let setup = conn.create_channel().await?;
    declare(&setup, &work, FieldTable::default()).await?;
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(1000));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(work.as_str().into()),
    );
    declare(&setup, &delay, args).await?;

    let result = async {
        let ch = conn.create_channel().await?;
        ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
        let publisher = confirm_channel(conn).await?;
        let mut consumer = ch
            .basic_consume(
                work.as_str().into(),
                "late-plain".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let clock = Arc::new(Mutex::new(Clock::default()));
        let feed = publish_paced(conn, &work, 0..n, &BODY, rate);
        let consume = async {
            let mut in_flight = FuturesUnordered::new();
            let mut second_runs = 0;
            while second_runs < n {
                tokio::select! {
                    d = consumer.next() => {
                        let d = d.ok_or("the consumer ended early")??;
                        let id = d
                            .properties
                            .message_id()
                            .as_ref()
                            .map(|s| s.as_str().to_owned())
                            .unwrap_or_default();
                        let retried = d
                            .properties
                            .headers()
                            .as_ref()
                            .is_some_and(|h| h.inner().contains_key(RETRIED));
                        if retried {
                            clock.lock().unwrap().returned(&id);
                            second_runs += 1;
                            d.ack(BasicAckOptions::default()).await?;
                            continue;
                        }
                        clock.lock().unwrap().failed(&id);
                        let publisher = publisher.clone();
                        let delay = delay.clone();
                        in_flight.push(async move {
                            let mut headers = d.properties.headers().clone().unwrap_or_default();
                            headers.insert(ShortString::from(RETRIED), AMQPValue::Boolean(true));
                            let confirm = publisher
                                .basic_publish(
                                    "".into(),
                                    delay.into(),
                                    BasicPublishOptions { mandatory: true, immediate: false },
                                    &d.data,
                                    d.properties.clone().with_headers(headers),
                                )
                                .await?
                                .await?;
                            if !matches!(confirm, Confirmation::Ack(None)) {
                                return Err(BoxError::from(format!("copy not confirmed: {confirm:?}")));
                            }
                            d.ack(BasicAckOptions::default()).await?;
                            Ok(())
                        });
                    }
                    Some(done) = in_flight.next() => done?,
                }
            }
            while let Some(done) = in_flight.next().await {
                done?;
            }
            Ok::<_, BoxError>(())
        };
        let (fed, consumed) = tokio::join!(feed, consume);
        fed?;
        consumed?;
        ch.close(200, "done".into()).await?;
        publisher.close(200, "done".into()).await?;
        let clock = std::mem::take(&mut *clock.lock().unwrap());
        Ok::<_, BoxError>(clock)
    }
    .await;
    for q in [&work, &delay] {
        setup
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    setup.close(200, "deleted".into()).await?;
    result
}

/// The retry consumer, with one 1 s delay level.
async fn ours(conn: &Connection, tag: &str, n: u64, rate: f64) -> Result<Clock, BoxError> {
    let work = format!("late-{tag}-ours");
    let policy = RetryPolicy::delays([DELAY]).build()?;
    let plan = TopologyPlan::new(&work, &policy)?;
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?);
    transport.provision(&plan).await?;

    let result = async {
        let clock = Arc::new(Mutex::new(Clock::default()));
        let second_runs = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let clock = Arc::clone(&clock);
            move |m: Message| {
                let id = m.properties().message_id.clone().unwrap_or_default();
                let result = if m.attempt() == 1 {
                    clock.lock().unwrap().failed(&id);
                    Err(HandlerError::transient("the first run fails"))
                } else {
                    clock.lock().unwrap().returned(&id);
                    Ok(())
                };
                async move { result }
            }
        };
        let (count, notify) = (Arc::clone(&second_runs), Arc::clone(&done));
        let consumer = Consumer::builder(Arc::clone(&transport), &work, policy, handler)
            .with_prefetch(PREFETCH)
            .with_provision(false)
            .with_on_terminal(move |_, t| {
                if matches!(t, retry_core::Terminal::Handled { .. })
                    && count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1 == n
                {
                    notify.notify_one();
                }
            })
            .build()?;
        let feed = publish_paced(conn, &work, 0..n, &BODY, rate);
        let (fed, report) = tokio::join!(feed, consumer.run(done.notified()));
        fed?;
        let report = report?;
        if report.handled != n || report.retried != n {
            return Err(format!("{n} messages, but the consumer reports {report:?}").into());
        }
        let clock = std::mem::take(&mut *clock.lock().unwrap());
        Ok::<_, BoxError>(clock)
    }
    .await;
    transport.teardown(&plan).await?;
    (*transport).close().await?;
    result
}

/// Durations in milliseconds.
fn ms(late: &[Duration]) -> Vec<f64> {
    late.iter().map(|d| d.as_secs_f64() * 1e3).collect()
}

fn row(out: &mut String, label: &str, (p50, p99, max): (f64, f64, f64)) {
    let _ = writeln!(out, "  {label:<34}{p50:>9.1}{p99:>9.1}{max:>9.1}");
}

fn diff(a: (f64, f64, f64), b: (f64, f64, f64)) -> (f64, f64, f64) {
    (a.0 - b.0, a.1 - b.1, a.2 - b.2)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (mut n, mut rate, mut rounds) = (2_000u64, 500.0f64, 3usize);
    let mut args = Args::new("usage: lateness [--n N] [--rate R] [--rounds R]");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--n" => n = args.value(&arg)?,
            "--rate" => rate = args.value(&arg)?,
            "--rounds" => rounds = args.value(&arg)?,
            other => return Err(args.unknown(other)),
        }
    }
    if n == 0 || rounds == 0 || rate <= 0.0 {
        return Err("N, the rate and the rounds must be positive".into());
    }
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let pid = std::process::id();
    let (mut all_plain, mut all_ours) = (Vec::new(), Vec::new());
    let mut out = format!(
        "lateness of a 1 s retry (second run - first failure - 1 s), ms; {n} persistent messages at {rate} msg/s, prefetch {PREFETCH}\n"
    );
    let _ = writeln!(out, "  {:<34}{:>9}{:>9}{:>9}", "", "p50", "p99", "max");
    for round in 1..=rounds {
        let tag = format!("{pid}-{round}");
        let load_before = load1_shown();
        // Alternate which goes first.
        let (p, o) = if round % 2 == 1 {
            let p = plain(&conn, &tag, n, rate).await?;
            (p, ours(&conn, &tag, n, rate).await?)
        } else {
            let o = ours(&conn, &tag, n, rate).await?;
            (plain(&conn, &tag, n, rate).await?, o)
        };
        for (name, c) in [("plain", &p), ("ours", &o)] {
            if c.late.len() as u64 != n || c.early > 0 {
                return Err(format!(
                    "{name}: {} second runs timed of {n}, {} early",
                    c.late.len(),
                    c.early
                )
                .into());
            }
        }
        let (pp, po) = (percentiles(ms(&p.late)), percentiles(ms(&o.late)));
        let _ = writeln!(
            out,
            "round {round} (load {load_before} -> {})",
            load1_shown()
        );
        row(&mut out, "plain lapin, 1 s TTL queue + DLX", pp);
        row(&mut out, "retry consumer (ours)", po);
        row(&mut out, "ours - plain", diff(po, pp));
        eprintln!(
            "round {round}: plain p99 {:.1} ms, ours p99 {:.1} ms",
            pp.1, po.1
        );
        all_plain.extend(p.late);
        all_ours.extend(o.late);
    }
    let (pp, po) = (percentiles(ms(&all_plain)), percentiles(ms(&all_ours)));
    let _ = writeln!(out, "all {rounds} round(s)");
    row(&mut out, "plain lapin, 1 s TTL queue + DLX", pp);
    row(&mut out, "retry consumer (ours)", po);
    row(&mut out, "ours - plain", diff(po, pp));
    conn.close(200, "done".into()).await?;
    print!("{out}");
    Ok(())
}
