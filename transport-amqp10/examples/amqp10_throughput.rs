//! Throughput over AMQP 1.0 against a local RabbitMQ 3.x: this crate's consumer beside the
//! strongest plain fe2o3-amqp loops, measured in the same run, on the same broker, under the
//! same durability.
//!
//! ```sh
//! rabbitmq-plugins enable rabbitmq_amqp1_0
//! cargo run --release -p transport-amqp10 --example amqp10_throughput -- [MESSAGES] [ROUNDS] [PATHS]
//! ```
//!
//! `PATHS` (comma-separated) runs only those paths and prints no table, for profiling one.
//!
//! Every measurement gets queues of its own: a topology plan named
//! `amqp10-throughput-<pid>-<round>-<path>` (durable classic queues; one delay level of
//! 10 min, so no clone comes back during a run and only the first pass is measured),
//! declared over AMQP 0-9-1 with transport-amqp091 (RabbitMQ's AMQP 1.0 plugin cannot declare
//! queues with arguments), prefilled over AMQP 0-9-1 with `MESSAGES` (default 20 000)
//! persistent 256-byte messages under publisher confirms, consumed over AMQP 1.0 with a link
//! credit (prefetch) of 100, checked (the work queue is empty once its consumer is gone; on
//! the retry path the delay queue holds exactly `MESSAGES` clones) and deleted.
//!
//! | path | what runs |
//! |---|---|
//! | `plain-accept-each` | success: fe2o3 receiver, credit 100 (fe2o3's `CreditMode::Auto`, which grants 100 again once 50 are settled), `accept` each delivery as it arrives. `accept` only queues the disposition for the session, so dispositions pipeline |
//! | `plain-accept-batched` | success: the same receiver; takes every delivery already there (up to 50) and settles them with one `accept_all` (one disposition frame per consecutive range) |
//! | `ours-success` | success: `retry_core::Consumer` over `Amqp10Transport`, prefetch 100, a handler that succeeds |
//! | `plain-retry-eager` | retry: a receiver in manual credit (see below); per delivery a clone (body, properties, application properties plus an attempt header, durable like the original) is sent unsettled to `/amq/queue/<delay queue>` on a sender of a second connection, its `accepted` outcome awaited, then the original accepted; up to 100 in flight at once. Credit is granted again once the last grant is used up, `100 − unsettled` |
//! | `plain-retry-half` | retry: the same, granting only once at most 50 are unsettled (fewer, larger grants) |
//! | `ours-retry` | retry: the consumer with a handler that fails transiently on the first run; the engine's clone goes to the delay queue (confirmed), then the original is accepted |
//! | `plain-retry-headers` | retry, not a baseline: `plain-retry-half` with the eight further application properties the engine writes on a first clone, to see what the engine's headers cost the broker |
//!
//! The ratios compare ours with the stronger plain loop of the same round (`plain-accept-*`
//! on the success path, `plain-retry-eager`/`-half` on the retry path). Two things a plain
//! loop must do that this crate does for its user, both measured here:
//!
//! * **`TCP_NODELAY`.** fe2o3's `Connection::open(name, url)` leaves Nagle's algorithm on;
//!   dispositions, flows and sends then wait for delayed ACKs, and the plain loops ran at
//!   2 000 to 6 600 msg/s. The plain loops here open their own `TcpStream` with
//!   `set_nodelay(true)`, as `Amqp10Transport` does.
//! * **Manual credit on the retry path.** With `CreditMode::Auto(100)` the plain retry loop
//!   failed with `TransferLimitExceeded`: fe2o3 grants 100 again while transfers are on the
//!   way, RabbitMQ 3.10 does not subtract those from the grant, and fe2o3 refuses the
//!   transfer beyond its credit. The success loops settle at once, so nothing is on the way
//!   when they grant; they kept `Auto` without a failure here, but are not safe either.
//!
//! Two clocks per measurement: **total** runs from just before the first connection is
//! opened until the last settlement has been handed to the link (for the consumer: until
//! `run` returns), so it includes connecting, attaching and, for the consumer, verifying the
//! plan's addresses and the first look at the isolation queue (one count, answered at once
//! when the queue is empty); **steady** runs from the first delivery in hand (the first
//! handler call, for the consumer) to the same end, the rate at which messages flow once they
//! do. Time to first delivery, on every transport, is measured by `cargo run --release -p
//! conformance --example first_delivery`. The consumer runs with its defaults apart from prefetch 100 and `provision(false)`
//! (the plan was declared over AMQP 0-9-1; it is verified either way).
//!
//! Rounds (default 3) are interleaved: every path once per round, the order rotated each
//! round, so that a neighbour's build slows all paths alike. The table shows min, median and
//! max per path and the ratio of ours to the stronger plain loop *of the same round*; the load
//! average is printed before and after, and each measurement prints the CPU microseconds per
//! message of this process and of the broker (`beam.smp`, read from `/proc` when it runs on
//! this machine) while consuming: on a machine with few cores the two share, a loop that
//! costs the broker more per message is slower for it. `AMQP10_URL` and `AMQP_URL` as for
//! the `consumer` example.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bench_support::BoxError;
use bench_support::args::Args;
use bench_support::proc::{CpuClock, load_average_shown};
use bench_support::publish::{confirm_channel, persistent, prefill};
use bench_support::queue::wait_for_count;
use bench_support::stats::rates_summary;
use bench_support::url::{amqp_url, amqp10_url};
use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Body, Header, Message as AmqpMessage, Outcome,
};
use fe2o3_amqp::types::primitives::{SimpleValue, Value};
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::Channel;
use retry_core::{
    Consumer, Handler, HandlerError, Message, QueueRole, RetryPolicy, Terminal, TopologyPlan,
    Transport,
};
use tokio::sync::Notify;
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const PREFETCH: u16 = 100;
const BODY: [u8; 256] = [b'x'; 256];
/// Long enough that no clone comes back during a run.
const DELAY: Duration = Duration::from_secs(600);
/// A measurement that has not finished by then failed.
const BOUND: Duration = Duration::from_secs(300);
/// How long the queues' counts may take to settle after a measurement (the broker handles
/// dispositions and the end of a connection asynchronously).
const SETTLING: Duration = Duration::from_secs(5);

