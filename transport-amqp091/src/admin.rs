//! [`Admin`] for [`AmqpTransport`]: what `retryctl` asks of RabbitMQ beside the data path.
//!
//! * [`depth`](Admin::depth) is a passive `queue.declare` on a channel of its own (a missing
//!   queue closes the channel it is asked on).
//! * [`apply`](Admin::apply) is
//!   [`provision_inspected`](AmqpTransport::provision_inspected), object by object.
//! * [`check`](Admin::check) checks the broker from outside against a plan, in two ways.
//!   Every exchange and queue of the plan exists (passive declares, which change nothing).
//!   And every delay queue routes: a probe is published the way the engine publishes a
//!   delayed copy (to the plan's route into that queue, `mandatory`, with confirms), with a
//!   per-message expiration of the queue's TTL or [`PlanOptions::max_probe_ttl`] (10 s by
//!   default), whichever is shorter, and the header
//!   [`x-retry-probe`](retry_core::headers::PROBE). It must come back to the queue the plan
//!   says the delay queue expires into, with an `x-death` entry saying it expired from that
//!   delay queue.
//!
//! Probes are read back with `basic.get` and manual acknowledgements, so that no work is
//! taken by subscription. A probe is acknowledged, which removes it; anything else that comes
//! to the head of a polled queue is put back at once (a suspect in the isolation queue as a
//! confirmed copy, since one that comes back redelivered from there counts a crash) and that
//! queue is no longer polled, since the next get would return the same message. A queue with
//! messages ready is not polled at all: a probe would come back behind them. Running
//! consumers acknowledge probes without running their handler, so the check is conclusive
//! only with the work queue's consumers stopped.
//!
//! Every request to the broker takes at most the request timeout
//! ([`AmqpConfig::with_request_timeout`](crate::AmqpConfig::with_request_timeout)), and
//! every probe's confirm the confirm timeout.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use retry_core::{
    Admin, Applied, AppliedObject, CheckReport, Checked, Depth, ExchangeKind, HeaderValue, Headers,
    ObjectCheck, PlanOptions, QueueRole, Route, TopologyPlan, TransportError, headers,
};

use crate::convert::headers_from_table;
use crate::error::{amqp_code, short};
use crate::provision;
use crate::tap::MARK;
use crate::transport::AmqpTransport;

const NOT_FOUND: u16 = 404;

/// How long a probe may wait in a delay queue when [`PlanOptions::max_probe_ttl`] is not
/// given.
const DEFAULT_PROBE_TTL: Duration = Duration::from_secs(10);
/// How long past its expiration a probe may take to come back.
const MARGIN: Duration = Duration::from_secs(5);
/// How often the destination queues are polled.
const POLL_EVERY: Duration = Duration::from_millis(50);

/// Operators' tools on RabbitMQ over AMQP 0-9-1, as the module docs describe: a queue's
/// depth by passive declare, a plan applied with
/// [`provision_inspected`](AmqpTransport::provision_inspected), and a check that sends a
/// probe through every delay queue. Every message it reads shows its headers, so
/// [`may_hide_headers`](Admin::may_hide_headers) is `false`.
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use retry_core::{Admin, Depth, PlanOptions, RetryPolicy, TopologyPlan};
/// use std::time::Duration;
/// use transport_amqp091::{AmqpConfig, AmqpTransport};
///
/// let transport = AmqpTransport::connect(AmqpConfig::new("amqp://127.0.0.1:5672/%2f")).await?;
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// for object in transport.apply(&plan).await? {
///     println!("{:<9} {}", object.applied.as_str(), object.object);
/// }
/// assert!(matches!(transport.depth("comments").await?, Depth::Ready(_)));
/// let options = PlanOptions::new().with_max_probe_ttl(Duration::from_secs(2));
/// let report = transport.check(&plan, &options).await?;
/// println!("{} problem(s)", report.problems());
/// # Ok(()) }
/// ```
#[async_trait]
impl Admin for AmqpTransport {
    /// A passive `queue.declare` of `queue` on a channel of its own: `NOT_FOUND` is
    /// [`Depth::Missing`], and any other failure a [`TransportError`] naming the queue.
    async fn depth(&self, queue: &str) -> Result<Depth, TransportError> {
        let conn = self.connection();
        let state = self.session(&conn).queue_state(queue).await?;
        Ok(state.map_or(Depth::Missing, |s| Depth::Ready(u64::from(s.messages))))
    }

