//! How late a delayed retry comes back over NATS JetStream, through this crate's consumer
//! and through the server alone, measured in the same run: the NATS side of
//! `transport-amqp091`'s `lateness` example, with the same output.
//!
//! ```sh
//! cargo run --release -p transport-nats --example nats_lateness                 # 2000 at 500/s, 3 rounds
//! cargo run --release -p transport-nats --example nats_lateness -- --n 500 --rate 250 --rounds 1
//! ```
//!
//! Every message fails its first run and is retried once; its lateness is how late its
//! second run starts after it was due: `second run - first failure - its delay`, where the
//! first failure is the end of the first run (when the clone is published) and the delay
//! is the one the engine gave the clone (its `x-retry-delay` header, seen by the second
//! run). Messages are published at a steady rate (default 2,000 at 500 msg/s, each with its
//! PubAck awaited, pipelined) by a publisher of their own while the consumer runs, with
//! prefetch 100, into file-storage streams the transport provisioned.
//!
//! * `plain`: the server's floor. A plain async-nats continuous pull (batches of 100) on
//!   the work stream's durable consumer; on a first delivery it notes the time and naks it
//!   with the delay (`AckKind::Nak(Some(delay))`, which the server holds and hands out
//!   again then); the second delivery is acked and ends the message.
//! * `ours`: the retry consumer, with a handler that fails the first run (noting the time)
//!   and succeeds the second; the plan has one delay level, 1 s. The clone goes to the delay
//!   stream with a due time, the transport's mover naks it there with the time left, and
//!   publishes it back to the work stream once due.
//! * `jittered`: both again with delays spread over 0.5 to 1 s: ours with the policy's
//!   `Jitter::Equal` (uniform in `[base / 2, base]`, seeded by the message id), plain with a
//!   delay drawn the same way from a hash of the id. Every message waits for its own delay.
//!
//! In each round the two run one after the other, the order alternating; the table shows
//! p50, p99 and max per round and over all rounds, and ours minus plain. A second run that
//! starts before it was due counts as negative lateness (the due time is made from the
//! wall clock, rounded up to the millisecond, and the run's from the monotonic clock);
//! how many were early, and by how much at most, is printed below the table. Each round uses
//! streams of its own and deletes them. `NATS_URL` picks the server.
//!
//! **What the server does to the floor.** A nak with a delay resets the consumer's
//! pending timer, the one that hands delayed messages back, to 10 ms (`processNak` in
//! nats-server 2.9.10's `server/consumer.go`, and still so on its main branch): while naks
//! reach one consumer more often than every 10 ms, that timer never fires, and every
//! delayed message waits until the naks pause. Both runs nak once per message (plain on the
//! work stream, ours through the delay stream's mover), so both are late by about as long
//! as messages keep failing faster than 100 a second: on one machine, the plain floor's p50
//! was 10 ms at 50 msg/s, 230 ms at 150 msg/s and 360 to 520 ms at 500 msg/s. Compare
//! rates below 100 msg/s with RabbitMQ's figures, and read those above as the server's.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind, Context};
use bench_support::BoxError;
use bench_support::args::Args;
use bench_support::proc::load1_shown;
use bench_support::stats::percentiles;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use retry_core::{
    Consumer, HandlerError, HeaderValue, Jitter, Message, RetryPolicy, Terminal, TopologyPlan,
    Transport,
};
use transport_nats::{CONSUMER, NatsConfig, NatsTransport, stream_name};

const PREFETCH: u16 = 100;
const DELAY: Duration = Duration::from_secs(1);
const BODY: [u8; 256] = [b'x'; 256];

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// First-failure times by message id, and the lateness of each second run in ms (negative:
/// early).
#[derive(Default)]
struct Clock {
    first: HashMap<String, Instant>,
    late: Vec<f64>,
}

impl Clock {
    fn failed(&mut self, id: &str) {
        self.first.insert(id.to_owned(), Instant::now());
    }

    /// A second run of `id`, due `delay` after its first failure: how late it is.
    fn returned(&mut self, id: &str, delay: Duration) {
        let Some(first) = self.first.remove(id) else {
            return;
        };
        let late = first.elapsed().as_secs_f64() - delay.as_secs_f64();
        self.late.push(late * 1e3);
    }
}

/// The delay of the plain loop's message `id`: `DELAY`, or (`jitter`) uniform in
/// `[DELAY / 2, DELAY]` by an FNV-1a hash of the id.
fn plain_delay(id: &str, jitter: bool) -> Duration {
    if !jitter {
        return DELAY;
    }
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let half = DELAY.as_millis() as u64 / 2;
    Duration::from_millis(half + hash % (half + 1))
}

