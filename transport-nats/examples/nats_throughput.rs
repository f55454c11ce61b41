//! Throughput over NATS JetStream against a local `nats-server -js`: this crate's consumer
//! beside the strongest plain async-nats loops, measured in the same run, on the same
//! server, under the same durability.
//!
//! ```sh
//! cargo run --release -p transport-nats --example nats_throughput -- [MESSAGES] [ROUNDS] [PATHS]
//! cargo run --release -p transport-nats --example nats_throughput -- 20000 3
//! ```
//!
//! `PATHS` (comma-separated) runs only those paths and prints no table, for profiling one.
//!
//! Every measurement gets streams of its own: a topology plan named
//! `nats-throughput-<pid>-<round>-<path>` (file storage, one replica; one delay level of
//! 10 min, so no clone comes back during a run and only the first pass is measured),
//! provisioned by a `NatsTransport` that is closed again before anything is measured (so
//! that its delay mover does not run beside the plain loops), prefilled with `MESSAGES`
//! (default 20 000) 256-byte messages, each with its PubAck awaited (up to 1 000 publishes
//! in flight), consumed through the work stream's durable pull consumer `retry-engine`
//! (explicit acks) with at most 100 deliveries in hand, checked (the work stream is empty;
//! on the retry path the delay stream holds exactly `MESSAGES` clones) and deleted.
//!
//! | path | what runs |
//! |---|---|
//! | `plain-fetch` | success: a loop of pulls of 100 (`consumer.batch().max_messages(100)`, one pull request at a time), `ack` each message as it arrives (a publish to its ack subject, not waiting for the server: acks pipeline) |
//! | `plain-stream` | success: async-nats's continuous pull (`consumer.stream().max_messages_per_batch(100)`, which asks for the next batch before the current one is used up), `ack` each |
//! | `ours-success` | success: `retry_core::Consumer` over `NatsTransport`, prefetch 100, a handler that succeeds |
//! | `plain-retry` | retry: the continuous pull of `plain-stream`; per message a clone (the body, `x-retry-attempts` and `x-retry-delay` headers, the delay stream as the expected stream) is published to the delay stream's subject, and the original acked once the clone's PubAck is in; up to 100 at once (many PubAck futures in flight, each original acked as its PubAck resolves) |
//! | `ours-retry` | retry: the consumer with a handler that fails transiently on the first run; the engine's clone (its five headers, a due time and a `Nats-Msg-Id`) goes to the delay stream with its PubAck awaited, then the original is acked. The transport's delay mover runs as it does in production: it pulls each clone and naks it with the 10 min it has left |
//!
//! The ratios compare ours with the stronger plain loop of the same round (`plain-fetch` or
//! `plain-stream` on the success path, `plain-retry` on the retry path).
//!
//! Two clocks per measurement: **total** runs from just before the measurement's connection
//! is opened until the last ack has been flushed to the server (for the consumer: until
//! `run` returns), so it includes connecting and, for the consumer, verifying the plan's
//! streams, the first look at the isolation stream (one empty fetch, a fetch wait of
//! 250 ms) and the shutdown, which waits for the last pull request to expire (up to the
//! pull wait, 1 s); **steady** runs from the first message in hand (the first handler call,
//! for the consumer) to the last settlement (for the consumer: the last `on_terminal`;
//! for the plain loops: the last ack, flushed), the rate at which messages flow once they
//! do.
//!
//! Rounds (default 3) are interleaved: every path once per round, the order rotated each
//! round, so that a neighbour's build slows all paths alike. The table shows min, median and
//! max per path and the ratio of ours to the stronger plain loop *of the same round*; the
//! load average is printed before and after, and each measurement prints the CPU
//! microseconds per message of this process and of the server (`nats-server`, read from
//! `/proc` when it runs on this machine) while consuming. `NATS_URL` picks the server
//! (default `nats://127.0.0.1:4222`).
//!
//! Where ours spends what the plain loops do not, as measured on a 2-core machine with the
//! server on it (10,000 messages, variants of the transport built for the measurement only):
//!
//! * **The delay mover** (retry path). Each clone is delivered once more, to the mover,
//!   and nak'ed with the time it has left: about 30% of the retry path's steady rate
//!   (12,900 msg/s with the mover, 18,600 without it, same run). A plain loop that only
//!   stores its clones pays nothing for their delays.
//! * **Hand-offs and allocation.** This process spends 15 to 20 µs of CPU per message on the
//!   success path (plain: 5 to 10) and 45 to 80 on the retry path (plain: 11 to 30). A
//!   profile (`perf record`) of the retry path shows no single hot function: a quarter of
//!   the samples in the kernel's thread switching (a delivery goes from the pulling task to
//!   the consumer's, its clone to the connection's, its ack back to it) and a fifth in
//!   `malloc` and `free`.
//! * **Not the pull size.** Pulling only once half the prefetch is free (pulls of 50 or
//!   more rather than of what one settlement freed) changed neither path; nor did leaving
//!   the clone's `Nats-Msg-Id` out (the server's duplicate check).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, Context};
use bench_support::BoxError;
use bench_support::args::Args;
use bench_support::proc::{cpu_time, load_average_shown};
use bench_support::stats::rates_summary;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use retry_core::{
    Consumer, Handler, HandlerError, Message, QueueRole, RetryPolicy, Terminal, TopologyPlan,
    Transport,
};
use tokio::sync::Notify;
use transport_nats::{CONSUMER, NatsConfig, NatsTransport, stream_name};