    /// [`provision_inspected`](AmqpTransport::provision_inspected), then one line per
    /// exchange and queue of `plan` in its order (`created` or `verified`), and one per
    /// binding (`declared`: bindings are declared without asking first). A delay cascade's
    /// shared objects are declared, but not listed.
    async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        let report = self.provision_inspected(plan).await?;
        let objects = plan
            .exchanges()
            .iter()
            .map(|e| format!("exchange {}", e.name))
            .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)));
        let mut applied: Vec<AppliedObject> = objects
            .map(|object| {
                let what = if report.created.contains(&object) {
                    Applied::Created
                } else if report.verified.contains(&object) {
                    Applied::Verified
                } else {
                    Applied::Declared
                };
                AppliedObject::new(object, what)
            })
            .collect();
        applied.extend(plan.bindings().iter().map(|b| {
            AppliedObject::new(
                format!(
                    "binding {} -> {} (routing key {})",
                    b.exchange, b.queue, b.routing_key
                ),
                Applied::Declared,
            )
        }));
        Ok(applied)
    }

    /// Checks the broker against `plan` as the module docs describe: each exchange is there
    /// or [`Checked::Missing`]; each queue is missing, or its probe's fate (`a probe came
    /// back to ...`, or why not), or, for a queue no probe goes through, its ready messages
    /// and consumers. Probes of earlier runs found on the way are acknowledged and noted.
    /// With the work queue missing (a wrong name, most likely) no probe is sent.
    ///
    /// A plan with a delay cascade is refused ([`TransportError::Unsupported`]): its levels
    /// are shared by every work queue of the cascade; check a plan per delay instead.
    async fn check(
        &self,
        plan: &TopologyPlan,
        options: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        if plan.cascade().is_some() {
            return Err(TransportError::Unsupported {
                what: "checking a plan with a delay cascade".into(),
                why: "a policy file gives per-delay plans: check those".into(),
            });
        }
        let conn = self.connection();
        let session = self.session(&conn);
        let max_ttl = options.max_probe_ttl.unwrap_or(DEFAULT_PROBE_TTL);
        session.check(plan, max_ttl).await
    }
}

impl AmqpTransport {
    /// Requests on `conn` with this transport's timeouts.
    fn session<'a>(&self, conn: &'a Connection) -> Session<'a> {
        Session {
            conn,
            request_timeout: self.config().request_timeout(),
            confirm_timeout: self.config().confirm_timeout(),
        }
    }
}

/// A queue as a passive declare sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QueueState {
    /// Messages ready for delivery.
    messages: u32,
    /// Consumers subscribed to it.
    consumers: u32,
}

/// Why a request to the broker failed: the broker's (or lapin's) error, or no answer in time.
enum Refused {
    Broker(lapin::Error),
    Late(Duration),
}

impl Refused {
    /// The AMQP reply code, when the broker refused.
    fn code(&self) -> Option<u16> {
        match self {
            Refused::Broker(e) => amqp_code(e),
            Refused::Late(_) => None,
        }
    }

    /// The failure of `context` (what was asked, of what), this its source.
    fn of(self, context: impl Into<String>) -> TransportError {
        match self {
            Refused::Broker(e) => TransportError::connection_failed(context, e),
            Refused::Late(after) => TransportError::connection_failed(
                context,
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {after:?}"),
                ),
            ),
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Broker(e) => e.fmt(f),
            Refused::Late(after) => write!(f, "no answer within {after:?}"),
        }
    }
}

