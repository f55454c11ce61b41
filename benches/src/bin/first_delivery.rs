//! Time to first delivery on every transport: how long the retry consumer takes from being
//! started to its first handler call, against the plain client's connect-and-consume, on
//! the same server in the same run.
//!
//! ```sh
//! cargo run --release -p benches --bin first_delivery                          # 5 rounds, every transport
//! cargo run --release -p benches --bin first_delivery -- 9                     # 9 rounds
//! cargo run --release -p benches --bin first_delivery -- 3 --transports nats,memory
//! ```
//!
//! Each measurement gets two plans of its own (`first-<transport>-<pid>-<round>-plain` and
//! `…-ours`, one delay level of 60 s, declared beforehand and deleted after), each work
//! queue holding one persistent message; the plain client and ours each consume from their
//! own, since on NATS a plain client's pull request outlives it on the server and would be
//! handed the consumer's message (back only after the ack wait). Then:
//!
//! * **ours, total** (`benches::ours::first_delivery`, one generic function over the
//!   transport's concrete type): from just before the transport connects to the first
//!   handler call: connecting, the consumer's own look at the plan (its default,
//!   provisioning, which finds every queue there), its first look at its isolation queue,
//!   subscribing and the delivery itself;
//! * **ours, from run**: the part of it from calling `Consumer::run`, on a transport that
//!   is already connected;
//! * **plain** (`benches::Subject::plain_first_delivery`): the plain client, from just
//!   before it connects to the first message in hand: lapin on `amqp091` (connection,
//!   channel, `basic.qos`, `basic.consume`), fe2o3-amqp on `amqp10` (a `TCP_NODELAY`
//!   stream, connection, session, a receiver with credit on `/amq/queue/<q>`), async-nats
//!   on `nats` (connection, the work stream's durable consumer, a continuous pull).
//!
//! Rounds are interleaved (every transport once in each round, the order rotated), and the
//! table shows min, median and max per row and the ratio of ours (total) to plain, per
//! round, against the goal: every consumer's first handler call within 50 ms of its start.
//! On `memory` (transport-memory's in-process broker, which is no `Subject`) there is no
//! plain client and no network: its row is the driver's own start, in wall-clock time,
//! timed by the same `benches::ours::first_call` as the others' from-run figure.
//!
//! `--transports` picks some of `amqp091`, `amqp10`, `nats` and `memory`, comma-separated.
//! `AMQP_URL`, `AMQP10_URL` and `NATS_URL` pick the servers (defaults: the local ones);
//! AMQP 1.0 needs RabbitMQ's `rabbitmq_amqp1_0` plugin. A transport whose server does not
//! answer in the first round is left out, with a line saying so.

use std::time::Duration;

use bench_support::args::Args;
use bench_support::stats::min_median_max;
use benches::amqp10::Amqp10;
use benches::amqp091::Amqp091;
use benches::nats::Nats;
use benches::ours::{self, FirstDelivery};
use benches::{BoxError, Subject, unknown_transport};
use retry_core::{RetryPolicy, TopologyPlan, Transport};
use transport_memory::{Broker, Outgoing};

/// A round of one transport that has not finished by then failed.
const BOUND: Duration = Duration::from_secs(30);
/// The goal: every consumer's first handler call within this of its start.
const GOAL: Duration = Duration::from_millis(50);
/// Rounds without an argument.
const ROUNDS: usize = 5;
/// The in-process transport, measured without a plain client.
const MEMORY: &str = "memory";

const USAGE: &str = "usage: first_delivery [ROUNDS] [--transports T,T,..]; \
                     T is amqp091, amqp10, nats or memory";

/// The policy of every plan: one delay level, long enough that nothing comes back.
fn policy() -> Result<RetryPolicy, BoxError> {
    Ok(RetryPolicy::delays([Duration::from_secs(60)]).build()?)
}

/// One round's figures for one transport.
#[derive(Clone, Copy, Debug)]
struct Figures {
    ours: FirstDelivery,
    plain: Option<Duration>,
}

/// One round on `S`: two plans, each work queue holding one message; the plain client on
/// one, ours on the other; both plans deleted after.
async fn measure<S: Subject>(subject: &S, name: &str) -> Result<Figures, BoxError> {
    let policy = policy()?;
    let plain_plan = TopologyPlan::new(&format!("{name}-plain"), &policy)?;
    let ours_plan = TopologyPlan::new(&format!("{name}-ours"), &policy)?;
    let measuring = async {
        for plan in [&plain_plan, &ours_plan] {
            subject.declare(plan).await?;
            subject.prefill(plan.work_queue(), 1, 1).await?;
        }
        let plain = subject
            .plain_first_delivery(plain_plan.work_queue())
            .await?;
        let ours = ours::first_delivery(subject, ours_plan.work_queue(), &policy).await?;
        Ok::<_, BoxError>(Figures {
            ours,
            plain: Some(plain),
        })
    };
    let result = match tokio::time::timeout(BOUND, measuring).await {
        Ok(result) => result,
        Err(_) => Err(format!("no first delivery within {BOUND:?}").into()),
    };
    // Both deleted whatever happened; the measurement's error is the one to tell.
    let deleted = (
        subject.delete(&plain_plan).await,
        subject.delete(&ours_plan).await,
    );
    let figures = result?;
    deleted.0?;
    deleted.1?;
    Ok(figures)
}