const PREFETCH: u16 = 100;
/// Messages per pull of the plain loops, and clones in flight on the plain retry path.
const BATCH: usize = 100;
/// Publishes in flight while prefilling.
const PREFILL_IN_FLIGHT: usize = 1_000;
const BODY: [u8; 256] = [b'x'; 256];
/// Long enough that no clone comes back during a run.
const DELAY: Duration = Duration::from_secs(600);
/// A measurement that has not finished by then failed.
const BOUND: Duration = Duration::from_secs(300);
/// How long the streams' counts may take to settle after a measurement (acks are
/// published without waiting for the server's answer).
const SETTLING: Duration = Duration::from_secs(5);

/// The paths, in their order in the first round.
const PATHS: [&str; 5] = [
    "plain-fetch",
    "plain-stream",
    "ours-success",
    "plain-retry",
    "ours-retry",
];

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The local server's process id (`nats-server`), if it runs on this machine and can be
/// seen.
fn server_pid() -> Option<String> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid = entry.file_name().into_string().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            (comm.trim() == "nats-server").then_some(pid)
        })
}

/// The two clocks of one measurement.
#[derive(Clone, Copy, Debug)]
struct Timing {
    total: Duration,
    steady: Duration,
    /// CPU seconds of this process and of the server while consuming, if known.
    cpu: Option<(f64, f64)>,
}

impl Timing {
    fn new(start: Instant, first: Instant, end: Instant) -> Self {
        Timing {
            total: end - start,
            steady: end - first,
            cpu: None,
        }
    }
}

/// The measurement's own connection, and the work stream's durable consumer through it.
async fn plain_consumer(
    queue: &str,
) -> Result<(async_nats::Client, Context, PullConsumer), BoxError> {
    let client = async_nats::connect(nats_url()).await?;
    let js = jetstream::new(client.clone());
    let consumer: PullConsumer = js
        .get_stream(stream_name(queue))
        .await?
        .get_consumer(CONSUMER)
        .await?;
    Ok((client, js, consumer))
}

/// Success path, plain: pulls of [`BATCH`] one after the other (`stream`: async-nats's
/// continuous pull), `ack` each message as it arrives.
async fn plain_success(queue: &str, n: u64, stream: bool) -> Result<Timing, BoxError> {
    let start = Instant::now();
    let (client, _js, consumer) = plain_consumer(queue).await?;
    let mut first = None;
    let mut done = 0;
    if stream {
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(BATCH)
            .messages()
            .await?;
        while done < n {
            let message = messages.next().await.ok_or("the pull ended early")??;
            first.get_or_insert_with(Instant::now);
            message.ack().await?;
            done += 1;
        }
    } else {
        while done < n {
            let mut batch = consumer
                .batch()
                .max_messages(BATCH)
                .expires(Duration::from_secs(1))
                .messages()
                .await?;
            while let Some(message) = batch.next().await {
                let message = message?;
                first.get_or_insert_with(Instant::now);
                message.ack().await?;
                done += 1;
            }
        }
    }
    client.flush().await?;
    let end = Instant::now();
    Ok(Timing::new(start, first.unwrap_or(end), end))
}

/// Retry path, plain: per message, publish a clone to the delay stream's subject and ack
/// the original once the clone's PubAck is in; up to [`BATCH`] in flight.
async fn plain_retry(queue: &str, delay_queue: &str, n: u64) -> Result<Timing, BoxError> {
    let start = Instant::now();
    let (client, js, consumer) = plain_consumer(queue).await?;
    let delay_stream = stream_name(delay_queue);
    let delay_ms = DELAY.as_millis().to_string();
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(BATCH)
        .messages()
        .await?;
    let mut first = None;
    let (mut received, mut done) = (0, 0);
    let mut in_flight = FuturesUnordered::new();
    while done < n {
        tokio::select! {
            Some((message, acked)) = in_flight.next(), if !in_flight.is_empty() => {
                let _: jetstream::publish::PublishAck = acked?;
                let message: jetstream::Message = message;
                message.ack().await?;
                done += 1;
            }
            message = messages.next(), if received < n && in_flight.len() < BATCH => {
                let message = message.ok_or("the pull ended early")??;
                first.get_or_insert_with(Instant::now);
                received += 1;
                let mut headers = message.headers.clone().unwrap_or_default();
                headers.insert("x-retry-attempts", "~i:1");
                headers.insert("x-retry-delay", delay_ms.as_str());
                let clone = PublishMessage::build()
                    .payload(message.payload.clone())
                    .headers(headers)
                    .expected_stream(delay_stream.as_str());
                let ack = js.send_publish(delay_queue.to_owned(), clone).await?;
                in_flight.push(async move { (message, ack.await) });
            }
        }
    }
    client.flush().await?;
    let end = Instant::now();
    Ok(Timing::new(start, first.unwrap_or(end), end))
}