/// `request`'s answer, or [`Refused::Late`] after `timeout`.
async fn within<T>(
    timeout: Duration,
    request: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, Refused> {
    match tokio::time::timeout(timeout, request).await {
        Ok(answer) => answer.map_err(Refused::Broker),
        Err(_) => Err(Refused::Late(timeout)),
    }
}

/// One line of a check: an object, and what is wrong with it (`None`: nothing).
struct Line {
    problem: Option<String>,
    detail: String,
}

impl Line {
    fn ok(detail: String) -> Self {
        Line {
            problem: None,
            detail,
        }
    }

    fn fail(problem: String) -> Self {
        Line {
            problem: Some(problem),
            detail: String::new(),
        }
    }

    /// The line as a report has it: `missing` is [`Checked::Missing`].
    fn checked(self) -> Checked {
        match self.problem {
            None => Checked::Ok(self.detail),
            Some(problem) if problem == "missing" => Checked::Missing,
            Some(problem) => Checked::Failed(problem),
        }
    }
}

/// A probe sent through one delay queue.
struct Probe {
    id: String,
    delay_queue: String,
    route: Route,
    expiration: Duration,
    /// Where the plan says it expires into.
    destination: String,
    sent_at: Instant,
    outcome: Outcome,
}

impl Probe {
    fn deadline(&self) -> Instant {
        self.sent_at + self.expiration + MARGIN
    }
}

/// What became of a probe.
enum Outcome {
    /// Published; not back yet.
    Pending,
    /// Not sent, or sent and lost for a reason known before waiting.
    Failed(String),
    /// Not read back: work came to the head of its destination.
    Blocked(String),
    /// Read back from `queue`.
    Arrived {
        queue: String,
        after: Duration,
        headers: Headers,
    },
}

/// What one `basic.get` took.
enum Taken {
    /// Nothing: the queue is empty.
    Empty,
    /// A probe, acknowledged.
    Probe,
    /// Something else, put back.
    Work,
}

/// The requests of one administrative call, on one connection.
struct Session<'a> {
    conn: &'a Connection,
    request_timeout: Duration,
    confirm_timeout: Duration,
}