/// Publishes one 256-byte message per id of `0..n` to `queue`, message id the id, at `rate`
/// per second; returns once every PubAck is in.
async fn publish_paced(js: &Context, queue: &str, n: u64, rate: f64) -> Result<(), BoxError> {
    let stream = stream_name(queue);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut acks = FuturesUnordered::new();
    for i in 0..n {
        tick.tick().await;
        let mut headers = HeaderMap::new();
        headers.insert("message-id", i.to_string().as_str());
        let message = PublishMessage::build()
            .payload(Bytes::from_static(&BODY))
            .headers(headers)
            .expected_stream(stream.as_str());
        acks.push(
            js.send_publish(queue.to_owned(), message)
                .await?
                .into_future(),
        );
        // Collect what is in without waiting.
        while let Some(Some(ack)) = futures::FutureExt::now_or_never(acks.next()) {
            ack?;
        }
    }
    while let Some(ack) = acks.next().await {
        ack?;
    }
    Ok(())
}

/// A plan of one 1 s delay level for `work`, provisioned by a transport that is closed
/// again (so no delay mover of its own runs).
async fn provisioned(work: &str, policy: &RetryPolicy) -> Result<TopologyPlan, BoxError> {
    let plan = TopologyPlan::new(work, policy)?;
    let setup = NatsTransport::connect(NatsConfig::new(nats_url())).await?;
    let done = setup.provision(&plan).await;
    setup.close().await;
    done?;
    Ok(plan)
}

async fn delete(js: &Context, plan: &TopologyPlan) {
    for q in plan.queues() {
        let _ = js.delete_stream(stream_name(&q.name)).await;
    }
}

/// The server's floor: a plain pull that naks each first delivery with its delay.
async fn plain(
    js: &Context,
    tag: &str,
    n: u64,
    rate: f64,
    jitter: bool,
) -> Result<Clock, BoxError> {
    let work = format!("late-{tag}-plain{}", if jitter { "-jitter" } else { "" });
    let plan = provisioned(&work, &RetryPolicy::delays([DELAY]).build()?).await?;
    let result = async {
        let consumer: PullConsumer = js
            .get_stream(stream_name(&work))
            .await?
            .get_consumer(CONSUMER)
            .await?;
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(usize::from(PREFETCH))
            .messages()
            .await?;
        let mut clock = Clock::default();
        let consume = async {
            let mut second_runs = 0;
            while second_runs < n {
                let m = messages.next().await.ok_or("the pull ended early")??;
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("message-id"))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                let delay = plain_delay(&id, jitter);
                if m.info()?.delivered > 1 {
                    clock.returned(&id, delay);
                    second_runs += 1;
                    m.ack().await?;
                } else {
                    clock.failed(&id);
                    m.ack_with(AckKind::Nak(Some(delay))).await?;
                }
            }
            Ok::<_, BoxError>(())
        };
        let (fed, consumed) = tokio::join!(publish_paced(js, &work, n, rate), consume);
        fed?;
        consumed?;
        Ok::<_, BoxError>(clock)
    }
    .await;
    delete(js, &plan).await;
    result
}

