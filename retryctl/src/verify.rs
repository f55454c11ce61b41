//! `retryctl topology verify`: the broker checked from outside against the plan.
//!
//! Two checks. Every exchange and queue of the plan exists (passive declares, which change
//! nothing). And every delay queue routes: a probe is published the way the engine publishes
//! a delayed copy (to the plan's route into that queue, `mandatory`, with confirms), with a
//! per-message expiration of the queue's TTL or `--max-probe-ttl`, whichever is shorter, and
//! the header `x-retry-probe`. It must come back to the queue the plan says the delay queue
//! expires into, with an `x-death` entry saying it expired from that delay queue.
//!
//! Probes are read back with `basic.get` and manual acknowledgements, so that no work is
//! taken by subscription. A probe is acknowledged, which removes it; anything else that comes
//! to the head of a polled queue is put back at once (a suspect in the isolation queue as a
//! confirmed copy, since one that comes back redelivered from there counts a crash) and that
//! queue is no longer polled, since the next get would return the same message. A queue with messages ready is not polled at
//! all: a probe would come back behind them. Running consumers acknowledge probes without
//! running their handler, so the check is conclusive only with the work queue's consumers
//! stopped.
//!
//! Over AMQP 1.0 ([`verify_amqp10`]) only the first check is made, with
//! `Amqp10Transport::verify`: AMQP 1.0 can neither read bindings nor dead-letter a probe
//! back where AMQP 0-9-1 reads it.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use retry_core::{HeaderValue, Headers, QueueRole, Route, TopologyPlan, headers};
use transport_amqp091::headers_from_table;

use crate::broker::{self, QueueState};
use crate::error::CliError;
use crate::policy::{PlanArgs, role_ttl};

use crate::{outln, protocol};

/// How long past its expiration a probe may take to come back.
const MARGIN: Duration = Duration::from_secs(5);
/// How often the destination queues are polled.
const POLL_EVERY: Duration = Duration::from_millis(50);

/// `retryctl topology verify`'s arguments.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub plan: PlanArgs,

    /// The longest a probe waits in a delay queue (default 10s): each probe expires after its
    /// queue's TTL or this, whichever is shorter, and is waited for this long plus 5 s at
    /// most. AMQP 0-9-1 only: over AMQP 1.0 nothing is probed, and NATS refuses it.
    #[arg(long, value_name = "DURATION", value_parser = parse_probe_ttl)]
    pub max_probe_ttl: Option<Duration>,
}

/// `--max-probe-ttl` when not given.
const DEFAULT_PROBE_TTL: Duration = Duration::from_secs(10);

fn parse_probe_ttl(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(1) {
        return Err("must be at least 1ms (broker expirations are milliseconds)".into());
    }
    Ok(d)
}

/// One line of the report: an object, and what is wrong with it (`None`: nothing).
struct Line {
    object: String,
    problem: Option<String>,
    detail: String,
}

impl Line {
    fn ok(object: String, detail: String) -> Self {
        Line {
            object,
            problem: None,
            detail,
        }
    }

