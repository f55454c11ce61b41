//! RabbitMQ over AMQP 0-9-1: `AmqpTransport` under test, plain lapin as its baselines.
//!
//! | path | what runs |
//! |---|---|
//! | `lapin-ack-each` | success: plain lapin, one `basic.ack` per delivery |
//! | `lapin-batched` | success: plain lapin, one `multiple` ack per half prefetch window (the ceiling) |
//! | `lapin-pipelined` | retry: per delivery publish the clone on a confirm channel of its own (to the plan's delay queue, by the engine's route, `mandatory`, the delivery's properties without the engine's headers), await its confirm, then ack; up to prefetch deliveries at once |
//! | `lapin-seed` | retry: the seed article's work as the Node.js peer's `retry` mode does it: its topology (a direct TTL exchange, a TTL queue bound to it dead-lettering back to the work queue, expiring after 10 idle minutes), and per delivery a clone with the delivery's properties plus one attempt header, published (not mandatory) through the TTL exchange on a confirm channel, the original acked once its clone is confirmed; pipelined like `lapin-pipelined` |
//!
//! `benches/vs-node.sh` adds the Node.js peer's two paths ([`NODE`]) to the same table.
//!
//! The floor of the `lateness` binary ([`Subject::floor`]) is the broker's own delay: a
//! plain lapin consumer that publishes each first delivery's copy into a TTL queue
//! dead-lettering back to the work queue (see [`Amqp091::FLOOR`]). Its plain client in the
//! `first_delivery` binary is lapin: connection, channel, `basic.qos`, `basic.consume`, the
//! first delivery. `AMQP_URL` picks the broker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bench_support::proc::RABBITMQ;
use bench_support::publish::{confirm_channel, persistent, prefill, publish_paced};
use bench_support::queue::wait_for_count;
use bench_support::url::amqp_url;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Confirmation, Connection, ConnectionProperties, ExchangeKind};
use retry_core::{TopologyPlan, Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

use crate::lateness::{Clock, Lateness, Trial};
use crate::{BoxError, Measured, Meter, Peer, Run, SETTLING, Side, Subject};

/// RabbitMQ over AMQP 0-9-1.
pub struct Amqp091 {
    rabbit: RabbitMq,
}

/// RabbitMQ as both of its subjects (this one and [`crate::amqp10`]) reach it beside the
/// consumer under test, over AMQP 0-9-1: a transport that declares and deletes plans, and
/// its lapin connection, which prefills, counts, and runs the plain loops and the floor.
pub(crate) struct RabbitMq {
    setup: AmqpTransport,
    pub(crate) conn: Arc<Connection>,
}

impl RabbitMq {
    /// Connects to `AMQP_URL`.
    pub(crate) async fn open() -> Result<Self, BoxError> {
        let setup = AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?;
        let conn = setup.connection();
        Ok(RabbitMq { setup, conn })
    }

    /// Declares `plan`'s queues.
    pub(crate) async fn declare(&self, plan: &TopologyPlan) -> Result<(), BoxError> {
        Ok(self.setup.provision(plan).await?)
    }

    /// Prefills `queue` with `n` persistent `body`-byte messages, message ids `m0`, `m1`, …
    pub(crate) async fn prefill(&self, queue: &str, n: u64, body: usize) -> Result<(), BoxError> {
        let publisher = confirm_channel(&self.conn).await?;
        let payload = vec![b'x'; body];
        prefill(&publisher, queue, n, |i| {
            (
                &payload,
                persistent().with_message_id(format!("m{i}").into()),
            )
        })
        .await?;
        publisher.close(200, "prefilled".into()).await?;
        Ok(())
    }

    /// See [`Subject::publish_paced`].
    pub(crate) async fn publish_paced(
        &self,
        queue: &str,
        ids: Vec<u64>,
        body: &[u8],
        rate: f64,
    ) -> Result<(), BoxError> {
        publish_paced(&self.conn, queue, ids, body, rate).await
    }

    /// The messages ready in `queue`, asked until there are `expected` or [`SETTLING`] has
    /// passed.
    pub(crate) async fn count(&self, queue: &str, expected: u64) -> Result<u64, BoxError> {
        let ch = self.conn.create_channel().await?;
        let expected = u32::try_from(expected).unwrap_or(u32::MAX);
        let count = wait_for_count(&ch, queue, expected, SETTLING).await?;
        ch.close(200, "counted".into()).await?;
        Ok(u64::from(count))
    }

    /// Deletes `plan`'s queues and the floor's TTL queue beside them.
    pub(crate) async fn delete(&self, plan: &TopologyPlan) -> Result<(), BoxError> {
        self.setup.teardown(plan).await?;
        delete_floor_queue(&self.conn, plan.work_queue()).await
    }

    /// The broker's own delay (see [`Amqp091`]'s `floor`).
    pub(crate) async fn floor(&self, trial: &Trial<'_>) -> Result<Lateness, BoxError> {
        ttl_floor(&self.conn, trial).await
    }
}

/// The Node.js peer's paths, which `benches/vs-node.sh` measures and adds to the table.
pub const NODE: [Peer; 2] = [
    Peer {
        path: "node-ack",
        label: "node peer",
        side: Side::Success,
        legend: "the seed article's consumer on Node.js amqplib, acking each",
    },
    Peer {
        path: "node-retry",
        label: "node peer (seed)",
        side: Side::Retry,
        legend: "the seed article's consumer on Node.js amqplib (its `retry` mode)",
    },
];

const PEERS: [Peer; 4] = [
    Peer {
        path: "lapin-ack-each",
        label: "lapin ack-each",
        side: Side::Success,
        legend: "plain lapin, one basic.ack per delivery",
    },
    Peer {
        path: "lapin-batched",
        label: "lapin batched (ceiling)",
        side: Side::Success,
        legend: "plain lapin, one `multiple` ack per half prefetch window",
    },
    Peer {
        path: "lapin-pipelined",
        label: "lapin pipelined",
        side: Side::Retry,
        legend: "plain lapin, clone to the plan's delay queue (no engine headers), confirm, ack; up to prefetch at once",
    },
    Peer {
        path: "lapin-seed",
        label: "lapin seed",
        side: Side::Retry,
        legend: "plain lapin doing the seed article's work as the node peer does, pipelined like the above",
    },
];

impl Subject for Amqp091 {
    type Transport = AmqpTransport;
    const NAME: &'static str = "amqp091";
    const SERVER: &'static str = RABBITMQ;
    const PLAIN: &'static str = "lapin";

    async fn open() -> Result<Self, BoxError> {
        Ok(Amqp091 {
            rabbit: RabbitMq::open().await?,
        })
    }

    async fn connect(&self) -> Result<AmqpTransport, BoxError> {
        Ok(AmqpTransport::connect(AmqpConfig::new(amqp_url())).await?)
    }

    async fn declare(&self, plan: &TopologyPlan) -> Result<(), BoxError> {
        self.rabbit.declare(plan).await
    }

    async fn prefill(&self, queue: &str, n: u64, body: usize) -> Result<(), BoxError> {
        self.rabbit.prefill(queue, n, body).await
    }

    async fn publish_paced(
        &self,
        queue: &str,
        ids: Vec<u64>,
        body: &[u8],
        rate: f64,
    ) -> Result<(), BoxError> {
        self.rabbit.publish_paced(queue, ids, body, rate).await
    }

    async fn count(&self, queue: &str, expected: u64) -> Result<u64, BoxError> {
        self.rabbit.count(queue, expected).await
    }

    async fn delete(&self, plan: &TopologyPlan) -> Result<(), BoxError> {
        self.rabbit.delete(plan).await?;
        SeedTopology::new(plan.work_queue())
            .delete(&self.rabbit.conn)
            .await
    }

    fn peers() -> &'static [Peer] {
        &PEERS
    }

    async fn peer(&self, path: &str, run: &Run<'_>) -> Result<(Measured, String), BoxError> {
        let (conn, queue, n, prefetch) = (&*self.rabbit.conn, run.queue(), run.n, run.prefetch);
        let delay_queue = run.delay_queue()?.to_owned();
        let half_window = u64::from(prefetch / 2).max(1);
        let measured = match path {
            "lapin-ack-each" => consume(conn, queue, n, prefetch, 1).await?,
            "lapin-batched" => consume(conn, queue, n, prefetch, half_window).await?,
            "lapin-pipelined" => {
                // The clone's route, as the engine picks it.
                let delay = run.policy.delay_levels().first().copied();
                let (route, _) = delay
                    .and_then(|d| run.plan.route_for(d))
                    .ok_or("the plan has no delay level")?;
                let route = (route.exchange.to_string(), route.routing_key.to_string());
                let route = (route.0.as_str(), route.1.as_str());
                retry(conn, queue, route, Clone::Pipelined, n, prefetch).await?
            }
            "lapin-seed" => {
                let seed = SeedTopology::new(queue);
                seed.declare(conn, run).await?;
                let measured = retry(
                    conn,
                    queue,
                    (&seed.exchange, SEED_KEY),
                    Clone::Seed,
                    n,
                    prefetch,
                )
                .await?;
                return Ok((measured, seed.delay_queue));
            }
            other => return Err(crate::unknown_path::<Self>(other)),
        };
        Ok((measured, delay_queue))
    }

    /// The broker's own delay, as a careful lapin user builds it: a TTL queue beside the
    /// work queue (`<work queue>-floor-ttl`, durable, `x-message-ttl` the delay,
    /// dead-lettering through the default exchange back to the work queue). A plain lapin
    /// consumer (prefetch as ours) notes each first delivery's time, publishes a copy
    /// marked with a header of its own into the TTL queue (`mandatory`, on a confirm
    /// channel, awaiting the confirm), then acks; the copy's delivery is the second run.
    /// A TTL queue holds one TTL (a per-message TTL expires only at the queue's head, so
    /// shorter ones would wait behind longer ones): no jittered floor.
    const FLOOR: &'static str = "plain lapin, TTL queue + DLX";
    const FLOOR_JITTERS: bool = false;

    async fn floor(&self, trial: &Trial<'_>) -> Result<Lateness, BoxError> {
        self.rabbit.floor(trial).await
    }

    async fn plain_first_delivery(&self, queue: &str) -> Result<Duration, BoxError> {
        let start = Instant::now();
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        ch.basic_qos(100, BasicQosOptions::default()).await?;
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "plain-first".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let delivery = consumer
            .next()
            .await
            .ok_or("the consumer ended before a delivery")??;
        let first = start.elapsed();
        delivery.ack(BasicAckOptions::default()).await?;
        conn.close(200, "done".into()).await?;
        Ok(first)
    }
}

