//! What re-verifying addresses costs on the retry path, against a local RabbitMQ 3.x.
//!
//! ```sh
//! rabbitmq-plugins enable rabbitmq_amqp1_0
//! cargo run --release -p transport-amqp10 --example reverify_cost -- [MESSAGES] [ROUNDS]
//! ```
//!
//! Each round runs a [`Consumer`] whose handler always fails transiently over `MESSAGES`
//! messages (default 20 000) waiting in its work queue: every message takes the retry path, a
//! clone sent to the delay queue and confirmed, then the original acknowledged. The rounds
//! alternate between re-verification at the default age (5 s) and effectively never
//! (`Duration::MAX`: each address is verified once, when the consumer starts), `ROUNDS` times
//! each (default 3), and print messages per second and the ratio. A round is timed from
//! the consumer's start to its last terminal, so it includes the one verification of the
//! plan that both settings make; the messages are published over AMQP 0-9-1 beforehand and
//! not timed.
//!
//! The suspect poll is set to an hour so that no look at the (empty) isolation queue
//! pauses the work lane in either setting. The delay is an hour: no clone comes back during
//! a run; each round's clones are purged after it. `AMQP10_URL` and `AMQP_URL` as for the
//! `consumer` example; the topology is declared under a unique name and deleted at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bench_support::BoxError;
use bench_support::args::Args;
use bench_support::publish::{confirm_channel, prefill};
use bench_support::stats::min_median_max;
use bench_support::url::{amqp_url, amqp10_url};
use lapin::BasicProperties;
use lapin::options::QueuePurgeOptions;
use retry_core::{
    Consumer, HandlerError, Message, QueueRole, RetryPolicy, TopologyPlan, Transport,
};
use tokio::sync::Notify;
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const PREFETCH: u16 = 50;

async fn fails(_msg: Message) -> Result<(), HandlerError> {
    Err(HandlerError::transient("measuring the retry path"))
}

/// Publishes `n` small messages to `queue` over AMQP 0-9-1, confirms pipelined.
async fn fill(setup: &AmqpTransport, queue: &str, n: u64) -> Result<(), BoxError> {
    let channel = confirm_channel(&setup.connection()).await?;
    prefill(&channel, queue, n, |i| {
        let body = format!("message {i:>8} of the re-verification benchmark");
        (body, BasicProperties::default())
    })
    .await?;
    let _ = channel.close(200, "filled".into()).await;
    Ok(())
}

/// One round: the consumer over `n` messages with re-verification at `age`. Messages per
/// second, and how long it took.
async fn round(
    url10: &str,
    queue: &str,
    policy: &RetryPolicy,
    age: Duration,
    n: u64,
) -> Result<(f64, Duration), BoxError> {
    let config = Amqp10Config::new(url10).with_reverify_after(age);
    let transport = Arc::new(Amqp10Transport::connect(config).await?);
    let retried = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let consumer = Consumer::builder(Arc::clone(&transport), queue, policy.clone(), fails)
        .with_prefetch(PREFETCH)
        .with_provision(false)
        .with_suspect_poll(Duration::from_secs(3_600))
        .with_on_terminal({
            let retried = Arc::clone(&retried);
            let done = Arc::clone(&done);
            move |_, _| {
                if retried.fetch_add(1, Ordering::Relaxed) + 1 == n {
                    done.notify_one();
                }
            }
        })
        .build()?;
    // Bounded: a round that stalls ends after 10 minutes, and is reported as failed.
    let shutdown = {
        let done = Arc::clone(&done);
        async move {
            let _ = tokio::time::timeout(Duration::from_secs(600), done.notified()).await;
        }
    };
    let started = Instant::now();
    let report = consumer.run(shutdown).await?;
    let took = started.elapsed();
    transport.close().await;
    if report.retried != n || report.accounted() != report.received {
        return Err(format!("the round did not retry all {n} messages: {report:?}").into());
    }
    Ok((n as f64 / took.as_secs_f64(), took))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (url10, url091) = (amqp10_url(), amqp_url());
    let mut args = Args::new("usage: reverify_cost [MESSAGES] [ROUNDS]");
    let n: u64 = args.positional(20_000)?;
    let rounds: u32 = args.positional(3)?;
    if n == 0 || rounds == 0 {
        return Err("MESSAGES and ROUNDS must be at least 1".into());
    }

    let queue = format!("amqp10-reverify-cost-{}", std::process::id());
    let policy = RetryPolicy::delays([Duration::from_secs(3_600)]).build()?;
    let plan = TopologyPlan::new(&queue, &policy)?;
    let setup = AmqpTransport::connect(AmqpConfig::new(url091)).await?;
    setup.provision(&plan).await?;
    let outcome = measure(&setup, &url10, &queue, &policy, &plan, n, rounds).await;
    setup.teardown(&plan).await?;
    outcome
}

async fn measure(
    setup: &AmqpTransport,
    url10: &str,
    queue: &str,
    policy: &RetryPolicy,
    plan: &TopologyPlan,
    n: u64,
    rounds: u32,
) -> Result<(), BoxError> {
    let delay_queue = plan
        .queues()
        .iter()
        .find(|q| matches!(q.role, QueueRole::Delay { .. }))
        .map(|q| q.name.clone())
        .ok_or("the plan has no delay queue")?;
    let purge = setup.connection().create_channel().await?;
    // The first two are compared; 100 ms shows how the cost grows with probing.
    let settings = [
        ("default (5 s)", Duration::from_secs(5)),
        ("never (MAX)", Duration::MAX),
        ("100 ms", Duration::from_millis(100)),
    ];
    println!(
        "retry path (clone to the delay queue + ack), {n} messages a round, prefetch {PREFETCH}"
    );
    // A warm-up round, not counted: connections, the broker's queue processes, caches.
    let warm_up = (n / 10).max(1);
    fill(setup, queue, warm_up).await?;
    round(url10, queue, policy, Duration::from_secs(5), warm_up).await?;
    purge
        .queue_purge(delay_queue.as_str().into(), QueuePurgeOptions::default())
        .await?;
    let mut ratios = Vec::new();
    for r in 1..=rounds {
        // Each round starts with another setting, so that none always runs first.
        let mut rates = [0.0; 3];
        for k in 0..settings.len() {
            let i = (k + r as usize - 1) % settings.len();
            let (name, age) = settings[i];
            fill(setup, queue, n).await?;
            let (rate, took) = round(url10, queue, policy, age, n).await?;
            purge
                .queue_purge(delay_queue.as_str().into(), QueuePurgeOptions::default())
                .await?;
            println!(
                "round {r}: re-verify {name:<14} {rate:>8.0} msg/s ({:.1} s)",
                took.as_secs_f64()
            );
            rates[i] = rate;
        }
        let ratio = rates[0] / rates[1];
        println!("round {r}: default / never = {ratio:.3}");
        ratios.push(ratio);
    }
    let (min, _, max) = min_median_max(ratios);
    println!("default / never over {rounds} rounds: min {min:.3}, max {max:.3}");
    Ok(())
}