/// The consumer's handler: succeeds, or (`fail`) fails transiently on a message's first
/// run. Notes when it first ran.
struct Bench {
    fail: bool,
    first: Arc<OnceLock<Instant>>,
}

#[async_trait::async_trait]
impl Handler for Bench {
    async fn handle(&self, msg: &Message) -> Result<(), HandlerError> {
        self.first.get_or_init(Instant::now);
        if self.fail && msg.attempt() == 1 {
            return Err(HandlerError::transient("the first run fails"));
        }
        Ok(())
    }
}

/// Either path through `retry_core::Consumer` over `NatsTransport`.
async fn ours(queue: &str, policy: &RetryPolicy, n: u64, fail: bool) -> Result<Timing, BoxError> {
    let start = Instant::now();
    let transport = Arc::new(NatsTransport::connect(NatsConfig::new(nats_url())).await?);
    let first = Arc::new(OnceLock::new());
    let last = Arc::new(OnceLock::new());
    let ended = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let handler = Bench {
        fail,
        first: Arc::clone(&first),
    };
    let consumer = Consumer::builder(Arc::clone(&transport), queue, policy.clone(), handler)
        .with_prefetch(PREFETCH)
        .with_provision(false)
        .with_on_terminal({
            let ended = Arc::clone(&ended);
            let done = Arc::clone(&done);
            let last = Arc::clone(&last);
            move |_, terminal| {
                let expected = if fail {
                    matches!(terminal, Terminal::Retried { attempts: 1, .. })
                } else {
                    matches!(terminal, Terminal::Handled { attempt: 1 })
                };
                if expected && ended.fetch_add(1, Ordering::Relaxed) + 1 == n {
                    let _ = last.set(Instant::now());
                    done.notify_one();
                }
            }
        })
        .build()?;
    let shutdown = {
        let done = Arc::clone(&done);
        async move {
            let _ = tokio::time::timeout(BOUND, done.notified()).await;
        }
    };
    let report = consumer.run(shutdown).await?;
    let end = Instant::now();
    transport.close().await;
    let expected = if fail { report.retried } else { report.handled };
    if expected != n || report.accounted() != report.received {
        return Err(format!("the consumer did not finish all {n} messages: {report:?}").into());
    }
    let last = last.get().copied().unwrap_or(end);
    Ok(Timing {
        total: end - start,
        steady: last - first.get().copied().unwrap_or(last),
        cpu: None,
    })
}

/// Publishes `n` messages to `queue`, each with its PubAck awaited, up to
/// [`PREFILL_IN_FLIGHT`] in flight.
async fn prefill(js: &Context, queue: &str, n: u64) -> Result<(), BoxError> {
    let stream = stream_name(queue);
    let mut acks = FuturesUnordered::new();
    for i in 0..n {
        if acks.len() >= PREFILL_IN_FLIGHT
            && let Some(ack) = acks.next().await
        {
            let _: jetstream::publish::PublishAck = ack?;
        }
        let mut headers = HeaderMap::new();
        headers.insert("message-id", format!("m{i}").as_str());
        let message = PublishMessage::build()
            .payload(Bytes::from_static(&BODY))
            .headers(headers)
            .expected_stream(stream.as_str());
        acks.push(
            js.send_publish(queue.to_owned(), message)
                .await?
                .into_future(),
        );
    }
    while let Some(ack) = acks.next().await {
        ack?;
    }
    Ok(())
}