/// The header the floor marks its copies with.
const FLOOR_COPY: &str = "x-bench-floor-copy";

/// The floor's TTL queue beside `work`.
fn floor_queue(work: &str) -> String {
    format!("{work}-floor-ttl")
}

/// Deletes the floor's TTL queue beside `work`; deleting one that was never declared
/// changes nothing.
async fn delete_floor_queue(conn: &Connection, work: &str) -> Result<(), BoxError> {
    let ch = conn.create_channel().await?;
    ch.queue_delete(
        floor_queue(work).as_str().into(),
        QueueDeleteOptions::default(),
    )
    .await?;
    ch.close(200, "deleted".into()).await?;
    Ok(())
}

/// The arguments of a TTL queue whose messages wait `ttl`, then dead-letter through the
/// default exchange back to `work`: RabbitMQ's own delay, as the floor and the seed
/// article declare it.
fn expiring_home(ttl: std::time::Duration, work: &str) -> Result<FieldTable, BoxError> {
    let mut args = FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(i64::try_from(ttl.as_millis())?),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(work.into()),
    );
    Ok(args)
}

/// RabbitMQ's floor for the lateness of a delayed retry, over AMQP 0-9-1 on `conn` (see
/// [`Amqp091::FLOOR`]); the `amqp10` subject's floor too, the broker being the same.
async fn ttl_floor(conn: &Connection, trial: &Trial<'_>) -> Result<Lateness, BoxError> {
    if trial.jitter {
        return Err("RabbitMQ's floor cannot jitter: a TTL queue holds one TTL".into());
    }
    let (work, delay) = (trial.queue(), trial.delay()?);
    let ttl_queue = floor_queue(work);
    let setup = conn.create_channel().await?;
    let args = expiring_home(delay, work)?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    setup
        .queue_declare(ttl_queue.as_str().into(), durable, args)
        .await?;
    setup.close(200, "declared".into()).await?;

    let ch = conn.create_channel().await?;
    ch.basic_qos(trial.prefetch, BasicQosOptions::default())
        .await?;
    let publisher = confirm_channel(conn).await?;
    let mut consumer = ch
        .basic_consume(
            work.into(),
            "late-floor".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut clock = Clock::default();
    let feed = publish_paced(conn, work, trial.ids(), trial.body, trial.rate);
    let consume = async {
        let mut in_flight = FuturesUnordered::new();
        let mut second_runs = 0;
        while second_runs < trial.n {
            tokio::select! {
                d = consumer.next() => {
                    let d = d.ok_or("the consumer ended early")??;
                    let id = d.properties.message_id().as_ref().map(|s| s.as_str().to_owned());
                    let copy = d
                        .properties
                        .headers()
                        .as_ref()
                        .is_some_and(|h| h.inner().contains_key(FLOOR_COPY));
                    if copy {
                        clock.returned(id.as_deref(), delay);
                        second_runs += 1;
                        d.ack(BasicAckOptions::default()).await?;
                        continue;
                    }
                    clock.failed(id.as_deref());
                    let publisher = publisher.clone();
                    let ttl_queue = ttl_queue.clone();
                    in_flight.push(async move {
                        let mut headers = d.properties.headers().clone().unwrap_or_default();
                        headers.insert(ShortString::from(FLOOR_COPY), AMQPValue::Boolean(true));
                        let confirm = publisher
                            .basic_publish(
                                "".into(),
                                ttl_queue.as_str().into(),
                                BasicPublishOptions { mandatory: true, immediate: false },
                                &d.data,
                                d.properties.clone().with_headers(headers),
                            )
                            .await?
                            .await?;
                        if !matches!(confirm, Confirmation::Ack(None)) {
                            return Err(BoxError::from(format!("a copy was not confirmed: {confirm:?}")));
                        }
                        d.ack(BasicAckOptions::default()).await?;
                        Ok(())
                    });
                }
                Some(done) = in_flight.next() => done?,
            }
        }
        while let Some(done) = in_flight.next().await {
            done?;
        }
        Ok::<_, BoxError>(())
    };
    // A failed publisher ends the measurement rather than leaving the consumer waiting.
    tokio::try_join!(feed, consume)?;
    ch.close(200, "done".into()).await?;
    publisher.close(200, "done".into()).await?;
    delete_floor_queue(conn, work).await?;
    Ok(clock.finish())
}

/// Success path: consume `n` and ack each, or every `batch`-th with `multiple`.
async fn consume(
    conn: &Connection,
    queue: &str,
    n: u64,
    prefetch: u16,
    batch: u64,
) -> Result<Measured, BoxError> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let meter = Meter::start(RABBITMQ);
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
        meter.first();
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
    let took = meter.stop();
    ch.close(200, "done".into()).await?;
    Ok(took)
}

