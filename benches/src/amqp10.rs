//! AMQP 1.0 on RabbitMQ 3.x's plugin: `Amqp10Transport` under test, plain fe2o3-amqp as its
//! baselines. Queues are declared, prefilled and counted over AMQP 0-9-1 (the plugin cannot
//! declare queues with arguments), and the consumer verifies the plan without declaring it.
//!
//! | path | what runs |
//! |---|---|
//! | `fe2o3-accept-each` | success: a receiver in manual credit (as on the retry path: the prefetch granted again once the last grant is used up), `accept` each delivery as it arrives (dispositions pipeline) |
//! | `fe2o3-accept-batched` | success: the same receiver; takes every delivery already there (up to half the prefetch) and settles them with one `accept_all` |
//! | `fe2o3-retry-eager` | retry: a receiver in manual credit; per delivery a clone (body, properties, application properties plus an attempt header, durable like the original) is sent unsettled to `/amq/queue/<delay queue>` on a sender of a second connection, its `accepted` outcome awaited, then the original accepted; up to prefetch in flight. Credit is granted again once the last grant is used up, prefetch − unsettled |
//! | `fe2o3-retry-half` | retry: the same, granting only once at most half the prefetch is unsettled (fewer, larger grants) |
//! | `fe2o3-retry-headers` | retry: `fe2o3-retry-half` with the eight further application properties the engine writes on a first clone, to see what the engine's headers cost the broker |
//!
//! Two things a plain loop must do that the transport does for its user: `TCP_NODELAY`
//! (fe2o3's `Connection::open` leaves Nagle on, which made these loops 3 to 5 times slower)
//! and manual credit, granted only when no transfer is on the way (automatic credit grants
//! again while transfers are on the way, and RabbitMQ 3.10 does not subtract those from the
//! grant: the retry loop failed with `TransferLimitExceeded`, and a success loop stalled with
//! deliveries outstanding).
//!
//! The floor of the `lateness` binary ([`Subject::floor`]) is RabbitMQ's own delay, the same
//! as the `amqp091` subject's (a TTL queue dead-lettering back to the work queue, driven by
//! plain lapin over AMQP 0-9-1): the broker is the same, and AMQP 1.0 gives a client no delay
//! of its own to measure instead. Its plain client in the `first_delivery` binary is
//! fe2o3-amqp: a `TCP_NODELAY` stream, connection, session, a receiver with credit on
//! `/amq/queue/<queue>`, the first delivery. `AMQP10_URL` and `AMQP_URL` pick the broker.

use std::time::{Duration, Instant};

use bench_support::proc::RABBITMQ;
use bench_support::url::amqp10_url;
use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Body, Header, Message as AmqpMessage, Outcome,
};
use fe2o3_amqp::types::primitives::{SimpleValue, Value};
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use retry_core::TopologyPlan;
use transport_amqp10::{Amqp10Config, Amqp10Transport};

use crate::amqp091::RabbitMq;
use crate::lateness::{Lateness, Trial};
use crate::{BoxError, Measured, Meter, Peer, Run, Side, Subject};

/// AMQP 1.0 on RabbitMQ. Plans are declared, prefilled, counted and deleted over AMQP
/// 0-9-1, as for [`crate::amqp091::Amqp091`].
pub struct Amqp10 {
    rabbit: RabbitMq,
}

const PEERS: [Peer; 5] = [
    Peer {
        path: "fe2o3-accept-each",
        label: "fe2o3 accept-each",
        side: Side::Success,
        legend: "plain fe2o3-amqp, manual credit, accept each delivery",
    },
    Peer {
        path: "fe2o3-accept-batched",
        label: "fe2o3 accept-batched",
        side: Side::Success,
        legend: "plain fe2o3-amqp, one accept_all per batch of deliveries at hand",
    },
    Peer {
        path: "fe2o3-retry-eager",
        label: "fe2o3 retry eager",
        side: Side::Retry,
        legend: "plain fe2o3-amqp, clone with an attempt header, accepted, then accept; credit granted when used up",
    },
    Peer {
        path: "fe2o3-retry-half",
        label: "fe2o3 retry half",
        side: Side::Retry,
        legend: "the same, granting credit once at most half the prefetch is unsettled",
    },
    Peer {
        path: "fe2o3-retry-headers",
        label: "fe2o3 retry + headers",
        side: Side::Retry,
        legend: "fe2o3 retry half with the engine's eight further headers (a cost, not a baseline)",
    },
];

impl Subject for Amqp10 {
    type Transport = Amqp10Transport;
    const NAME: &'static str = "amqp10";
    const SERVER: &'static str = RABBITMQ;
    const PLAIN: &'static str = "fe2o3-amqp";

    async fn open() -> Result<Self, BoxError> {
        Ok(Amqp10 {
            rabbit: RabbitMq::open().await?,
        })
    }

    async fn connect(&self) -> Result<Amqp10Transport, BoxError> {
        Ok(Amqp10Transport::connect(Amqp10Config::new(amqp10_url())).await?)
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
        self.rabbit.delete(plan).await
    }