/// The paths, in their order in the first round.
const PATHS: [&str; 7] = [
    "plain-accept-each",
    "plain-accept-batched",
    "ours-success",
    "plain-retry-eager",
    "plain-retry-half",
    "ours-retry",
    "plain-retry-headers",
];

/// The two clocks of one measurement.
#[derive(Clone, Copy, Debug)]
struct Timing {
    total: Duration,
    steady: Duration,
    /// CPU seconds of this process and of the broker while consuming, if known.
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

/// Opens an AMQP 1.0 connection as a careful user would: with `TCP_NODELAY`, which
/// fe2o3's `Connection::open(name, url)` leaves off. (With Nagle on, dispositions, flows and
/// confirms wait for delayed ACKs: the plain loops ran at 2 000 to 6 600 msg/s that way.)
async fn plain_connection(name: &str) -> Result<ConnectionHandle<()>, BoxError> {
    let url = url::Url::parse(&amqp10_url())?;
    let host = url.host_str().ok_or("AMQP10_URL has no host")?.to_owned();
    let port = url.port().unwrap_or(5672);
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
    tcp.set_nodelay(true)?;
    let sasl = SaslProfile::Plain {
        username: url.username().to_owned(),
        password: url.password().unwrap_or_default().to_owned(),
    };
    Ok(Connection::builder()
        .container_id(format!("{name}-{}", std::process::id()))
        .hostname(host.as_str())
        .sasl_profile(sasl)
        .open_with_stream(tcp)
        .await?)
}

/// A receiver on `queue` with fe2o3's automatic credit of `PREFETCH` (`manual`: none yet).
async fn plain_receiver(
    session: &mut SessionHandle<()>,
    queue: &str,
    manual: bool,
) -> Result<Receiver, BoxError> {
    let mode = if manual {
        CreditMode::Manual
    } else {
        CreditMode::Auto(u32::from(PREFETCH))
    };
    Ok(Receiver::builder()
        .name(format!("plain-{queue}"))
        .source(format!("/amq/queue/{queue}"))
        .credit_mode(mode)
        .attach(session)
        .await?)
}

/// Manual credit for the plain retry loop (`CreditMode::Auto` fails there on RabbitMQ 3.10,
/// see the top of the file): a new grant is made only once the last one is used up, of what
/// is free below the prefetch, and only when at most `floor` deliveries are unsettled.
struct Credit {
    left: u32,
    unsettled: u32,
    floor: u32,
}

impl Credit {
    async fn top_up(&mut self, receiver: &mut Receiver) -> Result<(), BoxError> {
        let prefetch = u32::from(PREFETCH);
        if self.left == 0 && self.unsettled <= self.floor && self.unsettled < prefetch {
            receiver.set_credit(prefetch - self.unsettled).await?;
            self.left = prefetch - self.unsettled;
        }
        Ok(())
    }
}

/// Success path, plain: accept each delivery as it arrives, or (`batched`) every delivery
/// already there with one `accept_all`.
async fn plain_success(queue: &str, n: u64, batched: bool) -> Result<Timing, BoxError> {
    let start = Instant::now();
    let mut connection = plain_connection("plain-success").await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut receiver = plain_receiver(&mut session, queue, false).await?;
    let mut first = None;
    let mut done = 0;
    let mut batch = Vec::with_capacity(usize::from(PREFETCH / 2));
    while done < n {
        let delivery = receiver.recv::<Body<Value>>().await?;
        first.get_or_insert_with(Instant::now);
        if !batched {
            receiver.accept(&delivery).await?;
            done += 1;
            continue;
        }
        batch.push(delivery);
        // `recv` is cancel safe: asking without waiting loses nothing.
        while batch.len() < batch.capacity() && done + (batch.len() as u64) < n {
            match futures::FutureExt::now_or_never(receiver.recv::<Body<Value>>()) {
                Some(delivery) => batch.push(delivery?),
                None => break,
            }
        }
        done += batch.len() as u64;
        receiver.accept_all(batch.drain(..)).await?;
    }
    let end = Instant::now();
    let _ = receiver.detach().await;
    let _ = session.end().await;
    let _ = connection.close().await;
    Ok(Timing::new(start, first.unwrap_or(end), end))
}

/// Retry path, plain: per delivery, send a clone unsettled to the delay queue, await its
/// `accepted`, then accept the original; as many at once as the credit lets in.
async fn plain_retry(
    queue: &str,
    delay_queue: &str,
    n: u64,
    floor: u32,
    engine_headers: bool,
) -> Result<Timing, BoxError> {
    let start = Instant::now();
    let mut connection = plain_connection("plain-retry").await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut receiver = plain_receiver(&mut session, queue, true).await?;
    let mut credit = Credit {
        left: 0,
        unsettled: 0,
        floor,
    };
    credit.top_up(&mut receiver).await?;
    // The clones go out on a connection of their own, as the transport sends them.
    let mut publishing = plain_connection("plain-retry-publisher").await?;
    let mut publishing_session = Session::begin(&mut publishing).await?;
    let mut sender = Sender::attach(
        &mut publishing_session,
        format!("plain-clones-{queue}"),
        format!("/amq/queue/{delay_queue}"),
    )
    .await?;
    let mut first = None;
    let mut received = 0;
    let mut done = 0;
    let mut in_flight = FuturesUnordered::new();
    while done < n {
        tokio::select! {
            Some((info, outcome)) = in_flight.next(), if !in_flight.is_empty() => {
                match outcome {
                    Ok(Outcome::Accepted(_)) => receiver.accept(info).await?,
                    other => return Err(format!("a clone was not accepted: {other:?}").into()),
                }
                done += 1;
                credit.unsettled -= 1;
                credit.top_up(&mut receiver).await?;
            }
            delivery = receiver.recv::<Body<Value>>(), if received < n => {
                let delivery = delivery?;
                first.get_or_insert_with(Instant::now);
                received += 1;
                credit.left -= 1;
                credit.unsettled += 1;
                let (info, original) = delivery.into_parts();
                let mut properties = original
                    .application_properties
                    .unwrap_or_else(|| ApplicationProperties::builder().build());
                properties.0.insert("x-retry-attempts".into(), SimpleValue::Long(1));
                if engine_headers {
                    // What the engine writes on a first clone, with values of the same types.
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as i64);
                    for (key, value) in [
                        ("x-retry-crashes", SimpleValue::Long(0)),
                        ("x-retry-first-failure", SimpleValue::Long(now)),
                        ("x-retry-last-failure", SimpleValue::Long(now)),
                        ("x-retry-last-error", SimpleValue::String("the first run fails".into())),
                        ("x-retry-delay", SimpleValue::Long(600_000)),
                        ("x-retry-origin-queue", SimpleValue::String(queue.into())),
                        ("x-retry-origin-exchange", SimpleValue::String(String::new())),
                        ("x-retry-origin-routing-key", SimpleValue::String(queue.into())),
                    ] {
                        properties.0.insert(key.into(), value);
                    }
                }
                let clone = AmqpMessage::builder()
                    .header(Header {
                        durable: original.header.is_some_and(|h| h.durable),
                        ..Header::default()
                    })
                    .properties(original.properties.unwrap_or_default())
                    .application_properties(properties)
                    .body(original.body)
                    .build();
                let pending = sender.send_batchable(clone).await?;
                in_flight.push(async move { (info, pending.await) });
                credit.top_up(&mut receiver).await?;
            }
        }
    }
    let end = Instant::now();
    let _ = sender.detach().await;
    let _ = publishing_session.end().await;
    let _ = publishing.close().await;
    let _ = receiver.detach().await;
    let _ = session.end().await;
    let _ = connection.close().await;
    Ok(Timing::new(start, first.unwrap_or(end), end))
}