/// How plain lapin publishes a delivery's clone on the retry path.
#[derive(Clone, Copy)]
enum Clone {
    /// To the engine's delay queue by the engine's route, `mandatory`, with the delivery's
    /// properties unchanged (none of the engine's headers).
    Pipelined,
    /// The seed article's clone, as the Node.js peer's `retry` mode publishes it: through
    /// the direct TTL exchange by key [`SEED_KEY`], not mandatory, with one header more,
    /// [`SEED_HEADER`], the attempt (1 if absent) plus one.
    Seed,
}

/// The seed's routing key from its TTL exchange to its TTL queue (the peer's `retry-1`).
const SEED_KEY: &str = "retry-1";
/// The seed's attempt header (the peer's).
const SEED_HEADER: &str = "x-retry-attempt";

/// The seed's attempt of a delivery: its [`SEED_HEADER`], an integer of any width, or 1.
fn seed_attempt(headers: Option<&FieldTable>) -> i64 {
    match headers.and_then(|h| h.inner().get(SEED_HEADER)) {
        Some(AMQPValue::ShortShortInt(v)) => i64::from(*v),
        Some(AMQPValue::ShortInt(v)) => i64::from(*v),
        Some(AMQPValue::LongInt(v)) => i64::from(*v),
        Some(AMQPValue::LongLongInt(v)) => *v,
        _ => 1,
    }
}