    fn fail(object: String, problem: String) -> Self {
        Line {
            object,
            problem: Some(problem),
            detail: String::new(),
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

/// Checks the broker at `url` against `plan`; prints one line per object and fails (exit 1)
/// on any mismatch.
pub async fn verify(plan: &TopologyPlan, args: &VerifyArgs, url: &str) -> Result<(), CliError> {
    refuse_cascade(plan)?;
    let transport = broker::connect(url).await?;
    let result = verify_on(
        plan,
        args,
        &transport.connection(),
        &transport.config().redacted_url(),
    )
    .await;
    let _ = transport.close().await;
    result
}

pub(crate) fn refuse_cascade(plan: &TopologyPlan) -> Result<(), CliError> {
    if plan.cascade().is_some() {
        return Err(CliError::usage(
            "plans with a delay cascade are not verified (a policy file gives per-delay plans)",
        ));
    }
    Ok(())
}

/// Checks over AMQP 1.0 that every exchange and queue of `plan` exists at `url`; prints one
/// line per object, as [`verify`] does, and fails (exit 1) when one is missing. Sends no
/// probe.
pub async fn verify_amqp10(plan: &TopologyPlan, url: &str) -> Result<(), CliError> {
    refuse_cascade(plan)?;
    let transport = protocol::connect_amqp10(url).await?;
    let at = transport.config().redacted_url();
    let checked = transport.missing(plan).await;
    transport.close().await;
    let missing = checked.map_err(|e| CliError::failure_from("cannot verify the plan", e))?;
    let work = plan.work_queue();
    if missing.contains(&format!("queue {work}")) {
        return Err(no_work_queue(work, &at));
    }
    outln!(
        "verifying work queue `{work}` on {at} over AMQP 1.0: that every object exists (the \
         probes through the delay queues need AMQP 0-9-1)"
    );
    let objects: Vec<String> = plan
        .exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)))
        .collect();
    let mut failed = 0;
    for object in &objects {
        if missing.contains(object) {
            failed += 1;
            outln!("  FAIL  {object}: missing");
        } else {
            outln!("  ok    {object}");
        }
    }
    if failed > 0 {
        return Err(CliError::failure(format!(
            "{failed} of {} checks failed: the broker does not match the plan of `{work}`",
            objects.len()
        )));
    }
    outln!("every object of the plan of `{work}` exists (its routing is not probed over AMQP 1.0)");
    Ok(())
}

pub(crate) fn no_work_queue(work: &str, at: &str) -> CliError {
    CliError::failure(format!(
        "there is no queue `{work}` on {at}: check the name, or create its topology with \
         `retryctl topology apply {work} --policy FILE`"
    ))
}

async fn verify_on(
    plan: &TopologyPlan,
    args: &VerifyArgs,
    conn: &Connection,
    at: &str,
) -> Result<(), CliError> {
    let work = plan.work_queue();
    let Some(_) = broker::queue_state(conn, work).await? else {
        return Err(no_work_queue(work, at));
    };
    outln!("verifying work queue `{work}` on {at}");

    let mut exchanges = HashMap::new();
    for e in plan.exchanges() {
        exchanges.insert(
            e.name.as_str(),
            broker::exchange_exists(conn, &e.name, e.kind).await?,
        );
    }
    let mut queues: HashMap<&str, Option<QueueState>> = HashMap::new();
    for q in plan.queues() {
        queues.insert(q.name.as_str(), broker::queue_state(conn, &q.name).await?);
    }

    let mut probes = plan_probes(
        plan,
        args.max_probe_ttl.unwrap_or(DEFAULT_PROBE_TTL),
        &exchanges,
        &queues,
    );
    send_probes(conn, &mut probes).await?;
    let stale = read_back(conn, plan, &queues, &mut probes).await?;

    let mut lines = Vec::new();
    for e in plan.exchanges() {
        let object = format!("exchange {}", e.name);
        lines.push(match exchanges[e.name.as_str()] {
            true => Line::ok(object, String::new()),
            false => Line::fail(object, "missing".into()),
        });
    }
    for q in plan.queues() {
        let object = format!("queue {}", q.name);
        let Some(state) = queues[q.name.as_str()] else {
            lines.push(Line::fail(object, "missing".into()));
            continue;
        };
        match probes.iter().find(|p| p.delay_queue == q.name) {
            Some(probe) => lines.push(judge(probe, plan, &queues, object)),
            None => lines.push(Line::ok(
                object,
                format!("{} ready, {} consumers", state.messages, state.consumers),
            )),
        }
    }
    for line in &lines {
        match &line.problem {
            None if line.detail.is_empty() => outln!("  ok    {}", line.object),
            None => outln!("  ok    {}: {}", line.object, line.detail),
            Some(problem) => outln!("  FAIL  {}: {problem}", line.object),
        }
    }
    for (queue, n) in stale {
        outln!("  note  acknowledged {n} probe(s) of an earlier run found in `{queue}`");
    }
    let failed = lines.iter().filter(|l| l.problem.is_some()).count();
    if failed > 0 {
        return Err(CliError::failure(format!(
            "{failed} of {} checks failed: the broker does not match the plan of `{work}`",
            lines.len()
        )));
    }
    outln!("the broker matches the plan of `{work}`");
    Ok(())
}