    fn peers() -> &'static [Peer] {
        &PEERS
    }

    async fn peer(&self, path: &str, run: &Run<'_>) -> Result<(Measured, String), BoxError> {
        let (queue, n, prefetch) = (run.queue(), run.n, u32::from(run.prefetch));
        let delay_queue = run.delay_queue()?.to_owned();
        let measured = match path {
            "fe2o3-accept-each" => success(queue, n, prefetch, false).await?,
            "fe2o3-accept-batched" => success(queue, n, prefetch, true).await?,
            "fe2o3-retry-eager" => retry(queue, &delay_queue, n, prefetch, prefetch, false).await?,
            "fe2o3-retry-half" => {
                retry(queue, &delay_queue, n, prefetch, prefetch / 2, false).await?
            }
            "fe2o3-retry-headers" => {
                retry(queue, &delay_queue, n, prefetch, prefetch / 2, true).await?
            }
            other => return Err(crate::unknown_path::<Self>(other)),
        };
        Ok((measured, delay_queue))
    }

    /// RabbitMQ's own delay, as on `amqp091` (the same broker): a TTL queue beside the work
    /// queue dead-lettering back to it, driven by plain lapin over AMQP 0-9-1. No jittered
    /// floor: a TTL queue holds one TTL.
    const FLOOR: &'static str = "plain lapin, TTL queue + DLX (same broker)";
    const FLOOR_JITTERS: bool = false;

    async fn floor(&self, trial: &Trial<'_>) -> Result<Lateness, BoxError> {
        self.rabbit.floor(trial).await
    }

    async fn plain_first_delivery(&self, queue: &str) -> Result<Duration, BoxError> {
        let start = Instant::now();
        let mut connection = plain_connection("plain-first-delivery").await?;
        let mut session = Session::begin(&mut connection).await?;
        let mut receiver = plain_receiver(&mut session, queue, 100, false).await?;
        let delivery = receiver.recv::<Body<Value>>().await?;
        let first = start.elapsed();
        receiver.accept(&delivery).await?;
        let _ = receiver.detach().await;
        let _ = session.end().await;
        let _ = connection.close().await;
        Ok(first)
    }
}

/// Opens an AMQP 1.0 connection as a careful user would: with `TCP_NODELAY`, which fe2o3's
/// `Connection::open(name, url)` leaves off.
pub(crate) async fn plain_connection(name: &str) -> Result<ConnectionHandle<()>, BoxError> {
    let url = url::Url::parse(&amqp10_url())?;
    let host = url.host_str().ok_or("AMQP10_URL has no host")?.to_owned();
    let port = url.port().unwrap_or(5672);
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
    tcp.set_nodelay(true)?;
    let sasl = SaslProfile::Plain {
        username: url.username().to_owned(),
        password: url.password().unwrap_or_default().to_owned(),
    };
    Ok(Connection::builder()
        .container_id(format!("{name}-{}", std::process::id()))
        .hostname(host.as_str())
        .sasl_profile(sasl)
        .open_with_stream(tcp)
        .await?)
}

/// A receiver on `queue` with fe2o3's automatic credit of `prefetch` (`manual`: none yet).
pub(crate) async fn plain_receiver(
    session: &mut SessionHandle<()>,
    queue: &str,
    prefetch: u32,
    manual: bool,
) -> Result<Receiver, BoxError> {
    let mode = if manual {
        CreditMode::Manual
    } else {
        CreditMode::Auto(prefetch)
    };
    Ok(Receiver::builder()
        .name(format!("plain-{queue}"))
        .source(format!("/amq/queue/{queue}"))
        .credit_mode(mode)
        .attach(session)
        .await?)
}

/// Manual credit for the plain loops: a new grant is made only once the last one is used
/// up (so that no transfer is on the way when it is made), of what is free below the
/// prefetch, and only when at most `floor` deliveries are unsettled.
struct Credit {
    prefetch: u32,
    left: u32,
    unsettled: u32,
    floor: u32,
}

impl Credit {
    async fn top_up(&mut self, receiver: &mut Receiver) -> Result<(), BoxError> {
        if self.left == 0 && self.unsettled <= self.floor && self.unsettled < self.prefetch {
            receiver.set_credit(self.prefetch - self.unsettled).await?;
            self.left = self.prefetch - self.unsettled;
        }
        Ok(())
    }
}

