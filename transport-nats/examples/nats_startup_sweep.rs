//! What the quarantine sweep before a queue's first read costs a consumer's start: the time
//! `consume` takes on a work queue whose consumer has `K` messages handed out and not acked
//! (a process before this one died holding them), for several `K`.
//!
//! ```sh
//! cargo run --release -p transport-nats --example nats_startup_sweep            # K = 0, 20, 200, 2000; 5 rounds
//! cargo run --release -p transport-nats --example nats_startup_sweep -- --rounds 3
//! ```
//!
//! Each round and `K` gets a work queue of its own with `K + 10` messages of 100 bytes; a
//! plain async-nats client pulls `K` of them through the queue's consumer and goes away
//! without acking, so they stay handed out for the ack wait (60 s here). A new transport then
//! connects and provisions (not timed), and `consume` is timed: the consumer lookup, the
//! sweep (one consumer-info request and one `MSG.GET` per handed-out message) and the start
//! of the subscription. The table shows the median and the largest over the rounds, and
//! what each handed-out message added to the median against `K = 0`. `NATS_URL` picks the
//! server.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use retry_core::{RetryPolicy, TopologyPlan, Transport};
use test_brokers::nats_url;
use transport_nats::testing;
use transport_nats::{NatsConfig, NatsTransport, stream_name};

const ACK_WAIT: Duration = Duration::from_secs(60);

fn config() -> NatsConfig {
    NatsConfig::new(nats_url()).with_ack_wait(ACK_WAIT)
}

/// The time `consume` took on a fresh queue with `handed_out` messages handed out.
async fn one(handed_out: usize, round: usize) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let queue = format!("sweep-cost-{handed_out}-{round}-{nanos:x}");
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("a policy");
    let plan = TopologyPlan::new(&queue, &policy).expect("a plan");
    let admin = NatsTransport::connect(config()).await.expect("connect");
    admin.provision(&plan).await.expect("provision");
    let js = async_nats::jetstream::new(admin.client().clone());
    let body = vec![b'x'; 100];
    let mut acks = Vec::new();
    for _ in 0..handed_out + 10 {
        acks.push(
            js.publish(queue.clone(), body.clone().into())
                .await
                .expect("publish"),
        );
    }
    for ack in acks {
        ack.await.expect("stored");
    }
    if handed_out > 0 {
        let dead = async_nats::connect(nats_url()).await.expect("connect");
        let consumer: async_nats::jetstream::consumer::PullConsumer =
            async_nats::jetstream::new(dead.clone())
                .get_stream(stream_name(&queue))
                .await
                .expect("the stream")
                .get_consumer(transport_nats::CONSUMER)
                .await
                .expect("its consumer");
        let mut batch = consumer
            .batch()
            .max_messages(handed_out)
            .expires(Duration::from_secs(10))
            .messages()
            .await
            .expect("a pull");
        let mut got = 0;
        while got < handed_out {
            batch.next().await.expect("a message").expect("no error");
            got += 1;
        }
        drop(batch);
        drop(dead);
    }

    let transport = NatsTransport::connect(config()).await.expect("connect");
    transport.provision(&plan).await.expect("provision");
    let started = Instant::now();
    let subscription = transport.consume(&queue, 20).await.expect("consume");
    let took = started.elapsed();
    drop(subscription);
    transport.close().await;
    testing::delete_plan(admin.client(), &plan).await;
    admin.close().await;
    took
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut rounds = 5;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--rounds N");
            }
            other => panic!("unknown argument {other:?}"),
        }
    }
    let sizes = [0usize, 20, 200, 2000];
    let mut medians = Vec::new();
    println!("| handed out | consume, median | consume, max | per handed-out message |");
    println!("|---:|---:|---:|---:|");
    for &k in &sizes {
        let mut times = Vec::new();
        for round in 0..rounds {
            times.push(one(k, round).await);
        }
        times.sort();
        let median = times[times.len() / 2];
        let max = times[times.len() - 1];
        medians.push(median);
        let per = if k == 0 {
            "-".to_owned()
        } else {
            let extra = median.saturating_sub(medians[0]);
            format!("{:.1} µs", extra.as_secs_f64() * 1e6 / k as f64)
        };
        println!(
            "| {k} | {:.2} ms | {:.2} ms | {per} |",
            median.as_secs_f64() * 1e3,
            max.as_secs_f64() * 1e3
        );
    }
}
