//! Time to first delivery on every transport: how long a consumer takes from being started
//! to its first handler call, against the plain client's connect-and-consume, on the same
//! broker in the same run.
//!
//! ```sh
//! cargo run --release -p conformance --example first_delivery              # 5 rounds
//! cargo run --release -p conformance --example first_delivery -- 9         # 9 rounds
//! ```
//!
//! Each measurement gets a work queue of its own (a topology plan named
//! `first-<pid>-<round>-<transport>`, provisioned beforehand) holding one persistent
//! message, then:
//!
//! * **ours, total**: from just before the transport connects to the first handler call:
//!   connecting, verifying the plan's queues, the consumer's first look at its isolation
//!   queue, subscribing and the delivery itself;
//! * **ours, from run**: the part of it from calling `Consumer::run`, on a transport that
//!   is already connected;
//! * **plain**: the plain client, from just before it connects to the first message in
//!   hand: lapin (connection, channel, `basic.qos`, `basic.consume`), fe2o3-amqp (a
//!   `TCP_NODELAY` stream, connection, session, a receiver with credit on
//!   `/amq/queue/<q>`), async-nats (connection, the work stream's durable consumer, a
//!   continuous pull).
//!
//! Rounds are interleaved (every transport's three measurements in each round, the order
//! rotated), and the table shows min, median and max per row and the ratio of ours (total)
//! to plain, per round. On the in-memory broker there is no plain client and no network:
//! its row is the driver's own start, in wall-clock time.
//!
//! `AMQP_URL`, `AMQP10_URL` and `NATS_URL` pick the servers (defaults: the local ones);
//! AMQP 1.0 needs RabbitMQ's `rabbitmq_amqp1_0` plugin. A transport whose server does not
//! answer is left out, with a line saying so.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bench_support::publish::{confirm_channel, persistent};
use bench_support::stats::min_median_max;
use conformance::rabbitmq::BrokerEnv;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::types::messaging::Body;
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::{Connection, Receiver, Session};
use futures::StreamExt;
use futures::channel::oneshot;
use lapin::ConnectionProperties;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::types::FieldTable;
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, TopologyPlan, Transport};
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};
use transport_memory::{Broker, Outgoing};
use transport_nats::{CONSUMER, NatsConfig, NatsTransport, stream_name};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A measurement that has not finished by then failed.
const BOUND: Duration = Duration::from_secs(30);
/// The goal: every consumer's first handler call within this of its start.
const GOAL: Duration = Duration::from_millis(50);

fn policy() -> RetryPolicy {
    RetryPolicy::delays([Duration::from_secs(60)])
        .build()
        .expect("a valid policy")
}

/// One round's three figures for one transport.
#[derive(Clone, Copy, Debug)]
struct Figures {
    ours_total: Duration,
    ours_from_run: Duration,
    plain: Option<Duration>,
}

/// Runs a consumer on `transport` until its first handler call, and returns how long that
/// took from `run` being called.
async fn first_call<T: Transport>(transport: T, queue: &str) -> Result<Duration, BoxError> {
    let (tx, rx) = oneshot::channel::<Instant>();
    let tx = Arc::new(Mutex::new(Some(tx)));
    let handler = move |_msg: Message| {
        let at = Instant::now();
        if let Some(tx) = tx.lock().unwrap().take() {
            let _ = tx.send(at);
        }
        async { Ok::<(), HandlerError>(()) }
    };
    let consumer = Consumer::builder(transport, queue, policy(), handler).build()?;
    let (seen_tx, seen_rx) = oneshot::channel::<Instant>();
    let start = Instant::now();
    let run = consumer.run(async move {
        if let Ok(at) = rx.await {
            let _ = seen_tx.send(at);
        }
    });
    run.await?;
    let at = seen_rx
        .await
        .map_err(|_| "the consumer stopped before a delivery")?;
    Ok(at - start)
}

/// Times `connect` and `first_call` on what it connects: ours, total and from run.
async fn ours<T, F>(connect: F, queue: &str) -> Result<(Duration, Duration), BoxError>
where
    T: Transport,
    F: Future<Output = Result<T, BoxError>>,
{
    let measured = async {
        let start = Instant::now();
        let transport = connect.await?;
        let connected = start.elapsed();
        let from_run = first_call(transport, queue).await?;
        Ok((connected + from_run, from_run))
    };
    tokio::time::timeout(BOUND, measured)
        .await
        .map_err(|_| "no first delivery in time")?
}