/// The retry consumer, with one 1 s delay level (`jitter`: equal jitter on it).
async fn ours(js: &Context, tag: &str, n: u64, rate: f64, jitter: bool) -> Result<Clock, BoxError> {
    let work = format!("late-{tag}-ours{}", if jitter { "-jitter" } else { "" });
    let mut policy = RetryPolicy::delays([DELAY]);
    if jitter {
        policy = policy.with_jitter(Jitter::Equal);
    }
    let policy = policy.build()?;
    let plan = provisioned(&work, &policy).await?;
    let result = async {
        let transport = Arc::new(NatsTransport::connect(NatsConfig::new(nats_url())).await?);
        let clock = Arc::new(Mutex::new(Clock::default()));
        let second_runs = Arc::new(AtomicU64::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let clock = Arc::clone(&clock);
            move |m: Message| {
                let id = m.properties().message_id.clone().unwrap_or_default();
                let result = if m.attempt() == 1 {
                    clock.lock().unwrap().failed(&id);
                    Err(HandlerError::transient("the first run fails"))
                } else {
                    // The delay the engine gave the clone.
                    let delay = match m.headers().get("x-retry-delay") {
                        Some(HeaderValue::Int(ms)) => Duration::from_millis(*ms as u64),
                        Some(HeaderValue::UInt(ms)) => Duration::from_millis(*ms),
                        _ => DELAY,
                    };
                    clock.lock().unwrap().returned(&id, delay);
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
                if matches!(t, Terminal::Handled { .. })
                    && count.fetch_add(1, Ordering::Relaxed) + 1 == n
                {
                    notify.notify_one();
                }
            })
            .build()?;
        let feed = publish_paced(js, &work, n, rate);
        let (fed, report) = tokio::join!(feed, consumer.run(done.notified()));
        transport.close().await;
        fed?;
        let report = report?;
        if report.handled != n || report.retried != n {
            return Err(format!("{n} messages, but the consumer reports {report:?}").into());
        }
        let clock = std::mem::take(&mut *clock.lock().unwrap());
        Ok::<_, BoxError>(clock)
    }
    .await;
    delete(js, &plan).await;
    result
}

fn row(out: &mut String, label: &str, (p50, p99, max): (f64, f64, f64)) {
    let _ = writeln!(out, "  {label:<38}{p50:>9.1}{p99:>9.1}{max:>9.1}");
}

fn diff(a: (f64, f64, f64), b: (f64, f64, f64)) -> (f64, f64, f64) {
    (a.0 - b.0, a.1 - b.1, a.2 - b.2)
}

/// How many of `late` were early, and by how much at most (ms).
fn early(late: &[f64]) -> (usize, f64) {
    let early: Vec<f64> = late.iter().copied().filter(|l| *l < 0.0).collect();
    (early.len(), early.iter().copied().fold(0.0, f64::min))
}

/// The four kinds of run, with their labels.
const KINDS: [(&str, bool, bool); 4] = [
    ("plain async-nats, nak with 1 s delay", false, false),
    ("retry consumer (ours)", true, false),
    ("plain, nak, jittered 0.5-1 s", false, true),
    ("ours, equal jitter 0.5-1 s", true, true),
];

fn table(out: &mut String, late: &[Vec<f64>; 4]) {
    let p: Vec<_> = late.iter().map(|l| percentiles(l.clone())).collect();
    row(out, KINDS[0].0, p[0]);
    row(out, KINDS[1].0, p[1]);
    row(out, "ours - plain", diff(p[1], p[0]));
    row(out, KINDS[2].0, p[2]);
    row(out, KINDS[3].0, p[3]);
    row(out, "ours - plain, jittered", diff(p[3], p[2]));
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (mut n, mut rate, mut rounds) = (2_000u64, 500.0f64, 3usize);
    let mut args = Args::new("usage: nats_lateness [--n N] [--rate R] [--rounds R]");
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
    let client = async_nats::connect(nats_url()).await?;
    let js = jetstream::new(client.clone());
    let pid = std::process::id();
    let mut all: [Vec<f64>; 4] = Default::default();
    let mut out = format!(
        "lateness of a 1 s retry (second run - first failure - its delay), ms; {n} messages at {rate} msg/s, prefetch {PREFETCH}; NATS server {}\n",
        client.server_info().version
    );
    let _ = writeln!(out, "  {:<38}{:>9}{:>9}{:>9}", "", "p50", "p99", "max");
    for round in 1..=rounds {
        let tag = format!("{pid}-{round}");
        let load_before = load1_shown();
        let mut late: [Vec<f64>; 4] = Default::default();
        // Alternate which goes first.
        let mut order = [0, 1, 2, 3];
        if round % 2 == 0 {
            order = [1, 0, 3, 2];
        }
        for k in order {
            let (name, is_ours, jitter) = KINDS[k];
            let clock = if is_ours {
                ours(&js, &tag, n, rate, jitter).await?
            } else {
                plain(&js, &tag, n, rate, jitter).await?
            };
            if clock.late.len() as u64 != n {
                return Err(
                    format!("{name}: {} second runs timed of {n}", clock.late.len()).into(),
                );
            }
            late[k] = clock.late;
        }
        let _ = writeln!(
            out,
            "round {round} (load {load_before} -> {})",
            load1_shown()
        );
        table(&mut out, &late);
        eprintln!(
            "round {round}: plain p99 {:.1} ms, ours p99 {:.1} ms",
            percentiles(late[0].clone()).1,
            percentiles(late[1].clone()).1
        );
        for (k, l) in late.into_iter().enumerate() {
            all[k].extend(l);
        }
    }
    let _ = writeln!(out, "all {rounds} round(s)");
    table(&mut out, &all);
    for (k, l) in all.iter().enumerate() {
        let (count, most) = early(l);
        if count > 0 {
            let _ = writeln!(
                out,
                "  early: {} of {} second runs, by {:.1} ms at most",
                count,
                l.len(),
                -most
            );
            let _ = writeln!(out, "         ({})", KINDS[k].0);
        }
    }
    print!("{out}");
    Ok(())
}
