//! The retry consumer's throughput on the local three-node cluster (quorum queues replicated
//! to all three nodes) beside the machine's own single node (classic queues), measured in the
//! same run, rounds interleaved.
//!
//! ```sh
//! tests/cluster.sh up
//! AMQP_CLUSTER_URLS=$(tests/cluster.sh urls) cargo run --release -p transport-amqp091 --example cluster_throughput -- 20000 3
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

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use retry_core::{
    Consumer, HandlerError, Message, QueueType, RetryPolicy, TopologyPlan, Transport,
};
use transport_amqp091::{AmqpConfig, AmqpTransport};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
        std::env::var("AMQP_CLUSTER_URLS").expect("AMQP_CLUSTER_URLS (tests/cluster.sh urls)")
    } else {
        std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
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

async fn prefill(url: &str, queue: &str, n: u64) -> Result<(), BoxError> {
    let first = url.split(',').next().unwrap_or(url);
    let conn = Connection::connect(first, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = [b'x'; 256];
    let mut confirms = Vec::with_capacity(1_000);
    for i in 0..n {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(format!("m-{i}").into());
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await?,
        );
        if confirms.len() == 1_000 {
            for c in confirms.drain(..) {
                c.await?;
            }
        }
    }
    for c in confirms {
        c.await?;
    }
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
    prefill(&url, &q, n).await?;
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
    transport.close().await?;
    if expected != n {
        return Err(format!("{n} messages, but the consumer reports {report:?}").into());
    }
    Ok(n as f64 / took.as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(20_000);
    let rounds: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(3);
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