/// Success path: accept each delivery as it arrives, or (`batched`) every delivery already
/// there with one `accept_all`; manual credit as on the retry path (fe2o3's automatic
/// credit grants again while transfers are on the way, and a smoke run with it stalled on
/// RabbitMQ 3.10 with deliveries outstanding).
async fn success(queue: &str, n: u64, prefetch: u32, batched: bool) -> Result<Measured, BoxError> {
    let mut connection = plain_connection("plain-success").await?;
    let mut session = Session::begin(&mut connection).await?;
    let meter = Meter::start(RABBITMQ);
    let mut receiver = plain_receiver(&mut session, queue, prefetch, true).await?;
    let mut credit = Credit {
        prefetch,
        left: 0,
        unsettled: 0,
        floor: prefetch,
    };
    credit.top_up(&mut receiver).await?;
    let mut done = 0;
    let mut batch = Vec::with_capacity((prefetch / 2).max(1) as usize);
    while done < n {
        let delivery = receiver.recv::<Body<Value>>().await?;
        meter.first();
        batch.push(delivery);
        // `recv` is cancel safe: asking without waiting loses nothing.
        while batched && batch.len() < batch.capacity() && done + (batch.len() as u64) < n {
            match futures::FutureExt::now_or_never(receiver.recv::<Body<Value>>()) {
                Some(delivery) => batch.push(delivery?),
                None => break,
            }
        }
        let taken = u32::try_from(batch.len())?;
        credit.left = credit.left.saturating_sub(taken);
        done += u64::from(taken);
        if batched {
            receiver.accept_all(batch.drain(..)).await?;
        } else {
            for delivery in batch.drain(..) {
                receiver.accept(&delivery).await?;
            }
        }
        credit.top_up(&mut receiver).await?;
    }
    let took = meter.stop();
    let _ = receiver.detach().await;
    let _ = session.end().await;
    let _ = connection.close().await;
    Ok(took)
}

/// What the engine writes on a first clone beside the attempt, with values of the same
/// types.
fn engine_headers(queue: &str) -> [(&'static str, SimpleValue); 8] {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    [
        ("x-retry-crashes", SimpleValue::Long(0)),
        ("x-retry-first-failure", SimpleValue::Long(now)),
        ("x-retry-last-failure", SimpleValue::Long(now)),
        (
            "x-retry-last-error",
            SimpleValue::String("the first run fails".into()),
        ),
        ("x-retry-delay", SimpleValue::Long(600_000)),
        ("x-retry-origin-queue", SimpleValue::String(queue.into())),
        (
            "x-retry-origin-exchange",
            SimpleValue::String(String::new()),
        ),
        (
            "x-retry-origin-routing-key",
            SimpleValue::String(queue.into()),
        ),
    ]
}

/// Retry path: per delivery, send a clone unsettled to the delay queue, await its
/// `accepted`, then accept the original; as many at once as the credit lets in.
async fn retry(
    queue: &str,
    delay_queue: &str,
    n: u64,
    prefetch: u32,
    floor: u32,
    with_engine_headers: bool,
) -> Result<Measured, BoxError> {
    let mut connection = plain_connection("plain-retry").await?;
    let mut session = Session::begin(&mut connection).await?;
    // The clones go out on a connection of their own, as the transport sends them.
    let mut publishing = plain_connection("plain-retry-publisher").await?;
    let mut publishing_session = Session::begin(&mut publishing).await?;
    let mut sender = Sender::attach(
        &mut publishing_session,
        format!("plain-clones-{queue}"),
        format!("/amq/queue/{delay_queue}"),
    )
    .await?;
    let meter = Meter::start(RABBITMQ);
    let mut receiver = plain_receiver(&mut session, queue, prefetch, true).await?;
    let mut credit = Credit {
        prefetch,
        left: 0,
        unsettled: 0,
        floor,
    };
    credit.top_up(&mut receiver).await?;
    let (mut received, mut done) = (0, 0);
    let mut in_flight = FuturesUnordered::new();
    while done < n {
        tokio::select! {
            Some((info, outcome)) = in_flight.next(), if !in_flight.is_empty() => {
                match outcome {
                    Ok(Outcome::Accepted(_)) => receiver.accept(info).await?,
                    other => return Err(format!("a clone was not accepted: {other:?}").into()),
                }
                done += 1;
                credit.unsettled -= 1;
                credit.top_up(&mut receiver).await?;
            }
            delivery = receiver.recv::<Body<Value>>(), if received < n => {
                let delivery = delivery?;
                meter.first();
                received += 1;
                credit.left -= 1;
                credit.unsettled += 1;
                let (info, original) = delivery.into_parts();
                let mut properties = original
                    .application_properties
                    .unwrap_or_else(|| ApplicationProperties::builder().build());
                properties.0.insert("x-retry-attempts".into(), SimpleValue::Long(1));
                if with_engine_headers {
                    for (key, value) in engine_headers(queue) {
                        properties.0.insert(key.into(), value);
                    }
                }
                let clone = AmqpMessage::builder()
                    .header(Header {
                        durable: original.header.is_some_and(|h| h.durable),
                        ..Header::default()
                    })
                    .properties(original.properties.unwrap_or_default())
                    .application_properties(properties)
                    .body(original.body)
                    .build();
                let pending = sender.send_batchable(clone).await?;
                in_flight.push(async move { (info, pending.await) });
                credit.top_up(&mut receiver).await?;
            }
        }
    }
    let took = meter.stop();
    let _ = sender.detach().await;
    let _ = publishing_session.end().await;
    let _ = publishing.close().await;
    let _ = receiver.detach().await;
    let _ = session.end().await;
    let _ = connection.close().await;
    Ok(took)
}
