//! What a walk of a large parking queue costs on RabbitMQ: time and this process's memory.
//!
//! ```sh
//! cargo run --release -p transport-amqp091 --example parking_walk -- 10000 100000 1000000
//! ```
//!
//! For each size N it parks N persistent 1 KiB messages in a parking queue of its own, then,
//! in the same run:
//!
//! * **baseline**, the strongest plain lapin a user would write to look at every message
//!   and leave it: `basic.get` each one without acknowledging it, then close the channel,
//!   which puts them all back at once (a `basic.nack` with `multiple` would take RabbitMQ
//!   3.10 quadratic time: 33 s for 10,000);
//! * **browse**, `ParkingLot::browse` over every message (the `retryctl parked list` path);
//! * **replay by filter**, `ParkingLot::replay` of the one message in a thousand parked for
//!   another reason, which walks the whole queue and leaves the rest.
//!
//! Each size runs the three `ROUNDS` times (default 2), interleaved. It prints each run's rate and the growth of
//! the process's peak resident memory (`VmHWM`) over the runs so far, then deletes its
//! queues. `AMQP_URL` names the broker.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench_support::BoxError;
use bench_support::args::env_or;
use bench_support::proc::{load1_shown, peak_rss};
use bench_support::publish::{confirm_channel, persistent, prefill};
use bench_support::queue::plain_walk;
use bench_support::url::amqp_url;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ConnectionProperties};
use retry_core::{
    DeadLetterReason, ParkedFilter, ParkedReason, ParkingLot, ReplayOptions, RetryPolicy,
    TopologyPlan, Transport,
};
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// Parks `n` messages in `queue`, one in a thousand for reason `permanent`.
async fn park(conn: &Connection, queue: &str, n: u64) -> Result<(), BoxError> {
    let ch = confirm_channel(conn).await?;
    let body = vec![b'x'; 1024];
    prefill(&ch, queue, n, |i| {
        let reason = if i % 1000 == 0 {
            "permanent"
        } else {
            "attempts-exhausted"
        };
        let mut headers = FieldTable::default();
        headers.insert(
            "x-retry-reason".into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        headers.insert("x-retry-attempts".into(), AMQPValue::LongLongInt(3));
        let properties = persistent()
            .with_message_id(format!("m{i}").into())
            .with_headers(headers);
        (&body, properties)
    })
    .await?;
    ch.close(200, "parked".into()).await?;
    Ok(())
}

fn line(what: &str, n: u64, took: Duration, base_rss: u64) {
    println!(
        "  {what:<18} {n:>8} messages in {:>7.2} s: {:>7.0} msg/s; peak RSS +{:.1} MB",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64(),
        peak_rss().saturating_sub(base_rss) as f64 / 1e6
    );
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let sizes: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let sizes = if sizes.is_empty() {
        vec![10_000]
    } else {
        sizes
    };
    let rounds: u32 = env_or("ROUNDS", 2)?;
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?);
    let policy = RetryPolicy::delays([Duration::from_secs(1)]).build()?;
    println!("load {} at start", load1_shown());
    for n in sizes {
        let plan = TopologyPlan::new(&format!("parking-walk-{n}"), &policy)?;
        transport.provision(&plan).await?;
        let queue = plan.parking_queue();
        park(&conn, queue, n).await?;
        let base = peak_rss();
        println!(
            "{n} parked messages of 1 KiB in {queue} (peak RSS {:.1} MB before the walks)",
            base as f64 / 1e6
        );

        let lot = ParkingLot::new(Arc::clone(&transport), &plan);
        let filter = ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent));
        for _round in 0..rounds {
            let t = Instant::now();
            let seen = plain_walk(&conn, queue).await?;
            line("plain lapin", seen, t.elapsed(), base);

            let t = Instant::now();
            let mut listed = 0;
            lot.browse(&ParkedFilter::all(), |_| {
                listed += 1;
                ControlFlow::Continue(())
            })
            .await?;
            line("browse", listed, t.elapsed(), base);

            let t = Instant::now();
            let report = lot
                .replay(&filter, ReplayOptions::default(), |_| {})
                .await?;
            line("replay by filter", report.seen, t.elapsed(), base);
            println!(
                "  replayed {}, left {}; load {}",
                report.replayed,
                report.left,
                load1_shown()
            );
        }
        transport.teardown(&plan).await?;
    }
    (*transport).close().await?;
    conn.close(200, "done".into()).await?;
    Ok(())
}