/// `slot`'s subject, opened on first use.
async fn measure_on<S: Subject>(slot: &mut Option<S>, name: &str) -> Result<Figures, BoxError> {
    let subject = match slot {
        Some(subject) => subject,
        None => slot.insert(S::open().await?),
    };
    measure(subject, name).await
}

/// The subjects, each opened in the first round that measures it.
#[derive(Default)]
struct Subjects {
    amqp091: Option<Amqp091>,
    amqp10: Option<Amqp10>,
    nats: Option<Nats>,
}

/// On the in-memory broker: the driver's own start, in wall-clock time, on a broker of its
/// own run by its own executor.
fn memory_round(name: &str) -> Result<Figures, BoxError> {
    let broker = Broker::new();
    let transport = broker.connect();
    broker.block_on(async {
        let policy = policy()?;
        let plan = TopologyPlan::new(name, &policy)?;
        transport.provision(&plan).await?;
        broker.publish(Outgoing::to_queue(name, b"m".to_vec()))?;
        let from_run = ours::first_call(transport, name, &policy).await?;
        Ok(Figures {
            ours: FirstDelivery {
                total: from_run,
                from_run,
            },
            plain: None,
        })
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn args() -> Result<(usize, Vec<String>), BoxError> {
    let mut rounds = ROUNDS;
    let mut transports: Vec<String> = benches::TRANSPORTS
        .iter()
        .copied()
        .chain([MEMORY])
        .map(str::to_owned)
        .collect();
    let mut argv = Args::new(USAGE);
    while let Some(arg) = argv.next() {
        match arg.as_str() {
            "--transports" => {
                transports = argv
                    .value::<String>(&arg)?
                    .split(',')
                    .map(str::to_owned)
                    .collect();
            }
            n if !n.starts_with('-') => {
                rounds = n
                    .parse()
                    .map_err(|_| format!("ROUNDS must be a number, not {n:?}; {USAGE}"))?;
            }
            other => return Err(argv.unknown(other)),
        }
    }
    if rounds == 0 {
        return Err(format!("ROUNDS must be at least 1; {USAGE}").into());
    }
    if let Some(other) = transports
        .iter()
        .find(|t| *t != MEMORY && !benches::TRANSPORTS.contains(&t.as_str()))
    {
        return Err(format!("{}, and {MEMORY} (in process)", unknown_transport(other)).into());
    }
    Ok((rounds, transports))
}

fn main() -> Result<(), BoxError> {
    let (rounds, transports) = args()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let pid = std::process::id();
    let mut subjects = Subjects::default();
    let mut results: Vec<Vec<Figures>> = vec![Vec::new(); transports.len()];
    let mut left_out: Vec<(usize, String)> = Vec::new();
    for round in 0..rounds {
        for i in 0..transports.len() {
            let which = (i + round) % transports.len();
            let transport = transports[which].as_str();
            if left_out.iter().any(|(t, _)| *t == which) {
                continue;
            }
            let name = format!("first-{transport}-{pid}-{}", round + 1);
            let figures = match transport {
                MEMORY => memory_round(&name),
                Amqp091::NAME => runtime.block_on(measure_on(&mut subjects.amqp091, &name)),
                Amqp10::NAME => runtime.block_on(measure_on(&mut subjects.amqp10, &name)),
                Nats::NAME => runtime.block_on(measure_on(&mut subjects.nats, &name)),
                other => Err(unknown_transport(other)),
            };
            match figures {
                Ok(f) => {
                    eprintln!(
                        "round {} {transport:<8} ours {:>7.1} ms (from run {:>7.1} ms), plain {}",
                        round + 1,
                        ms(f.ours.total),
                        ms(f.ours.from_run),
                        f.plain.map_or("-".into(), |p| format!("{:.1} ms", ms(p)))
                    );
                    results[which].push(f);
                }
                Err(e) if round == 0 => {
                    eprintln!("{transport}: left out: {e}");
                    left_out.push((which, e.to_string()));
                }
                Err(e) => return Err(format!("{transport}, round {}: {e}", round + 1).into()),
            }
        }
    }
    println!();
    println!(
        "time to first delivery, ms, min / median / max over {rounds} rounds (goal: ours <= {} ms)",
        GOAL.as_millis()
    );
    println!(
        "| transport | ours, total | ours, from run | plain client | ours / plain, same round |"
    );
    println!("|---|---|---|---|---|");
    let show = |v: Vec<f64>, decimals: usize| {
        if v.is_empty() {
            return "-".to_owned();
        }
        let (a, b, c) = min_median_max(v);
        format!("{a:.decimals$} / {b:.decimals$} / {c:.decimals$}")
    };
    for (transport, figures) in transports.iter().zip(&results) {
        if figures.is_empty() {
            continue;
        }
        let plain: Vec<f64> = figures.iter().filter_map(|f| f.plain.map(ms)).collect();
        let ratios: Vec<f64> = figures
            .iter()
            .filter_map(|f| f.plain.map(|p| ms(f.ours.total) / ms(p)))
            .collect();
        println!(
            "| {transport} | {} | {} | {} | {} |",
            show(figures.iter().map(|f| ms(f.ours.total)).collect(), 1),
            show(figures.iter().map(|f| ms(f.ours.from_run)).collect(), 1),
            show(plain, 1),
            show(ratios, 2),
        );
    }
    for (which, e) in &left_out {
        println!("{}: left out: {e}", transports[*which]);
    }
    Ok(())
}