/// On RabbitMQ, over AMQP 0-9-1 or (`amqp10`) AMQP 1.0. RabbitMQ 3.x declares queues with
/// arguments only over AMQP 0-9-1, so the topology is declared over it for both.
async fn rabbitmq_round(env: &BrokerEnv, name: &str, amqp10: bool) -> Result<Figures, BoxError> {
    let setup = AmqpTransport::connect(AmqpConfig::new(&env.amqp091_url)).await?;
    let plan = TopologyPlan::new(name, &policy())?;
    setup.provision(&plan).await?;
    let channel = confirm_channel(&setup.connection()).await?;
    let publish_one = || async {
        let options = BasicPublishOptions::default();
        channel
            .basic_publish("".into(), name.into(), options, b"m", persistent())
            .await?
            .await?;
        Ok::<(), BoxError>(())
    };
    let result = async {
        publish_one().await?;
        let plain = if amqp10 {
            plain_amqp10(&env.amqp10_url, name).await?
        } else {
            plain_amqp091(&env.amqp091_url, name).await?
        };
        publish_one().await?;
        let (total, from_run) = if amqp10 {
            let config = Amqp10Config::new(&env.amqp10_url);
            ours(async { Ok(Amqp10Transport::connect(config).await?) }, name).await?
        } else {
            let config = AmqpConfig::new(&env.amqp091_url);
            ours(async { Ok(AmqpTransport::connect(config).await?) }, name).await?
        };
        Ok::<_, BoxError>(Figures {
            ours_total: total,
            ours_from_run: from_run,
            plain: Some(plain),
        })
    }
    .await;
    setup.teardown(&plan).await?;
    result
}

/// Plain lapin: connection, channel, `basic.qos`, `basic.consume`, the first delivery.
async fn plain_amqp091(url: &str, queue: &str) -> Result<Duration, BoxError> {
    let start = Instant::now();
    let conn = lapin::Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(100, BasicQosOptions::default()).await?;
    let options = BasicConsumeOptions::default();
    let mut consumer = ch
        .basic_consume(queue.into(), "plain".into(), options, FieldTable::default())
        .await?;
    let delivery = consumer.next().await.ok_or("no delivery")??;
    let first = start.elapsed();
    delivery.ack(Default::default()).await?;
    conn.close(200, "done".into()).await?;
    Ok(first)
}

/// Plain fe2o3-amqp as a careful user opens it (with `TCP_NODELAY`): connection, session,
/// a receiver with credit on `/amq/queue/<queue>`, the first delivery.
async fn plain_amqp10(url: &str, queue: &str) -> Result<Duration, BoxError> {
    let start = Instant::now();
    let url = url::Url::parse(url)?;
    let host = url.host_str().ok_or("AMQP10_URL has no host")?.to_owned();
    let tcp = tokio::net::TcpStream::connect((host.as_str(), url.port().unwrap_or(5672))).await?;
    tcp.set_nodelay(true)?;
    let sasl = SaslProfile::Plain {
        username: url.username().to_owned(),
        password: url.password().unwrap_or_default().to_owned(),
    };
    let mut connection = Connection::builder()
        .container_id(format!("first-delivery-{}", std::process::id()))
        .hostname(host.as_str())
        .sasl_profile(sasl)
        .open_with_stream(tcp)
        .await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut receiver =
        Receiver::attach(&mut session, "plain", format!("/amq/queue/{queue}")).await?;
    let delivery = receiver.recv::<Body<Value>>().await?;
    let first = start.elapsed();
    receiver.accept(&delivery).await?;
    let _ = receiver.detach().await;
    let _ = session.end().await;
    let _ = connection.close().await;
    Ok(first)
}

