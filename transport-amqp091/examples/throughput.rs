//! Throughput against the local RabbitMQ: this crate's consumer against plain lapin loops,
//! measured in the same run on the same broker.
//!
//! ```sh
//! cargo run --release -p transport-amqp091 --example throughput -- 20000
//! ```
//!
//! (a) Success path: N prefilled messages (256-byte bodies, prefetch 100) consumed by
//!     * a plain lapin consumer that acks each delivery as it comes,
//!     * a plain lapin consumer that acks with `multiple` once per half prefetch window
//!       (the practical ceiling),
//!     * the retry consumer with a handler that succeeds.
//!
//! (b) Retry path: every message fails once and a copy goes to a delay queue, by
//!     * a plain lapin loop: publish the copy, wait for its confirm, then ack, one message
//!       after another,
//!     * the retry consumer.
//!
//! Each figure is the median of `ROUNDS` runs (default 3). `AMQP_URL` picks the broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, TopologyPlan, Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const PREFETCH: u16 = 100;
const BODY: [u8; 256] = [b'x'; 256];

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn channel(conn: &Connection) -> Result<Channel, BoxError> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(ch)
}

async fn prefill(ch: &Channel, queue: &str, n: u64) -> Result<(), BoxError> {
    for _ in 0..n {
        // Dropped confirms are collected by wait_for_confirms below.
        drop(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &BODY,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?,
        );
    }
    ch.wait_for_confirms().await?;
    Ok(())
}

async fn plain_queue(ch: &Channel, name: &str) -> Result<(), BoxError> {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Plain lapin: consume `n` and ack each (or every `batch`-th with `multiple`).
async fn plain_consume(
    conn: &Connection,
    queue: &str,
    n: u64,
    batch: u64,
) -> Result<Duration, BoxError> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let start = Instant::now();
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
    let took = start.elapsed();
    ch.close(200, "done".into()).await?;
    Ok(took)
}

/// Plain lapin: for each delivery, publish a copy to `delay`, wait for its confirm, ack.
async fn plain_retry(
    conn: &Connection,
    queue: &str,
    delay: &str,
    n: u64,
) -> Result<Duration, BoxError> {
    let ch = channel(conn).await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let start = Instant::now();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "plain-retry".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut count = 0;
    while let Some(d) = consumer.next().await {
        let d = d?;
        let confirm = ch
            .basic_publish(
                "".into(),
                delay.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &d.data,
                d.properties.clone(),
            )
            .await?
            .await?;
        assert!(confirm.is_ack());
        d.ack(BasicAckOptions::default()).await?;
        count += 1;
        if count == n {
            break;
        }
    }
    let took = start.elapsed();
    ch.close(200, "done".into()).await?;
    Ok(took)
}

/// The retry consumer: consume `n` from a provisioned plan; `fail` makes every first run fail.
async fn ours(
    transport: Arc<AmqpTransport>,
    policy: RetryPolicy,
    queue: &str,
    n: u64,
    fail: bool,
) -> Result<Duration, BoxError> {
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
    let consumer = Consumer::builder(transport, policy, handler)
        .queue(queue)
        .prefetch(PREFETCH)
        .provision(false)
        .on_terminal(move |_, _| {
            if s.fetch_add(1, Ordering::Relaxed) + 1 == n {
                d.notify_one();
            }
        })
        .build()?;
    let start = Instant::now();
    let finished = Arc::new(tokio::sync::Notify::new());
    let f = Arc::clone(&finished);
    let waiter = tokio::spawn(async move {
        done.notified().await;
        let took = start.elapsed();
        f.notify_one();
        took
    });
    let report = consumer.run(finished.notified()).await?;
    let took = waiter.await?;
    assert_eq!(report.handled + report.retried, n, "{report:?}");
    Ok(took)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let n: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(20_000);
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(3);
    let conn = Connection::connect(&url(), ConnectionProperties::default()).await?;
    let setup = channel(&conn).await?;
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(url())).await?);
    let tag = std::process::id();
    let (mut each, mut batched, mut ours_ok, mut plain_r, mut ours_r) =
        (vec![], vec![], vec![], vec![], vec![]);

    for round in 0..rounds {
        // (a) success path
        let q = format!("bench-{tag}-{round}-plain");
        plain_queue(&setup, &q).await?;
        prefill(&setup, &q, n).await?;
        each.push(plain_consume(&conn, &q, n, 1).await?);
        eprintln!("round {round}: plain ack-each {:?}", each.last());
        prefill(&setup, &q, n).await?;
        batched.push(plain_consume(&conn, &q, n, u64::from(PREFETCH / 2)).await?);
        eprintln!("round {round}: plain batched {:?}", batched.last());
        setup
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;

        let policy = RetryPolicy::delays([Duration::from_secs(3600)]).build()?;
        let q = format!("bench-{tag}-{round}-ours");
        let plan = TopologyPlan::new(&q, &policy)?;
        transport.provision(&plan).await?;
        prefill(&setup, &q, n).await?;
        ours_ok.push(ours(Arc::clone(&transport), policy.clone(), &q, n, false).await?);
        eprintln!(
            "round {round}: retry consumer, success {:?}",
            ours_ok.last()
        );

        // (b) retry path: copies go to the 1 h delay queue and stay there.
        prefill(&setup, &q, n).await?;
        ours_r.push(ours(Arc::clone(&transport), policy.clone(), &q, n, true).await?);
        eprintln!(
            "round {round}: retry consumer, retry path {:?}",
            ours_r.last()
        );
        prefill(&setup, &q, n).await?;
        plain_r.push(plain_retry(&conn, &q, &format!("{q}.retry.1h"), n).await?);
        eprintln!("round {round}: plain retry loop {:?}", plain_r.last());
        transport.teardown(&plan).await?;
    }

    let (each, batched, ours_ok) = (median(each), median(batched), median(ours_ok));
    let (plain_r, ours_r) = (median(plain_r), median(ours_r));
    println!("{n} messages of 256 bytes, prefetch {PREFETCH}, median of {rounds} rounds\n");
    println!("(a) success path                          msg/s");
    println!(
        "    plain lapin, ack each            {:>10.0}",
        rate(n, each)
    );
    println!(
        "    plain lapin, ack multiple per 50 {:>10.0}   (ceiling)",
        rate(n, batched)
    );
    println!(
        "    retry consumer                   {:>10.0}",
        rate(n, ours_ok)
    );
    println!(
        "    ratio to ceiling {:.2}x, to ack-each {:.2}x",
        rate(n, ours_ok) / rate(n, batched),
        rate(n, ours_ok) / rate(n, each)
    );
    println!("\n(b) retry path (fail once, copy to a delay queue, then ack)");
    println!(
        "    plain publish-confirm-ack loop   {:>10.0}",
        rate(n, plain_r)
    );
    println!(
        "    retry consumer                   {:>10.0}",
        rate(n, ours_r)
    );
    println!("    ratio {:.2}x", rate(n, ours_r) / rate(n, plain_r));
    Ok(())
}