/// Messages stored in `queue`'s stream, asked every 50 ms until there are `expected` or
/// `within` has passed.
async fn wait_for_count(
    js: &Context,
    queue: &str,
    expected: u64,
    within: Duration,
) -> Result<u64, BoxError> {
    let deadline = Instant::now() + within;
    loop {
        let count = js
            .get_stream(stream_name(queue))
            .await?
            .info()
            .await?
            .state
            .messages;
        if count == expected || Instant::now() >= deadline {
            return Ok(count);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One measurement of `path` on streams of its own, deleted afterwards.
async fn measure(js: &Context, path: &str, round: usize, n: u64) -> Result<Timing, BoxError> {
    let queue = format!("nats-throughput-{}-{round}-{path}", std::process::id());
    let policy = RetryPolicy::delays([DELAY]).build()?;
    let plan = TopologyPlan::new(&queue, &policy)?;
    // The transport that provisions is closed again, so that its delay mover does not run
    // beside the plain loops.
    let setup = NatsTransport::connect(NatsConfig::new(nats_url())).await?;
    let provisioned = setup.provision(&plan).await;
    setup.close().await;
    let outcome = async {
        provisioned?;
        let delay_queue = plan
            .queues()
            .iter()
            .find(|q| matches!(q.role, QueueRole::Delay { .. }))
            .map(|q| q.name.clone())
            .ok_or("the plan has no delay queue")?;
        prefill(js, &queue, n).await?;
        let measuring = async {
            match path {
                "plain-fetch" => plain_success(&queue, n, false).await,
                "plain-stream" => plain_success(&queue, n, true).await,
                "ours-success" => ours(&queue, &policy, n, false).await,
                "plain-retry" => plain_retry(&queue, &delay_queue, n).await,
                "ours-retry" => ours(&queue, &policy, n, true).await,
                other => Err(format!("unknown path {other}; known: {PATHS:?}").into()),
            }
        };
        let server = server_pid();
        let before = (cpu_time("self"), server.as_deref().and_then(cpu_time));
        let mut timing = tokio::time::timeout(BOUND, measuring)
            .await
            .map_err(|_| format!("{path} did not finish within {BOUND:?}"))??;
        let after = (cpu_time("self"), server.as_deref().and_then(cpu_time));
        if let ((Some(c0), Some(s0)), (Some(c1), Some(s1))) = (before, after) {
            timing.cpu = Some(((c1 - c0).as_secs_f64(), (s1 - s0).as_secs_f64()));
        }
        let left = wait_for_count(js, &queue, 0, SETTLING).await?;
        if left != 0 {
            return Err(format!("{path}: {left} messages left in the work stream").into());
        }
        if path.contains("retry") {
            let clones = wait_for_count(js, &delay_queue, n, SETTLING).await?;
            if clones != n {
                return Err(format!("{path}: {clones} clones in the delay stream, not {n}").into());
            }
        }
        Ok::<_, BoxError>(timing)
    }
    .await;
    for q in plan.queues() {
        let _ = js.delete_stream(stream_name(&q.name)).await;
    }
    outcome
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = Args::new("usage: nats_throughput [MESSAGES] [ROUNDS] [PATHS]");
    let n: u64 = args.positional(20_000)?;
    let rounds: usize = args.positional(3)?;
    // Only these paths (comma-separated), for profiling one; the table and ratios need all.
    let only: Option<Vec<String>> = args
        .next()
        .map(|a| a.split(',').map(str::to_owned).collect());
    if n == 0 || rounds == 0 {
        return Err("MESSAGES and ROUNDS must be at least 1".into());
    }
    let client = async_nats::connect(nats_url()).await?;
    let js = jetstream::new(client.clone());
    println!(
        "{n} 256-byte messages (file storage, 1 replica), prefetch/pull {PREFETCH}, {rounds} rounds; server {}; load average {}",
        client.server_info().version,
        load_average_shown()
    );
    // rates[path][round] = (total msg/s, steady msg/s)
    let mut rates = vec![Vec::new(); PATHS.len()];
    for round in 0..rounds {
        for k in 0..PATHS.len() {
            let i = (k + round) % PATHS.len();
            let path = PATHS[i];
            if only.as_ref().is_some_and(|o| !o.iter().any(|p| p == path)) {
                continue;
            }
            let timing = measure(&js, path, round, n).await?;
            // Microseconds of CPU per message, this process and the server.
            let cpu = timing.cpu.map_or_else(
                || "?".into(),
                |(c, s)| format!("{:.0} + {:.0}", c * 1e6 / n as f64, s * 1e6 / n as f64),
            );
            let total = n as f64 / timing.total.as_secs_f64();
            let steady = n as f64 / timing.steady.as_secs_f64();
            println!(
                "round {}: {path:<13} total {total:>7.0} msg/s ({:.2} s), steady {steady:>7.0} msg/s ({:.2} s); cpu µs/msg client + server {cpu}; load {}",
                round + 1,
                timing.total.as_secs_f64(),
                timing.steady.as_secs_f64(),
                load_average_shown()
            );
            rates[i].push((total, steady));
        }
    }
    if only.is_some() {
        return Ok(());
    }
    // Ours against the stronger plain loop of the same round.
    print!(
        "{}",
        rates_summary(
            &PATHS,
            &rates,
            &[("success", 2, &[0, 1][..]), ("retry", 4, &[3][..])]
        )
    );
    println!();
    println!("load average at the end {}", load_average_shown());
    Ok(())
}