impl Session<'_> {
    /// A new channel.
    async fn open_channel(&self) -> Result<Channel, TransportError> {
        within(self.request_timeout, self.conn.create_channel())
            .await
            .map_err(|e| e.of("cannot open a channel"))
    }

    /// A new channel in confirm mode.
    async fn confirm_channel(&self) -> Result<Channel, TransportError> {
        let channel = self.open_channel().await?;
        let selecting = channel.confirm_select(ConfirmSelectOptions::default());
        if let Err(e) = within(self.request_timeout, selecting).await {
            self.close(channel).await;
            return Err(e.of("cannot enable publisher confirms"));
        }
        Ok(channel)
    }

    /// Closes `channel`, whatever state it is in.
    async fn close(&self, channel: Channel) {
        let _ = within(self.request_timeout, channel.close(200, "done".into())).await;
    }

    /// Queue `name` as the broker has it, or `None` when there is no such queue.
    async fn queue_state(&self, name: &str) -> Result<Option<QueueState>, TransportError> {
        let short_name = short(name)?;
        // A passive declare of a missing object closes its channel: one channel per question.
        let channel = self.open_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declaring = channel.queue_declare(short_name, passive, FieldTable::default());
        match within(self.request_timeout, declaring).await {
            Ok(queue) => {
                self.close(channel).await;
                Ok(Some(QueueState {
                    messages: queue.message_count(),
                    consumers: queue.consumer_count(),
                }))
            }
            Err(e) if e.code() == Some(NOT_FOUND) => Ok(None),
            Err(e) => {
                self.close(channel).await;
                Err(e.of(format!("cannot inspect queue {name:?}")))
            }
        }
    }

    /// Whether exchange `name` exists.
    async fn exchange_exists(
        &self,
        name: &str,
        kind: ExchangeKind,
    ) -> Result<bool, TransportError> {
        let short_name = short(name)?;
        let channel = self.open_channel().await?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let declaring = channel.exchange_declare(
            short_name,
            provision::kind(kind),
            passive,
            FieldTable::default(),
        );
        match within(self.request_timeout, declaring).await {
            Ok(()) => {
                self.close(channel).await;
                Ok(true)
            }
            Err(e) if e.code() == Some(NOT_FOUND) => Ok(false),
            Err(e) => {
                self.close(channel).await;
                Err(e.of(format!("cannot inspect exchange {name:?}")))
            }
        }
    }

    /// The check of [`Admin::check`], with probes waiting `max_ttl` at most.
    async fn check(
        &self,
        plan: &TopologyPlan,
        max_ttl: Duration,
    ) -> Result<CheckReport, TransportError> {
        let mut exchanges = HashMap::new();
        for e in plan.exchanges() {
            exchanges.insert(
                e.name.as_str(),
                self.exchange_exists(&e.name, e.kind).await?,
            );
        }
        let mut queues: HashMap<&str, Option<QueueState>> = HashMap::new();
        for q in plan.queues() {
            queues.insert(q.name.as_str(), self.queue_state(&q.name).await?);
        }

        // Without the work queue (a wrong name, most likely) nothing is probed: only which
        // objects exist is reported.
        let mut probes = if queues.get(plan.work_queue()).copied().flatten().is_some() {
            plan_probes(plan, max_ttl, &exchanges, &queues)
        } else {
            Vec::new()
        };
        self.send_probes(&mut probes).await?;
        let stale = self.read_back(plan, &queues, &mut probes).await?;

        let mut objects = Vec::new();
        for e in plan.exchanges() {
            let checked = match exchanges[e.name.as_str()] {
                true => Checked::Ok(String::new()),
                false => Checked::Missing,
            };
            objects.push(ObjectCheck::new(format!("exchange {}", e.name), checked));
        }
        for q in plan.queues() {
            let line = match queues[q.name.as_str()] {
                None => Line::fail("missing".into()),
                Some(state) => match probes.iter().find(|p| p.delay_queue == q.name) {
                    Some(probe) => judge(probe, plan, &queues),
                    None => Line::ok(format!(
                        "{} ready, {} consumers",
                        state.messages, state.consumers
                    )),
                },
            };
            objects.push(
                ObjectCheck::new(format!("queue {}", q.name), line.checked()).for_queue(&q.name),
            );
        }
        let mut report = CheckReport::new(objects);
        for (queue, n) in stale {
            report = report.with_note(format!(
                "acknowledged {n} probe(s) of an earlier run found in `{queue}`"
            ));
        }
        Ok(report)
    }

    /// Publishes every pending probe, as the engine publishes a delayed copy: to its route,
    /// `mandatory`, persistent, with a per-message expiration, waiting for the confirm.
    async fn send_probes(&self, probes: &mut [Probe]) -> Result<(), TransportError> {
        if !probes.iter().any(|p| matches!(p.outcome, Outcome::Pending)) {
            return Ok(());
        }
        let mut channel = self.confirm_channel().await?;
        for probe in probes
            .iter_mut()
            .filter(|p| matches!(p.outcome, Outcome::Pending))
        {
            let route = format!(
                "exchange `{}` with routing key `{}`",
                probe.route.exchange, probe.route.routing_key
            );
            let (exchange, routing_key) = match (
                short(&probe.route.exchange),
                short(&probe.route.routing_key),
            ) {
                (Ok(exchange), Ok(routing_key)) => (exchange, routing_key),
                (Err(e), _) | (_, Err(e)) => {
                    probe.outcome =
                        Outcome::Failed(format!("cannot publish a probe to {route}: {e}"));
                    continue;
                }
            };
            let mut table = FieldTable::default();
            table.insert(
                headers::PROBE.into(),
                AMQPValue::LongString(probe.id.as_str().into()),
            );
            let properties = BasicProperties::default()
                .with_headers(table)
                .with_message_id(probe.id.as_str().into())
                .with_app_id("retryctl".into())
                .with_delivery_mode(2)
                .with_expiration(probe.expiration.as_millis().to_string().into());
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            probe.sent_at = Instant::now();
            let publishing = async {
                channel
                    .basic_publish(
                        exchange,
                        routing_key,
                        options,
                        b"retryctl topology probe",
                        properties,
                    )
                    .await?
                    .await
            };
            probe.outcome = match within(self.confirm_timeout, publishing).await {
                Ok(Confirmation::Ack(None)) => Outcome::Pending,
                Ok(Confirmation::Ack(Some(_))) => Outcome::Failed(format!(
                    "a probe published to {route} reached no queue: check the binding of `{}` \
                     to `{}`",
                    probe.delay_queue, probe.route.exchange
                )),
                Ok(Confirmation::Nack(_)) => Outcome::Failed(format!(
                    "the broker refused a probe published to {route} (negative confirm): is \
                     the queue full?"
                )),
                Ok(Confirmation::NotRequested) => Outcome::Pending,
                Err(e) => {
                    // The broker closed the channel (or it no longer answers): the next probe
                    // gets another.
                    self.close(channel).await;
                    channel = self.confirm_channel().await?;
                    Outcome::Failed(format!("cannot publish a probe to {route}: {e}"))
                }
            };
        }
        self.close(channel).await;
        Ok(())
    }

    /// Polls the plan's work, isolation and parking queues (those that had nothing ready)
    /// until every probe is back or past its deadline. Returns, per queue, how many probes
    /// of other runs were found and acknowledged.
    async fn read_back(
        &self,
        plan: &TopologyPlan,
        queues: &HashMap<&str, Option<QueueState>>,
        probes: &mut [Probe],
    ) -> Result<Vec<(String, u32)>, TransportError> {
        let mut stale: Vec<(String, u32)> = Vec::new();
        if !probes.iter().any(|p| matches!(p.outcome, Outcome::Pending)) {
            return Ok(stale);
        }
        let mut polled: Vec<&str> = plan
            .queues()
            .iter()
            .filter(|q| {
                matches!(
                    q.role,
                    QueueRole::Work | QueueRole::Isolation | QueueRole::Parking
                )
            })
            .filter(|q| queues[q.name.as_str()].is_some_and(|s| s.messages == 0))
            .map(|q| q.name.as_str())
            .collect();
        let channel = self.open_channel().await?;
        let result = self
            .poll(&channel, plan, &mut polled, probes, &mut stale)
            .await;
        // Closing the channel puts back whatever a failed poll still held.
        self.close(channel).await;
        result.map(|()| stale)
    }

    async fn poll(
        &self,
        channel: &Channel,
        plan: &TopologyPlan,
        polled: &mut Vec<&str>,
        probes: &mut [Probe],
        stale: &mut Vec<(String, u32)>,
    ) -> Result<(), TransportError> {
        loop {
            let mut i = 0;
            while i < polled.len() {
                let queue = polled[i];
                match self.take_one(channel, plan, queue, probes, stale).await? {
                    Taken::Probe => {}
                    Taken::Empty => i += 1,
                    Taken::Work => {
                        // The same message would come back on the next get: stop polling here.
                        polled.remove(i);
                        for probe in probes.iter_mut().filter(|p| {
                            p.destination == queue && matches!(p.outcome, Outcome::Pending)
                        }) {
                            probe.outcome = Outcome::Blocked(format!(
                                "a probe could not be read back: a message that is not a probe \
                                 came to the head of `{queue}` first (it was put back at once, \
                                 and the probe stays behind it: a consumer acknowledges it \
                                 without running its handler); run verify with `{queue}` \
                                 drained and its producers quiet"
                            ));
                        }
                    }
                }
            }
            let now = Instant::now();
            let waiting = probes
                .iter()
                .any(|p| matches!(p.outcome, Outcome::Pending) && now < p.deadline());
            if !waiting || polled.is_empty() {
                return Ok(());
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// Takes one message from `queue`: acknowledges a probe (recording ours), puts anything
    /// else back.
    async fn take_one(
        &self,
        channel: &Channel,
        plan: &TopologyPlan,
        queue: &str,
        probes: &mut [Probe],
        stale: &mut Vec<(String, u32)>,
    ) -> Result<Taken, TransportError> {
        let getting = channel.basic_get(short(queue)?, BasicGetOptions { no_ack: false });
        let got = within(self.request_timeout, getting)
            .await
            .map_err(|e| e.of(format!("cannot read from queue {queue:?}")))?;
        let Some(message) = got else {
            return Ok(Taken::Empty);
        };
        let delivery = message.delivery;
        let table = delivery.properties.headers().clone().unwrap_or_default();
        let message_headers = headers_from_table(&table);
        let Some(id) = message_headers.get(headers::PROBE) else {
            self.put_back(plan, queue, delivery).await?;
            return Ok(Taken::Work);
        };
        within(
            self.request_timeout,
            delivery.acker.ack(BasicAckOptions::default()),
        )
        .await
        .map_err(|e| e.of(format!("cannot acknowledge a probe in {queue:?}")))?;
        let ours = probes
            .iter_mut()
            .find(|p| id.as_str() == Some(p.id.as_str()) && matches!(p.outcome, Outcome::Pending));
        match ours {
            Some(probe) => {
                probe.outcome = Outcome::Arrived {
                    queue: queue.to_owned(),
                    after: probe.sent_at.elapsed(),
                    headers: message_headers,
                };
            }
            None => match stale.iter_mut().find(|(q, _)| q == queue) {
                Some((_, n)) => *n += 1,
                None => stale.push((queue.to_owned(), 1)),
            },
        }
        Ok(Taken::Probe)
    }

    /// Returns a message that is not a probe to `queue`. A suspect that comes back
    /// redelivered from the isolation queue counts as a crash, so a suspect not yet
    /// redelivered is cloned back there (with a confirm) and the original acknowledged, as
    /// the engine moves messages. Anything else, a suspect whose clone is not confirmed, and
    /// one the connection's tap kept from lapin (whose properties lapin never saw, so a
    /// clone would lose them) is requeued: a work delivery comes back redelivered, and so
    /// runs alone once as a suspect.
    async fn put_back(
        &self,
        plan: &TopologyPlan,
        queue: &str,
        delivery: lapin::message::Delivery,
    ) -> Result<(), TransportError> {
        let context = || format!("cannot put a message back into {queue:?}");
        let tapped = delivery
            .properties
            .headers()
            .as_ref()
            .is_some_and(|t| t.inner().contains_key(MARK));
        if queue == plan.isolation_queue()
            && !delivery.redelivered
            && !tapped
            && self.clone_to(queue, &delivery).await
        {
            return within(
                self.request_timeout,
                delivery.acker.ack(BasicAckOptions::default()),
            )
            .await
            .map(drop)
            .map_err(|e| e.of(context()));
        }
        let requeue = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        within(self.request_timeout, delivery.acker.nack(requeue))
            .await
            .map(drop)
            .map_err(|e| e.of(context()))
    }

    /// Publishes a copy of `delivery` to `queue` on a confirm channel of its own; whether
    /// the broker confirmed it into the queue.
    async fn clone_to(&self, queue: &str, delivery: &lapin::message::Delivery) -> bool {
        let Ok(publisher) = self.confirm_channel().await else {
            return false;
        };
        let Ok(routing_key) = short(queue) else {
            self.close(publisher).await;
            return false;
        };
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let publishing = async {
            publisher
                .basic_publish(
                    "".into(),
                    routing_key,
                    options,
                    &delivery.data,
                    delivery.properties.clone(),
                )
                .await?
                .await
        };
        let confirmed = within(self.confirm_timeout, publishing).await;
        self.close(publisher).await;
        matches!(confirmed, Ok(Confirmation::Ack(None)))
    }
}

/// One probe per delay and crash-delay queue of `plan`, on the route the engine uses for
/// that delay. A probe that cannot be sent or read back is made `Failed` with the reason.
fn plan_probes(
    plan: &TopologyPlan,
    max_ttl: Duration,
    exchanges: &HashMap<&str, bool>,
    queues: &HashMap<&str, Option<QueueState>>,
) -> Vec<Probe> {
    let run = run_id();
    let mut probes = Vec::new();
    for (i, (delay, route, destination)) in plan.delayed_destinations().enumerate() {
        // The queue the route leads into, by the plan's bindings.
        let Some(binding) = plan
            .bindings()
            .iter()
            .find(|b| *b.exchange == *route.exchange && *b.routing_key == *route.routing_key)
        else {
            continue;
        };
        let Some(spec) = plan.queues().iter().find(|q| q.name == binding.queue) else {
            continue;
        };
        let ttl = spec.role.ttl().unwrap_or(delay);
        let waiting_ahead = queues
            .get(spec.name.as_str())
            .copied()
            .flatten()
            .map_or(0, |s| s.messages);
        let outcome = match (
            exchanges.get(&*route.exchange).copied().unwrap_or(false),
            queues.get(spec.name.as_str()).copied().flatten(),
            queues.get(destination).copied().flatten(),
        ) {
            (false, _, _) => Outcome::Failed(format!(
                "not probed: exchange `{}` is missing",
                route.exchange
            )),
            (_, None, _) => Outcome::Failed("missing".into()),
            (_, _, None) => Outcome::Failed(format!(
                "not probed: `{destination}`, which it expires into, is missing"
            )),
            (_, Some(_), Some(dest)) if dest.messages > 0 => Outcome::Failed(format!(
                "not probed: `{destination}` has {} message(s) ready, and a probe would come \
                 back behind them; verify reads probes back without taking work, so run it \
                 with `{destination}` drained",
                dest.messages
            )),
            (_, Some(_), Some(_)) if waiting_ahead > 0 => Outcome::Failed(format!(
                "not probed: {waiting_ahead} message(s) wait in it, and would reach \
                 `{destination}` ahead of a probe; run verify when it is empty"
            )),
            _ => Outcome::Pending,
        };
        probes.push(Probe {
            id: format!("retryctl-probe-{run}-{i}"),
            delay_queue: spec.name.clone(),
            route: route.clone(),
            expiration: ttl.min(max_ttl),
            destination: destination.to_owned(),
            sent_at: Instant::now(),
            outcome,
        });
    }
    probes
}

/// An id no other run shares: the process, and the time.
fn run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{:x}", std::process::id(), nanos)
}

/// The line of the delay queue `probe` went through.
fn judge(probe: &Probe, plan: &TopologyPlan, queues: &HashMap<&str, Option<QueueState>>) -> Line {
    let dest = &probe.destination;
    let check = "check its x-dead-letter-exchange/x-dead-letter-routing-key";
    match &probe.outcome {
        Outcome::Failed(why) | Outcome::Blocked(why) => Line::fail(why.clone()),
        Outcome::Pending => {
            let within = human(probe.expiration + MARGIN);
            let mut problem =
                format!("probe did not come back to `{dest}` within {within}: {check}");
            // The isolation queue is read by the work queue's consumers, with gets.
            let consumers_of = if dest == plan.isolation_queue() {
                plan.work_queue()
            } else {
                dest.as_str()
            };
            let consumers = queues
                .get(consumers_of)
                .copied()
                .flatten()
                .map_or(0, |s| s.consumers);
            if consumers > 0 {
                problem.push_str(&format!(
                    "; `{consumers_of}` has {consumers} consumer(s), which acknowledge probes \
                     without running their handler: the check is only conclusive with them \
                     stopped"
                ));
            }
            Line::fail(problem)
        }
        Outcome::Arrived {
            queue,
            after,
            headers,
        } => {
            if queue != dest {
                return Line::fail(format!(
                    "probe came back to `{queue}` instead of `{dest}`: {check}"
                ));
            }
            match x_death(headers, &probe.delay_queue) {
                Ok(()) => Line::ok(format!(
                    "a probe came back to `{dest}` after {}, dead-lettered as expired",
                    human(*after)
                )),
                Err(why) => Line::fail(format!("probe came back to `{dest}`, but {why}")),
            }
        }
    }
}

/// `d` as an operator reads it: `225ms`, `5.5s`, `15s`.
fn human(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        return format!("{}ms", d.as_millis());
    }
    let text = format!("{:.1}", d.as_secs_f64());
    format!("{}s", text.strip_suffix(".0").unwrap_or(&text))
}

