//! The retry consumer's throughput on the local three-node cluster (quorum queues replicated
//! to all three nodes) beside the machine's own single node (classic queues), measured in the
//! same run, rounds interleaved.
//!
//! ```sh
//! stress/cluster.sh up
//! AMQP_CLUSTER_URLS=$(stress/cluster.sh urls) cargo run --release -p transport-amqp091 --example cluster_throughput -- 20000 3
//! ```
//!
//! Arguments: messages per measurement (default 20,000) and rounds (default 3). Each
//! measurement gets queues of its own, prefilled with that many persistent 256-byte
//! messages, consumed with prefetch 100 by the retry consumer with a handler that succeeds
//! (success path) or fails the first run (retry path: a confirmed clone to the 1 h delay
//! queue, then the ack). The clock runs from just before consuming starts until `run`
//! returns. `AMQP_URL` is the single node (default the machine's broker on 5672).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bench_support::BoxError;
use bench_support::args::Args;
use bench_support::publish::{confirm_channel, persistent, prefill};
use bench_support::url::amqp_url;
use lapin::{Connection, ConnectionProperties};
use retry_core::{
    Consumer, HandlerError, Message, QueueType, RetryPolicy, TopologyPlan, Transport,
};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const PREFETCH: u16 = 100;
const DELAY: Duration = Duration::from_secs(3600);

/// Where a measurement runs: the single node (classic queues) or the cluster (quorum).
#[derive(Clone, Copy)]
struct Setup {
    cluster: bool,
}

const SETUPS: [Setup; 2] = [Setup { cluster: false }, Setup { cluster: true }];

fn urls(cluster: bool) -> String {
    if cluster {
        std::env::var("AMQP_CLUSTER_URLS").expect("AMQP_CLUSTER_URLS (stress/cluster.sh urls)")
    } else {
        amqp_url()
    }
}

fn plan(setup: Setup, queue: &str, policy: &RetryPolicy) -> Result<TopologyPlan, BoxError> {
    let builder = TopologyPlan::builder(queue, policy);
    let builder = if setup.cluster {
        builder
            .with_queue_type(QueueType::Quorum)
            .with_replication_factor(3)
    } else {
        builder.with_queue_type(QueueType::Classic)
    };
    Ok(builder.build()?)
}

/// Prefills `queue` with `n` persistent 256-byte messages through the first node of `url`.
async fn fill(url: &str, queue: &str, n: u64) -> Result<(), BoxError> {
    let first = url.split(',').next().unwrap_or(url);
    let conn = Connection::connect(first, ConnectionProperties::default()).await?;
    let ch = confirm_channel(&conn).await?;
    prefill(&ch, queue, n, |i| {
        (
            [b'x'; 256],
            persistent().with_message_id(format!("m-{i}").into()),
        )
    })
    .await?;
    conn.close(200, "prefilled".into()).await?;
    Ok(())
}

/// One measurement: msg/s of the retry consumer on fresh queues.
async fn measure(setup: Setup, retry: bool, round: usize, n: u64) -> Result<f64, BoxError> {
    let url = urls(setup.cluster);
    let policy = RetryPolicy::delays([DELAY]).build()?;
    let path = if retry { "retry" } else { "success" };
    let q = format!(
        "bench-cluster-{}-{round}-{}-{path}",
        std::process::id(),
        setup.cluster
    );
    let plan = plan(setup, &q, &policy)?;
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(url.clone())).await?);
    transport.provision(&plan).await?;
    fill(&url, &q, n).await?;
    let settled = Arc::new(AtomicU64::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let (s, d) = (Arc::clone(&settled), Arc::clone(&done));
    let handler = move |m: Message| async move {
        if retry && m.attempt() == 1 {
            Err(HandlerError::transient("first run fails"))
        } else {
            Ok(())
        }
    };
    let queue_type = plan.queue_type();
    let consumer = Consumer::builder(Arc::clone(&transport), &q, policy, handler)
        .with_prefetch(PREFETCH)
        .with_topology(move |t| {
            let t = t.with_queue_type(queue_type);
            if queue_type == QueueType::Quorum {
                t.with_replication_factor(3)
            } else {
                t
            }
        })
        .with_provision(false)
        .with_on_terminal(move |_, _| {
            if s.fetch_add(1, Ordering::Relaxed) + 1 == n {
                d.notify_one();
            }
        })
        .build()?;
    let started = Instant::now();
    let report = consumer.run(done.notified()).await?;
    let took = started.elapsed();
    let expected = if retry {
        report.retried
    } else {
        report.handled
    };
    transport.teardown(&plan).await?;
    (*transport).close().await?;
    if expected != n {
        return Err(format!("{n} messages, but the consumer reports {report:?}").into());
    }
    Ok(n as f64 / took.as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = Args::new("usage: cluster_throughput [MESSAGES] [ROUNDS]");
    let n: u64 = args.positional(20_000)?;
    let rounds: usize = args.positional(3)?;
    println!(
        "{n} persistent 256-byte messages per measurement, prefetch {PREFETCH}, {rounds} rounds"
    );
    println!(
        "| round | path | single node, classic | 3-node cluster, quorum x3 | cluster / single |"
    );
    println!("|---|---|---|---|---|");
    for round in 1..=rounds {
        for retry in [false, true] {
            // Alternate which setup goes first, round by round.
            let order = if round % 2 == 1 { [0, 1] } else { [1, 0] };
            let mut rates = [0.0; 2];
            for i in order {
                rates[i] = measure(SETUPS[i], retry, round, n).await?;
            }
            println!(
                "| {round} | {} | {:.0} msg/s | {:.0} msg/s | {:.2}x |",
                if retry { "retry" } else { "success" },
                rates[0],
                rates[1],
                rates[1] / rates[0]
            );
        }
    }
    Ok(())
}