/// One probe per delay and crash-delay queue of `plan`, on the route the engine uses for that
/// delay. A probe that cannot be sent or read back is made `Failed` with the reason.
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
        let ttl = role_ttl(spec.role).unwrap_or(delay);
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

/// Publishes every pending probe, as the engine publishes a delayed copy: to its route,
/// `mandatory`, persistent, with a per-message expiration, waiting for the confirm.
async fn send_probes(conn: &Connection, probes: &mut [Probe]) -> Result<(), CliError> {
    let mut channel = confirm_channel(conn).await?;
    for probe in probes
        .iter_mut()
        .filter(|p| matches!(p.outcome, Outcome::Pending))
    {
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
        let confirmed = match channel
            .basic_publish(
                (&*probe.route.exchange).into(),
                (&*probe.route.routing_key).into(),
                options,
                b"retryctl topology probe",
                properties,
            )
            .await
        {
            Ok(confirm) => confirm.await,
            Err(e) => Err(e),
        };
        let route = format!(
            "exchange `{}` with routing key `{}`",
            probe.route.exchange, probe.route.routing_key
        );
        probe.outcome = match confirmed {
            Ok(Confirmation::Ack(None)) => Outcome::Pending,
            Ok(Confirmation::Ack(Some(_))) => Outcome::Failed(format!(
                "a probe published to {route} reached no queue: check the binding of `{}` to \
                 `{}`",
                probe.delay_queue, probe.route.exchange
            )),
            Ok(Confirmation::Nack(_)) => Outcome::Failed(format!(
                "the broker refused a probe published to {route} (negative confirm): is the \
                 queue full?"
            )),
            Ok(Confirmation::NotRequested) => Outcome::Pending,
            Err(e) => {
                // The broker closed the channel: the next probe gets another.
                broker::close(channel).await;
                channel = confirm_channel(conn).await?;
                Outcome::Failed(format!("cannot publish a probe to {route}: {e}"))
            }
        };
    }
    broker::close(channel).await;
    Ok(())
}

async fn confirm_channel(conn: &Connection) -> Result<Channel, CliError> {
    let channel = broker::open_channel(conn).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| CliError::failure_from("cannot enable publisher confirms", e))?;
    Ok(channel)
}

/// Polls the plan's work, isolation and parking queues (those that had nothing ready) until
/// every probe is back or past its deadline. Returns, per queue, how many probes of other
/// runs were found and acknowledged.
async fn read_back(
    conn: &Connection,
    plan: &TopologyPlan,
    queues: &HashMap<&str, Option<QueueState>>,
    probes: &mut [Probe],
) -> Result<Vec<(String, u32)>, CliError> {
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
    let longest = probes
        .iter()
        .filter(|p| matches!(p.outcome, Outcome::Pending))
        .map(|p| p.expiration + MARGIN)
        .max()
        .unwrap_or(MARGIN);
    let pending = probes
        .iter()
        .filter(|p| matches!(p.outcome, Outcome::Pending))
        .count();
    let spinner = ProgressBar::new_spinner()
        .with_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        )
        .with_message(format!(
            "waiting for {pending} probe(s) to come back, {} at most",
            human(longest)
        ));
    spinner.enable_steady_tick(Duration::from_millis(100));
    let channel = broker::open_channel(conn).await?;
    let result = poll(conn, &channel, plan, &mut polled, probes, &mut stale).await;
    spinner.finish_and_clear();
    broker::close(channel).await;
    result.map(|()| stale)
}

