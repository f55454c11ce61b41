//! How accurately each delay strategy returns a retry whose delay is not one of the policy's
//! levels, on the local RabbitMQ: the per-delay-queue topology beside the binary cascade,
//! measured in the same run.
//!
//! ```sh
//! cargo run --release -p transport-amqp091 --example delay_accuracy     # 2000 at 500/s, 2 rounds
//! cargo run --release -p transport-amqp091 --example delay_accuracy -- --n 500 --rate 250 --rounds 1
//! ```
//!
//! N persistent messages are published in random order, at a steady rate (default 2,000 at
//! 500 msg/s) while the consumer runs. Each one's handler fails its first run with a
//! `retry_after` of its own, spread evenly over 0.1–10 s, and succeeds the second. The policy is the same for both strategies: delay
//! levels [1 s, 10 s] with full jitter, so a `retry_after` anywhere in 0–10 s is taken as
//! asked.
//!
//! * `per-delay`: the levels' TTL queues, 1 s and 10 s; a delay goes to the smallest level
//!   that holds it, with a per-message expiration.
//! * `cascade`: the binary cascade with its default 10 ms unit (10 levels hold 10.23 s).
//!
//! For each message, `lateness = second run - first run - asked delay` (the cascade's
//! rounding up to its unit is part of it). `overtaken` is the fraction of messages that came
//! back after a message that was due later than them (due = first run + asked delay) by at
//! least a margin: one unit (10 ms), and 100 ms. A retry held behind a longer one is
//! overtaken by seconds; the cascade's clones differ only in how many levels they pass
//! through. `hops` is that number (the set bits of the delay in units); the target for the
//! cascade's p99 is 20 ms + 2 ms per hop, at the most hops any message made, and the mean
//! lateness by hop count is printed under each cascade row. `ahead` is the fraction that
//! came back before a message published earlier (to the work queue) with a shorter asked
//! delay.
//!
//! Rounds alternate which strategy goes first; each uses queues and a cascade of its own and
//! deletes them. Consumer prefetch is 200. `AMQP_URL` picks the broker.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bench_support::BoxError;
use bench_support::args::Args;
use bench_support::proc::load1_shown;
use bench_support::publish::publish_paced;
use bench_support::stats::percentiles;
use bench_support::url::amqp_url;
use lapin::{Connection, ConnectionProperties};
use retry_core::{
    Cascade, Consumer, DelayStrategy, HandlerError, Jitter, Message, RetryPolicy, Terminal,
    TopologyPlan, Transport, splitmix64,
};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const PREFETCH: u16 = 200;
const UNIT: Duration = Duration::from_millis(10);
const LEVELS: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(10)];
const SHORTEST: Duration = Duration::from_millis(100);
const USAGE: &str = "usage: delay_accuracy [--n N] [--rate R] [--rounds R]";

/// The asked delay of message `i` of `n`: evenly spread over 0.1–10 s.
fn asked(i: u64, n: u64) -> Duration {
    let span = LEVELS[1] - SHORTEST;
    SHORTEST + span.mul_f64(i as f64 / (n - 1).max(1) as f64)
}