/// Retry path, as a careful user writes it: deliveries on one channel, clones on a confirm
/// channel of their own; per delivery, publish the clone (as `clone` says) to `exchange` by
/// `routing_key`, await its confirm, then ack the original. Every delivery the prefetch lets
/// in is in flight at once.
async fn retry(
    conn: &Connection,
    queue: &str,
    (exchange, routing_key): (&str, &str),
    clone: Clone,
    n: u64,
    prefetch: u16,
) -> Result<Measured, BoxError> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let publisher = confirm_channel(conn).await?;
    let meter = Meter::start(RABBITMQ);
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "plain-retry".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut in_flight = FuturesUnordered::new();
    let (mut received, mut settled) = (0, 0);
    while settled < n {
        tokio::select! {
            d = consumer.next(), if received < n => {
                let d = d.ok_or("the consumer ended early")??;
                meter.first();
                received += 1;
                let publisher = publisher.clone();
                let (exchange, routing_key) = (exchange.to_owned(), routing_key.to_owned());
                in_flight.push(async move {
                    let (mandatory, properties) = match clone {
                        Clone::Pipelined => (true, d.properties.clone()),
                        Clone::Seed => {
                            let old = d.properties.headers().as_ref();
                            let mut headers = old.cloned().unwrap_or_default();
                            headers.insert(
                                SEED_HEADER.into(),
                                AMQPValue::LongLongInt(seed_attempt(old) + 1),
                            );
                            (false, d.properties.clone().with_headers(headers))
                        }
                    };
                    let confirm = publisher
                        .basic_publish(
                            exchange.into(),
                            routing_key.into(),
                            BasicPublishOptions { mandatory, immediate: false },
                            &d.data,
                            properties,
                        )
                        .await?
                        .await?;
                    if !matches!(confirm, Confirmation::Ack(None)) {
                        return Err(BoxError::from(format!("clone not confirmed: {confirm:?}")));
                    }
                    d.ack(BasicAckOptions::default()).await?;
                    Ok(())
                });
            }
            Some(done) = in_flight.next() => {
                done?;
                settled += 1;
            }
        }
    }
    let took = meter.stop();
    ch.close(200, "done".into()).await?;
    publisher.close(200, "done".into()).await?;
    Ok(took)
}