async fn poll(
    conn: &Connection,
    channel: &Channel,
    plan: &TopologyPlan,
    polled: &mut Vec<&str>,
    probes: &mut [Probe],
    stale: &mut Vec<(String, u32)>,
) -> Result<(), CliError> {
    loop {
        let mut i = 0;
        while i < polled.len() {
            let queue = polled[i];
            match take_one(conn, channel, plan, queue, probes, stale).await? {
                Taken::Probe => {}
                Taken::Empty => i += 1,
                Taken::Work => {
                    // The same message would come back on the next get: stop polling here.
                    polled.remove(i);
                    for probe in probes
                        .iter_mut()
                        .filter(|p| p.destination == queue && matches!(p.outcome, Outcome::Pending))
                    {
                        probe.outcome = Outcome::Blocked(format!(
                            "a probe could not be read back: a message that is not a probe \
                             came to the head of `{queue}` first (it was put back at once, and \
                             the probe stays behind it: a consumer acknowledges it without \
                             running its handler); run verify with `{queue}` drained and its \
                             producers quiet"
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

/// What one `basic.get` took.
enum Taken {
    /// Nothing: the queue is empty.
    Empty,
    /// A probe, acknowledged.
    Probe,
    /// Something else, put back.
    Work,
}

/// Takes one message from `queue`: acknowledges a probe (recording ours), puts anything else
/// back.
async fn take_one(
    conn: &Connection,
    channel: &Channel,
    plan: &TopologyPlan,
    queue: &str,
    probes: &mut [Probe],
    stale: &mut Vec<(String, u32)>,
) -> Result<Taken, CliError> {
    let got = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .map_err(|e| CliError::failure_from(format!("cannot read from queue {queue:?}"), e))?;
    let Some(message) = got else {
        return Ok(Taken::Empty);
    };
    let delivery = message.delivery;
    let table = delivery.properties.headers().clone().unwrap_or_default();
    let message_headers = headers_from_table(&table);
    let Some(id) = message_headers.get(headers::PROBE) else {
        put_back(conn, plan, queue, delivery).await?;
        return Ok(Taken::Work);
    };
    delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .map_err(|e| {
            CliError::failure_from(format!("cannot acknowledge a probe in {queue:?}"), e)
        })?;
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

/// Returns a message that is not a probe to `queue`. A suspect that comes back redelivered
/// from the isolation queue counts as a crash, so a suspect not yet redelivered is cloned
/// back there (with a confirm) and the original acknowledged, as the engine moves messages.
/// Anything else, and a suspect whose clone is not confirmed, is requeued: a work delivery
/// comes back redelivered, and so runs alone once as a suspect.
async fn put_back(
    conn: &Connection,
    plan: &TopologyPlan,
    queue: &str,
    delivery: lapin::message::Delivery,
) -> Result<(), CliError> {
    let failed = |e| CliError::failure_from(format!("cannot put a message back into {queue:?}"), e);
    if queue == plan.isolation_queue() && !delivery.redelivered {
        let cloned = clone_to(conn, queue, &delivery).await;
        if cloned {
            delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .map_err(failed)?;
            return Ok(());
        }
    }
    let requeue = BasicNackOptions {
        multiple: false,
        requeue: true,
    };
    delivery.acker.nack(requeue).await.map_err(failed)?;
    Ok(())
}

/// Publishes a copy of `delivery` to `queue` on a confirm channel of its own; whether the
/// broker confirmed it into the queue.
async fn clone_to(conn: &Connection, queue: &str, delivery: &lapin::message::Delivery) -> bool {
    let Ok(publisher) = conn.create_channel().await else {
        return false;
    };
    let confirmed = async {
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        publisher
            .basic_publish(
                "".into(),
                queue.into(),
                options,
                &delivery.data,
                delivery.properties.clone(),
            )
            .await?
            .await
    }
    .await;
    broker::close(publisher).await;
    matches!(confirmed, Ok(Confirmation::Ack(None)))
}

/// The report line of the delay queue `probe` went through.
fn judge(
    probe: &Probe,
    plan: &TopologyPlan,
    queues: &HashMap<&str, Option<QueueState>>,
    object: String,
) -> Line {
    let dest = &probe.destination;
    let check = "check its x-dead-letter-exchange/x-dead-letter-routing-key";
    match &probe.outcome {
        Outcome::Failed(why) | Outcome::Blocked(why) => Line::fail(object, why.clone()),
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
            Line::fail(object, problem)
        }
        Outcome::Arrived {
            queue,
            after,
            headers,
        } => {
            if queue != dest {
                return Line::fail(
                    object,
                    format!("probe came back to `{queue}` instead of `{dest}`: {check}"),
                );
            }
            let death = x_death(headers, &probe.delay_queue);
            match death {
                Ok(()) => Line::ok(
                    object,
                    format!(
                        "a probe came back to `{dest}` after {}, dead-lettered as expired",
                        human(*after)
                    ),
                ),
                Err(why) => Line::fail(object, format!("probe came back to `{dest}`, but {why}")),
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