/// On NATS each measurement has a work queue of its own: the plain client's pull request
/// outlives the client on the server, which would hand it the consumer's message (back only
/// after the ack wait).
async fn nats_round(url: &str, name: &str) -> Result<Figures, BoxError> {
    let setup = NatsTransport::connect(NatsConfig::new(url)).await?;
    let plain_queue = format!("{name}-plain");
    let plans = [
        TopologyPlan::new(&plain_queue, &policy())?,
        TopologyPlan::new(name, &policy())?,
    ];
    let js = async_nats::jetstream::new(setup.client().clone());
    let result = async {
        for plan in &plans {
            setup.provision(plan).await?;
            js.publish(plan.work_queue().to_owned(), "m".into())
                .await?
                .await?;
        }
        let start = Instant::now();
        let client = async_nats::connect(url).await?;
        let consumer: async_nats::jetstream::consumer::PullConsumer =
            async_nats::jetstream::new(client.clone())
                .get_stream(stream_name(&plain_queue))
                .await?
                .get_consumer(CONSUMER)
                .await?;
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(100)
            .messages()
            .await?;
        let message = messages.next().await.ok_or("no delivery")??;
        let plain = start.elapsed();
        message.ack().await?;
        client.flush().await?;
        let config = NatsConfig::new(url);
        let (total, from_run) =
            ours(async { Ok(NatsTransport::connect(config).await?) }, name).await?;
        Ok::<_, BoxError>(Figures {
            ours_total: total,
            ours_from_run: from_run,
            plain: Some(plain),
        })
    }
    .await;
    for plan in &plans {
        transport_nats::testing::delete_plan(setup.client(), plan).await;
    }
    result
}

/// On the in-memory broker: the driver's own start, in wall-clock time.
fn memory_round(name: &str) -> Result<Figures, BoxError> {
    let broker = Broker::new();
    let transport = broker.connect();
    broker.block_on(async {
        let plan = TopologyPlan::new(name, &policy())?;
        transport.provision(&plan).await?;
        broker.publish(Outgoing::to_queue(name, b"m".to_vec()))?;
        let from_run = first_call(transport, name).await?;
        Ok(Figures {
            ours_total: from_run,
            ours_from_run: from_run,
            plain: None,
        })
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> Result<(), BoxError> {
    let rounds: usize = match std::env::args().nth(1) {
        Some(n) => n
            .parse()
            .map_err(|_| format!("ROUNDS must be a number, not {n:?}"))?,
        None => 5,
    };
    if rounds == 0 {
        return Err("ROUNDS must be at least 1".into());
    }
    let env = BrokerEnv::from_env();
    let nats_url = transport_nats::testing::nats_url();
    let transports = ["memory", "amqp091", "amqp10", "nats"];
    let mut results: Vec<(&str, Vec<Figures>)> = transports.iter().map(|t| (*t, vec![])).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let pid = std::process::id();
    let mut skipped = Vec::new();
    for round in 0..rounds {
        for i in 0..transports.len() {
            let which = (i + round) % transports.len();
            let transport = transports[which];
            if skipped.contains(&transport) {
                continue;
            }
            let name = format!("first-{pid}-{round}-{transport}");
            let figures = match transport {
                "memory" => memory_round(&name),
                "amqp091" => runtime.block_on(rabbitmq_round(&env, &name, false)),
                "amqp10" => runtime.block_on(rabbitmq_round(&env, &name, true)),
                _ => runtime.block_on(nats_round(&nats_url, &name)),
            };
            match figures {
                Ok(f) => {
                    eprintln!(
                        "round {} {transport:<8} ours {:>7.1} ms (from run {:>7.1} ms), plain {}",
                        round + 1,
                        ms(f.ours_total),
                        ms(f.ours_from_run),
                        f.plain.map_or("-".into(), |p| format!("{:.1} ms", ms(p)))
                    );
                    results[which].1.push(f);
                }
                Err(e) if round == 0 => {
                    eprintln!("{transport}: left out: {e}");
                    skipped.push(transport);
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
    for (transport, figures) in &results {
        if figures.is_empty() {
            continue;
        }
        let show = |v: Vec<f64>| {
            let (a, b, c) = min_median_max(v);
            format!("{a:.1} / {b:.1} / {c:.1}")
        };
        let plain: Vec<f64> = figures.iter().filter_map(|f| f.plain.map(ms)).collect();
        let ratios: Vec<f64> = figures
            .iter()
            .filter_map(|f| f.plain.map(|p| ms(f.ours_total) / ms(p)))
            .collect();
        println!(
            "| {transport} | {} | {} | {} | {} |",
            show(figures.iter().map(|f| ms(f.ours_total)).collect()),
            show(figures.iter().map(|f| ms(f.ours_from_run)).collect()),
            if plain.is_empty() {
                "-".into()
            } else {
                show(plain)
            },
            if ratios.is_empty() {
                "-".into()
            } else {
                let (a, b, c) = min_median_max(ratios);
                format!("{a:.2} / {b:.2} / {c:.2}")
            },
        );
    }
    Ok(())
}