/// Message indices in a random order (a seeded Fisher–Yates shuffle).
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n).collect();
    let mut state = seed;
    for i in (1..order.len()).rev() {
        state = splitmix64(state);
        let j = (state % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// When each message's first and second runs started.
#[derive(Default)]
struct Runs {
    first: HashMap<u64, Instant>,
    back: HashMap<u64, Instant>,
}

/// One strategy's figures.
struct Figures {
    /// p50, p99, max lateness in ms.
    lateness: (f64, f64, f64),
    /// Fractions of messages overtaken by one due at least a unit, and 100 ms, later.
    overtaken: [f64; 2],
    /// Fraction of messages back before one published earlier with a shorter delay.
    ahead: f64,
    /// Mean lateness in ms by hop count (cascade only).
    by_hops: Vec<(u32, f64)>,
    /// Most and mean level hops (cascade only).
    hops: Option<(u32, f64)>,
}

/// Runs the N messages through `strategy` and measures them.
async fn measure(
    conn: &Connection,
    tag: &str,
    strategy: DelayStrategy,
    n: u64,
    rate: f64,
) -> Result<Figures, BoxError> {
    let work = format!("accuracy-{tag}");
    let policy = RetryPolicy::delays(LEVELS)
        .with_jitter(Jitter::Full)
        .build()?;
    let plan = TopologyPlan::builder(&work, &policy)
        .with_strategy(strategy.clone())
        .build()?;
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?);
    transport.provision(&plan).await?;

    let result = async {
        let runs = Arc::new(Mutex::new(Runs::default()));
        let handled = Arc::new(AtomicU64::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let runs = Arc::clone(&runs);
            move |m: Message| {
                let now = Instant::now();
                let i: u64 = m
                    .properties()
                    .message_id
                    .as_deref()
                    .and_then(|id| id.parse().ok())
                    .unwrap_or(u64::MAX);
                let mut runs = runs.lock().unwrap_or_else(|e| e.into_inner());
                let result = if m.attempt() == 1 {
                    runs.first.insert(i, now);
                    Err(HandlerError::retry_after(asked(i, n), "asked to wait"))
                } else {
                    runs.back.insert(i, now);
                    Ok(())
                };
                async move { result }
            }
        };
        let (count, notify) = (Arc::clone(&handled), Arc::clone(&done));
        let consumer = Consumer::builder(Arc::clone(&transport), &work, policy, handler)
            .with_prefetch(PREFETCH)
            .with_provision(false)
            .with_topology(move |b| b.with_strategy(strategy))
            .with_on_terminal(move |_, t| {
                if matches!(t, Terminal::Handled { .. })
                    && count.fetch_add(1, Ordering::Relaxed) + 1 == n
                {
                    notify.notify_one();
                }
            })
            .build()?;
        let stop = async {
            let all = done.notified();
            let within = LEVELS[1] * 2 + Duration::from_secs_f64(n as f64 / rate);
            if tokio::time::timeout(within, all).await.is_err() {
                eprintln!("{work}: not every message came back within {within:?}");
            }
        };
        let order = shuffled(n, 0x5eed);
        let (fed, report) = tokio::join!(
            publish_paced(conn, &work, order.iter().copied(), b"retry", rate),
            consumer.run(stop)
        );
        fed?;
        let report = report?;
        if report.handled != n || report.retried != n {
            return Err(format!("{n} messages, but the consumer reports {report:?}").into());
        }
        let runs = std::mem::take(&mut *runs.lock().unwrap_or_else(|e| e.into_inner()));
        let mut figures = figures(&runs, n, plan.cascade());
        figures.ahead = ahead_of_earlier_shorter(&runs, &order);
        Ok::<_, BoxError>(figures)
    }
    .await;
    transport.teardown(&plan).await?;
    if let Some(cascade) = plan.cascade() {
        transport.teardown_cascade(cascade).await?;
    }
    (*transport).close().await?;
    result
}

/// The fraction of messages that came back before a message published earlier (in
/// `order`) with a shorter asked delay: it should have come back first.
fn ahead_of_earlier_shorter(runs: &Runs, order: &[u64]) -> f64 {
    let back: Vec<Instant> = order.iter().map(|i| runs.back[i]).collect();
    // Message index i asks for a longer delay than index j < i.
    let ahead = (0..order.len())
        .filter(|&x| (0..x).any(|y| order[y] < order[x] && back[x] < back[y]))
        .count();
    ahead as f64 / order.len() as f64
}

fn figures(runs: &Runs, n: u64, cascade: Option<&retry_core::CascadePlan>) -> Figures {
    // (due, back, lateness in ms, hops)
    let mut rows: Vec<(Instant, Instant, f64, u32)> = (0..n)
        .filter_map(|i| {
            let (first, back) = (runs.first.get(&i)?, runs.back.get(&i)?);
            let delay = asked(i, n);
            let late = back.duration_since(*first).as_secs_f64() - delay.as_secs_f64();
            let hops = cascade.map_or(0, |c| c.hops(delay));
            Some((*first + delay, *back, late * 1e3, hops))
        })
        .collect();
    assert_eq!(rows.len() as u64, n, "every message ran twice");
    // In the order they came back: overtaken if a message back earlier was due `margin`
    // later.
    rows.sort_by_key(|r| r.1);
    let overtaken = [UNIT, Duration::from_millis(100)].map(|margin| {
        let mut latest_due: Option<Instant> = None;
        let mut overtaken = 0u64;
        for (due, _, _, _) in &rows {
            if latest_due.is_some_and(|l| l >= *due + margin) {
                overtaken += 1;
            }
            latest_due = Some(latest_due.map_or(*due, |l| l.max(*due)));
        }
        overtaken as f64 / n as f64
    });
    let hops = cascade.map(|_| {
        let most = rows.iter().map(|r| r.3).max().unwrap_or(0);
        let mean = rows.iter().map(|r| f64::from(r.3)).sum::<f64>() / rows.len() as f64;
        (most, mean)
    });
    let mut by_hops: std::collections::BTreeMap<u32, (f64, u32)> = Default::default();
    if cascade.is_some() {
        for r in &rows {
            let e = by_hops.entry(r.3).or_default();
            *e = (e.0 + r.2, e.1 + 1);
        }
    }
    Figures {
        lateness: percentiles(rows.iter().map(|r| r.2).collect()),
        overtaken,
        ahead: 0.0,
        by_hops: by_hops
            .into_iter()
            .map(|(h, (sum, count))| (h, sum / f64::from(count)))
            .collect(),
        hops,
    }
}

fn row(out: &mut String, label: &str, f: &Figures) {
    let (p50, p99, max) = f.lateness;
    let hops = f.hops.map_or("-".to_owned(), |(most, mean)| {
        format!("{most} (mean {mean:.1})")
    });
    let _ = writeln!(
        out,
        "  {label:<12}{p50:>10.1}{p99:>10.1}{max:>10.1}{:>11.2}%{:>11.2}%{:>11.2}%  {hops}",
        f.overtaken[0] * 100.0,
        f.overtaken[1] * 100.0,
        f.ahead * 100.0
    );
    if !f.by_hops.is_empty() {
        let means: Vec<String> = f
            .by_hops
            .iter()
            .map(|(h, mean)| format!("{h}: {mean:.1}"))
            .collect();
        let _ = writeln!(out, "    mean lateness by hops, ms: {}", means.join(", "));
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (mut n, mut rate, mut rounds) = (2_000u64, 500.0f64, 2usize);
    let mut args = Args::new(USAGE);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--n" => n = args.value(&arg)?,
            "--rate" => rate = args.value(&arg)?,
            "--rounds" => rounds = args.value(&arg)?,
            other => return Err(args.unknown(other)),
        }
    }
    if n < 2 || rounds == 0 || rate <= 0.0 {
        return Err(
            format!("N must be at least 2, the rate and the rounds positive; {USAGE}").into(),
        );
    }
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let pid = std::process::id();
    let mut out = format!(
        "retry_after spread over 0.1-10 s, {n} persistent messages in random order at {rate} msg/s, prefetch {PREFETCH}\n\
         lateness = second run - first run - asked delay (ms); overtaken = came back after a message due >= 10 ms (or 100 ms) later;\n\
         ahead = came back before a message published earlier with a shorter delay\n"
    );
    let _ = writeln!(
        out,
        "  {:<12}{:>10}{:>10}{:>10}{:>12}{:>12}{:>12}  hops (most)",
        "", "p50", "p99", "max", "over 10ms", "over 100ms", "ahead"
    );
    for round in 1..=rounds {
        let tag = format!("{pid}-{round}");
        let cascade = DelayStrategy::Cascade(
            Cascade::new()
                .with_unit(UNIT)
                .with_prefix(format!("accuracy-{tag}.cascade")),
        );
        let per_delay = DelayStrategy::PerDelayQueue;
        let load_before = load1_shown();
        let (p, c) = if round % 2 == 1 {
            let p = measure(&conn, &format!("{tag}-per-delay"), per_delay, n, rate).await?;
            (
                p,
                measure(&conn, &format!("{tag}-cascade"), cascade, n, rate).await?,
            )
        } else {
            let c = measure(&conn, &format!("{tag}-cascade"), cascade, n, rate).await?;
            (
                measure(&conn, &format!("{tag}-per-delay"), per_delay, n, rate).await?,
                c,
            )
        };
        let _ = writeln!(
            out,
            "round {round} (load {load_before} -> {})",
            load1_shown()
        );
        row(&mut out, "per-delay", &p);
        row(&mut out, "cascade", &c);
        if let Some((most, _)) = c.hops {
            let target = 20.0 + 2.0 * f64::from(most);
            let _ = writeln!(
                out,
                "  cascade p99 target: 20 ms + 2 ms x {most} hops = {target:.0} ms: {}",
                if c.lateness.1 <= target {
                    "met"
                } else {
                    "missed"
                }
            );
        }
        eprintln!(
            "round {round}: per-delay p99 {:.1} ms, cascade p99 {:.1} ms",
            p.lateness.1, c.lateness.1
        );
    }
    conn.close(200, "done".into()).await?;
    print!("{out}");
    Ok(())
}