/// The seed article's delay, as the Node.js peer declares it, beside a plan's work queue:
/// a direct TTL exchange, and a TTL queue bound to it by [`SEED_KEY`] whose messages
/// dead-letter through the default exchange back to the work queue, durable and expiring
/// after 10 idle minutes (so that a crashed run leaves nothing for long). Its TTL is the
/// plan's first delay, so that no clone comes back during a measurement.
struct SeedTopology {
    exchange: String,
    delay_queue: String,
    queue: String,
}

impl SeedTopology {
    /// The peer's names, after the work queue's.
    fn new(queue: &str) -> Self {
        SeedTopology {
            exchange: format!("{queue}-seed-ttl"),
            delay_queue: format!("{queue}-seed-retry-1"),
            queue: queue.to_owned(),
        }
    }

    async fn declare(&self, conn: &Connection, run: &Run<'_>) -> Result<(), BoxError> {
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            self.exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
        let ttl = run
            .policy
            .delay_levels()
            .first()
            .ok_or("the policy has no delay")?;
        let mut delay = expiring_home(*ttl, &self.queue)?;
        delay.insert("x-expires".into(), AMQPValue::LongInt(600_000));
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare(self.delay_queue.as_str().into(), durable, delay)
            .await?;
        ch.queue_bind(
            self.delay_queue.as_str().into(),
            self.exchange.as_str().into(),
            SEED_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        ch.close(200, "declared".into()).await?;
        Ok(())
    }

    /// Deletes the seed's queue and exchange; deleting ones that were never declared
    /// changes nothing.
    async fn delete(&self, conn: &Connection) -> Result<(), BoxError> {
        let ch = conn.create_channel().await?;
        ch.queue_delete(
            self.delay_queue.as_str().into(),
            QueueDeleteOptions::default(),
        )
        .await?;
        ch.exchange_delete(self.exchange.as_str().into(), Default::default())
            .await?;
        ch.close(200, "deleted".into()).await?;
        Ok(())
    }
}