/// The consumer's handler: succeeds, or (`fail`) fails transiently on a message's first
/// run. Notes when it first ran.
struct Bench {
    fail: bool,
    first: Arc<OnceLock<Instant>>,
}

#[async_trait]
impl Handler for Bench {
    async fn handle(&self, msg: &Message) -> Result<(), HandlerError> {
        self.first.get_or_init(Instant::now);
        if self.fail && msg.headers().get("x-retry-attempts").is_none() {
            return Err(HandlerError::transient("the first run fails"));
        }
        Ok(())
    }
}

/// Either path through `retry_core::Consumer` over `Amqp10Transport`.
async fn ours(queue: &str, policy: &RetryPolicy, n: u64, fail: bool) -> Result<Timing, BoxError> {
    let start = Instant::now();
    let transport = Arc::new(Amqp10Transport::connect(Amqp10Config::new(amqp10_url())).await?);
    let first = Arc::new(OnceLock::new());
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
            move |_, terminal| {
                let expected = if fail {
                    matches!(terminal, Terminal::Retried { attempts: 1, .. })
                } else {
                    matches!(terminal, Terminal::Handled { attempt: 1 })
                };
                if expected && ended.fetch_add(1, Ordering::Relaxed) + 1 == n {
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
    Ok(Timing::new(start, first.get().copied().unwrap_or(end), end))
}

/// One measurement of `path` on queues of its own, deleted afterwards.
async fn measure(
    setup: &AmqpTransport,
    channel: &Channel,
    path: &str,
    round: usize,
    n: u64,
) -> Result<Timing, BoxError> {
    let queue = format!("amqp10-throughput-{}-{round}-{path}", std::process::id());
    let policy = RetryPolicy::delays([DELAY]).build()?;
    let plan = TopologyPlan::new(&queue, &policy)?;
    setup.provision(&plan).await?;
    let outcome = async {
        let delay_queue = plan
            .queues()
            .iter()
            .find(|q| matches!(q.role, QueueRole::Delay { .. }))
            .map(|q| q.name.clone())
            .ok_or("the plan has no delay queue")?;
        prefill(channel, &queue, n, |i| {
            (BODY, persistent().with_message_id(format!("m{i}").into()))
        })
        .await?;
        let measuring = async {
            match path {
                "plain-accept-each" => plain_success(&queue, n, false).await,
                "plain-accept-batched" => plain_success(&queue, n, true).await,
                "ours-success" => ours(&queue, &policy, n, false).await,
                "plain-retry-eager" => {
                    plain_retry(&queue, &delay_queue, n, u32::from(PREFETCH), false).await
                }
                "plain-retry-half" => {
                    plain_retry(&queue, &delay_queue, n, u32::from(PREFETCH / 2), false).await
                }
                "plain-retry-headers" => {
                    plain_retry(&queue, &delay_queue, n, u32::from(PREFETCH / 2), true).await
                }
                "ours-retry" => ours(&queue, &policy, n, true).await,
                other => Err(format!("unknown path {other}").into()),
            }
        };
        let cpu = CpuClock::start();
        let mut timing = tokio::time::timeout(BOUND, measuring)
            .await
            .map_err(|_| format!("{path} did not finish within {BOUND:?}"))??;
        let used = cpu.used();
        if let (Some(client), Some(broker)) = (used.client, used.broker) {
            timing.cpu = Some((client.as_secs_f64(), broker.as_secs_f64()));
        }
        let left = wait_for_count(channel, &queue, 0, SETTLING).await?;
        if left != 0 {
            return Err(format!("{path}: {left} messages left in the work queue").into());
        }
        if path.contains("retry") {
            let clones = wait_for_count(channel, &delay_queue, n as u32, SETTLING).await?;
            if u64::from(clones) != n {
                return Err(format!("{path}: {clones} clones in the delay queue, not {n}").into());
            }
        }
        Ok::<_, BoxError>(timing)
    }
    .await;
    setup.teardown(&plan).await?;
    outcome
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = Args::new("usage: amqp10_throughput [MESSAGES] [ROUNDS] [PATHS]");
    let n: u64 = args.positional(20_000)?;
    let rounds: usize = args.positional(3)?;
    // Only these paths (comma-separated), for profiling one; the table and ratios need all.
    let only: Option<Vec<String>> = args
        .next()
        .map(|a| a.split(',').map(str::to_owned).collect());
    if n == 0 || n > u64::from(u32::MAX) || rounds == 0 {
        return Err("MESSAGES and ROUNDS must be at least 1".into());
    }
    let setup = AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?;
    let channel = confirm_channel(&setup.connection()).await?;
    println!(
        "{n} persistent 256-byte messages, prefetch {PREFETCH}, {rounds} rounds; load average {}",
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
            let timing = measure(&setup, &channel, path, round, n).await?;
            // Microseconds of CPU per message, this process and the broker.
            let cpu = timing.cpu.map_or_else(
                || "?".into(),
                |(c, b)| format!("{:.0} + {:.0}", c * 1e6 / n as f64, b * 1e6 / n as f64),
            );
            let total = n as f64 / timing.total.as_secs_f64();
            let steady = n as f64 / timing.steady.as_secs_f64();
            println!(
                "round {}: {path:<21} total {total:>7.0} msg/s ({:.2} s), steady {steady:>7.0} msg/s; cpu µs/msg client + broker {cpu}; load {}",
                round + 1,
                timing.total.as_secs_f64(),
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
            &[("success", 2, &[0, 1][..]), ("retry", 5, &[3, 4][..])]
        )
    );
    println!();
    println!("load average at the end {}", load_average_shown());
    let _ = channel.close(200, "done".into()).await;
    Ok(())
}