/// Whether `headers` carry an `x-death` entry saying the message expired from `delay_queue`,
/// or what they say instead.
fn x_death(headers: &Headers, delay_queue: &str) -> Result<(), String> {
    let entries: Vec<&Headers> = headers
        .get("x-death")
        .and_then(HeaderValue::as_array)
        .unwrap_or_default()
        .iter()
        .filter_map(HeaderValue::as_table)
        .collect();
    if entries.is_empty() {
        return Err("it carries no x-death header: it was not dead-lettered".into());
    }
    let field = |e: &Headers, name: &str| {
        e.get(name)
            .and_then(HeaderValue::as_str)
            .unwrap_or("?")
            .to_owned()
    };
    if entries
        .iter()
        .any(|e| field(e, "queue") == delay_queue && field(e, "reason") == "expired")
    {
        return Ok(());
    }
    let seen: Vec<String> = entries
        .iter()
        .map(|e| format!("{} from `{}`", field(e, "reason"), field(e, "queue")))
        .collect();
    Err(format!(
        "its x-death says {}, not expired from `{delay_queue}`",
        seen.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_an_operator_writes_them() {
        assert_eq!(human(Duration::from_millis(225)), "225ms");
        assert_eq!(human(Duration::from_millis(5500)), "5.5s");
        assert_eq!(human(Duration::from_secs(15)), "15s");
    }

    fn death(queue: &str, reason: &str) -> HeaderValue {
        let mut entry = Headers::new();
        entry.insert("queue", HeaderValue::Str(queue.into()));
        entry.insert("reason", HeaderValue::Str(reason.into()));
        HeaderValue::Table(entry)
    }

    #[test]
    fn x_death_must_say_expired_from_the_delay_queue() {
        let mut headers = Headers::new();
        assert_eq!(
            x_death(&headers, "q.retry.1s").unwrap_err(),
            "it carries no x-death header: it was not dead-lettered"
        );
        headers.insert("x-death", HeaderValue::Array(vec![death("q", "rejected")]));
        assert_eq!(
            x_death(&headers, "q.retry.1s").unwrap_err(),
            "its x-death says rejected from `q`, not expired from `q.retry.1s`"
        );
        headers.insert(
            "x-death",
            HeaderValue::Array(vec![death("q", "rejected"), death("q.retry.1s", "expired")]),
        );
        assert_eq!(x_death(&headers, "q.retry.1s"), Ok(()));
    }

    #[test]
    fn a_missing_line_is_reported_missing_and_others_as_they_are() {
        assert_eq!(Line::fail("missing".into()).checked(), Checked::Missing);
        assert_eq!(
            Line::fail("not probed".into()).checked(),
            Checked::Failed("not probed".into())
        );
        assert_eq!(
            Line::ok("0 ready, 0 consumers".into()).checked(),
            Checked::Ok("0 ready, 0 consumers".into())
        );
    }
}
