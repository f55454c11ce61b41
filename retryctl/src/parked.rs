//! `retryctl parked`: list, show, replay and purge a work queue's parked messages.
//!
//! Every command walks the parking queue with [`ParkingLot`]: messages it does not take stay
//! where they are, unchanged, and one message at a time is held in memory, whatever the
//! length of the queue.
//!
//! The commands are generic over the transport ([`retry_core::Transport`]): AMQP 0-9-1
//! (`AmqpTransport`), AMQP 1.0 (`Amqp10Transport`) or NATS JetStream (`NatsTransport`), as
//! [`Protocol`] says.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{ArgGroup, Args, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use retry_core::headers::{self, PREVIOUS_ERROR, PREVIOUS_REASON, REPLAYED_AT, REPLAYS};
use retry_core::{
    Headers, ParkedFilter, ParkedMessage, ParkedReason, ParkedRecord, ParkingError, ParkingLot,
    ParkingReport, Properties, ReplayOptions, Timestamp, TopologyPlan, Transport, TransportError,
};
use serde_json::{Value, json};
use transport_amqp10::{Amqp10Transport, NATIVE_HEADER};
use transport_amqp091::AmqpTransport;
use transport_nats::NatsTransport;

use crate::error::CliError;
use crate::protocol::{self, Protocol};
use crate::render::{header_json, hex};
use crate::{Broker, block_on, broker, outln};

/// The `parked` subcommands.
#[derive(Debug, Subcommand)]
pub enum ParkedCommand {
    /// One line per parked message: id, reason, attempts, crashes, when it was parked and
    /// the last error. Takes nothing from the queue.
    List {
        #[command(flatten)]
        queue: QueueArgs,
        #[command(flatten)]
        filter: FilterArgs,
        /// Lists at most this many.
        #[arg(long, value_name = "N")]
        limit: Option<u64>,
        /// One JSON object per line, with every diagnostic field.
        #[arg(long)]
        json: bool,
    },
    /// One parked message in full: its record, properties, headers, and body (as text when
    /// it is UTF-8, in hex otherwise). Takes nothing from the queue.
    Show {
        #[command(flatten)]
        queue: QueueArgs,
        /// The message id.
        #[arg(long, value_name = "ID")]
        id: String,
        /// The message as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Replays the selected messages to the work queue: each copy with its counters reset
    /// and its history kept, published with a confirm before the parked original is
    /// removed. Prints how many were replayed and how many left.
    Replay {
        #[command(flatten)]
        queue: QueueArgs,
        #[command(flatten)]
        select: Selection,
        /// At most this many replays per second.
        #[arg(long, value_name = "N", value_parser = parse_rate)]
        rate: Option<f64>,
        /// Counts what would be replayed, and replays nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Removes the selected messages for good. Refuses to run without --yes.
    Purge {
        #[command(flatten)]
        queue: QueueArgs,
        #[command(flatten)]
        select: Selection,
        /// Confirms that the selected messages are to be removed for good.
        #[arg(long)]
        yes: bool,
    },
}

/// The work queue, and the parking queue when it is not the plan's.
#[derive(Debug, Args)]
pub struct QueueArgs {
    /// The work queue, e.g. `comments`; its parking queue is `QUEUE.parking`.
    #[arg(value_name = "QUEUE")]
    queue: String,
    /// The parking queue, when it is not `QUEUE.parking`.
    #[arg(long, value_name = "NAME")]
    parking: Option<String>,
}

impl QueueArgs {
    fn parking_queue(&self) -> String {
        self.parking
            .clone()
            .unwrap_or_else(|| TopologyPlan::parking_queue_of(&self.queue))
    }
}

/// Conditions that narrow which parked messages a command takes; every one given must
/// hold.
#[derive(Debug, Args)]
pub struct FilterArgs {
    /// Only messages with this message id (repeat it for several).
    #[arg(long = "id", value_name = "ID")]
    ids: Vec<String>,
    /// Only messages parked for this reason: attempts-exhausted, max-elapsed, permanent,
    /// crash-loop, unknown (no engine headers) or malformed.
    #[arg(long, value_name = "R")]
    reason: Option<ParkedReason>,
    /// Only messages parked before this time: an RFC 3339 time
    /// (`2026-12-01T09:30:00Z`) or a duration ago (`2h`).
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    parked_before: Option<Timestamp>,
    /// Only messages parked at or after this time: an RFC 3339 time or a duration ago.
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    parked_after: Option<Timestamp>,
}

impl FilterArgs {
    fn filter(&self) -> ParkedFilter {
        let mut filter = if self.ids.is_empty() {
            ParkedFilter::all()
        } else {
            ParkedFilter::ids(self.ids.iter().cloned())
        };
        if let Some(reason) = self.reason {
            filter = filter.with_reason(reason);
        }
        if let Some(t) = self.parked_before {
            filter = filter.parked_before(t);
        }
        if let Some(t) = self.parked_after {
            filter = filter.parked_after(t);
        }
        filter
    }
}

/// Which messages a replay or a purge takes: some, by filter, or `--all`.
#[derive(Debug, Args)]
#[command(group(
    ArgGroup::new("selection")
        .required(true)
        .multiple(true)
        .args(["ids", "reason", "parked_before", "parked_after", "all"]),
))]
pub struct Selection {
    #[command(flatten)]
    filter: FilterArgs,
    /// Every parked message.
    #[arg(long, conflicts_with_all = ["ids", "reason", "parked_before", "parked_after"])]
    all: bool,
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(rate),
        _ => Err("must be a number of messages per second above 0".into()),
    }
}

/// An RFC 3339 time, or a duration before now.
pub(crate) fn parse_when(text: &str) -> Result<Timestamp, String> {
    if let Ok(t) = humantime::parse_rfc3339_weak(text) {
        return Ok(Timestamp::from_system_time(t));
    }
    match humantime::parse_duration(text) {
        Ok(ago) => Ok(Timestamp::from_system_time(
            SystemTime::now().checked_sub(ago).unwrap_or(UNIX_EPOCH),
        )),
        Err(_) => Err(
            "expected an RFC 3339 time (2026-12-01T09:30:00Z) or a duration ago (2h, 30m)".into(),
        ),
    }
}

/// Runs a `parked` subcommand against `broker`, over the protocol it calls for.
pub fn run(command: ParkedCommand, broker: &Broker<'_>) -> Result<(), CliError> {
    if let ParkedCommand::Purge { yes: false, .. } = command {
        return Err(CliError::usage(
            "purge removes the selected messages for good: add --yes to confirm",
        ));
    }
    let protocol = broker.protocol()?;
    block_on(async {
        match protocol {
            Protocol::Amqp091 => {
                let transport = Arc::new(broker::connect(broker.url).await?);
                let result = run_on(command, &transport).await;
                let _ = transport.close().await;
                result
            }
            Protocol::Amqp10 => {
                let transport = Arc::new(protocol::connect_amqp10(broker.url).await?);
                let result = run_on(command, &transport).await;
                transport.close().await;
                result
            }
            Protocol::Nats => {
                let transport = Arc::new(protocol::connect_nats(broker.url, 1).await?);
                let result = run_on(command, &transport).await;
                transport.close().await;
                result
            }
        }
    })
}

/// What a queue holds, as far as the protocol can tell without taking anything.
pub(crate) enum Depth {
    /// There is no such queue.
    Missing,
    /// It exists, with this many messages ready.
    Ready(u64),
    /// The protocol cannot tell: the walk finds out.
    Unknown,
}

/// What the `parked` commands ask of a transport besides walking and publishing.
pub(crate) trait Inspect: Transport {
    /// Whether a message can hold headers this protocol does not show, which a copy
    /// replayed over it would lose: a replay first checks that none of the selected
    /// messages is one ([`hides_headers`](Self::hides_headers)).
    const MAY_HIDE_HEADERS: bool = false;

    /// Whether `parked` may have headers this protocol does not show.
    fn hides_headers(_parked: &ParkedMessage) -> bool {
        false
    }

    /// Queue `name`'s [`Depth`].
    async fn depth(&self, name: &str) -> Result<Depth, CliError>;
}

/// A passive declare.
impl Inspect for AmqpTransport {
    async fn depth(&self, name: &str) -> Result<Depth, CliError> {
        Ok(match broker::queue_state(&self.connection(), name).await? {
            Some(state) => Depth::Ready(u64::from(state.messages)),
            None => Depth::Missing,
        })
    }
}

/// transport-amqp10 offers no count or existence check of a single queue: a missing
/// parking queue fails the walk, a missing work queue the first replayed copy (which stays
/// parked), and both are reported as over AMQP 0-9-1.
///
/// RabbitMQ 3.x shows AMQP 1.0 clients none of the headers of a message published over AMQP
/// 0-9-1 (one parked by an AMQP 0-9-1 consumer): such a message reads as having no
/// application properties, only the transport's own [`NATIVE_HEADER`].
impl Inspect for Amqp10Transport {
    const MAY_HIDE_HEADERS: bool = true;

    fn hides_headers(parked: &ParkedMessage) -> bool {
        parked
            .message()
            .headers()
            .iter()
            .all(|(name, _)| name == NATIVE_HEADER)
    }

    async fn depth(&self, _: &str) -> Result<Depth, CliError> {
        Ok(Depth::Unknown)
    }
}

/// The messages stored in the queue's stream (`NatsTransport::count`): a parking stream
/// (limits retention) holds exactly what is parked, a work stream also what is being
/// handled. Every header of a message stored on NATS is read, so nothing is hidden; a
/// replayed copy is published to the work queue's subject with its PubAck awaited (the
/// stream's confirm), and only then is the parked original deleted from its stream.
impl Inspect for NatsTransport {
    async fn depth(&self, name: &str) -> Result<Depth, CliError> {
        match self.count(name).await {
            Ok(n) => Ok(Depth::Ready(n)),
            Err(TransportError::MissingAddress { .. }) => Ok(Depth::Missing),
            Err(e) => Err(CliError::failure_from(
                format!("cannot inspect queue {name:?}"),
                e,
            )),
        }
    }
}

async fn run_on<T: Inspect>(command: ParkedCommand, transport: &Arc<T>) -> Result<(), CliError> {
    match command {
        ParkedCommand::List {
            queue,
            filter,
            limit,
            json,
        } => {
            let (lot, total) = open(transport, &queue, false).await?;
            list(&lot, &queue, &filter.filter(), limit, json, total).await
        }
        ParkedCommand::Show { queue, id, json } => {
            let (lot, _) = open(transport, &queue, false).await?;
            show(&lot, &queue, &id, json).await
        }
        ParkedCommand::Replay {
            queue,
            select,
            rate,
            dry_run,
        } => {
            let (lot, total) = open(transport, &queue, true).await?;
            if T::MAY_HIDE_HEADERS {
                refuse_hidden_headers::<T>(&lot, &queue, &select.filter.filter()).await?;
            }
            let mut options = ReplayOptions::default().with_dry_run(dry_run);
            if let Some(rate) = rate {
                options = options.with_rate(rate);
            }
            let progress = progress_bar(total);
            let result = lot
                .replay(&select.filter.filter(), options, |r| {
                    progress.set_position(r.seen)
                })
                .await;
            progress.finish_and_clear();
            let report = result.map_err(|e| walk_error("replay", &queue, e))?;
            if dry_run {
                outln!(
                    "dry run: {} would be replayed to {}; replayed 0, left {} in {}",
                    report.matched,
                    lot.work_queue(),
                    report.left,
                    lot.parking_queue()
                );
            } else {
                outln!(
                    "{}",
                    replay_line(&report, lot.work_queue(), lot.parking_queue())
                );
            }
            Ok(())
        }
        ParkedCommand::Purge { queue, select, .. } => {
            let (lot, total) = open(transport, &queue, false).await?;
            let progress = progress_bar(total);
            let result = lot
                .purge(&select.filter.filter(), |r| progress.set_position(r.seen))
                .await;
            progress.finish_and_clear();
            let report = result.map_err(|e| walk_error("purge", &queue, e))?;
            outln!(
                "purged {}, left {} in {}",
                report.purged,
                report.left,
                lot.parking_queue()
            );
            Ok(())
        }
    }
}

/// The parking lot of `queue`, and how many messages its parking queue has ready, when the
/// protocol can tell. Fails, naming the queue, when the parking queue (or, for a replay, the
/// work queue) is known not to exist.
async fn open<T: Inspect>(
    transport: &Arc<T>,
    queue: &QueueArgs,
    replays: bool,
) -> Result<(ParkingLot<Arc<T>>, Option<u64>), CliError> {
    let parking = queue.parking_queue();
    let total = match transport.depth(&parking).await? {
        Depth::Missing => return Err(no_parking_queue(queue)),
        Depth::Ready(n) => Some(n),
        Depth::Unknown => None,
    };
    if replays && matches!(transport.depth(&queue.queue).await?, Depth::Missing) {
        return Err(no_work_queue(queue));
    }
    let lot = ParkingLot::with_queues(Arc::clone(transport), queue.queue.as_str(), parking);
    Ok((lot, total))
}

fn no_parking_queue(queue: &QueueArgs) -> CliError {
    let parking = queue.parking_queue();
    let hint = if queue.parking.is_some() {
        String::new()
    } else {
        format!(
            " (the parking queue of work queue {:?}; --parking names another)",
            queue.queue
        )
    };
    CliError::failure(format!("parking queue {parking:?} does not exist{hint}"))
}

fn no_work_queue(queue: &QueueArgs) -> CliError {
    CliError::failure(format!(
        "work queue {:?} does not exist: replays go to it",
        queue.queue
    ))
}

/// Refuses a replay (exit 2) when a message it selects may have headers the protocol does
/// not show: its copy would go out without them.
async fn refuse_hidden_headers<T: Inspect>(
    lot: &ParkingLot<Arc<T>>,
    queue: &QueueArgs,
    filter: &ParkedFilter,
) -> Result<(), CliError> {
    let hidden = count_hidden_headers::<T>(lot, filter)
        .await
        .map_err(|e| walk_error("reading", queue, e))?;
    hidden_headers_refusal(hidden, lot.parking_queue())
}

/// What a replay did, as `retryctl parked replay` and the console say it: the messages the
/// transport could not copy (left parked) are named when there are some.
pub(crate) fn replay_line(report: &ParkingReport, work: &str, parking: &str) -> String {
    let mut line = format!(
        "replayed {} to {work}, left {} in {parking}",
        report.replayed, report.left
    );
    if report.uncopyable > 0 {
        line.push_str(&format!(
            " ({} of them could not be copied: messages the transport could not read as \
             they came; read or purge them)",
            report.uncopyable
        ));
    }
    line
}

/// How many of the messages `filter` selects may have headers the protocol does not show.
async fn count_hidden_headers<T: Inspect>(
    lot: &ParkingLot<Arc<T>>,
    filter: &ParkedFilter,
) -> Result<u64, ParkingError> {
    let mut hidden = 0u64;
    lot.browse(filter, |parked| {
        if T::hides_headers(&parked) {
            hidden += 1;
        }
        ControlFlow::Continue(())
    })
    .await?;
    Ok(hidden)
}

/// The refusal of a replay that selects `hidden` messages whose headers the protocol does
/// not show, if any.
pub(crate) fn hidden_headers_refusal(hidden: u64, parking: &str) -> Result<(), CliError> {
    if hidden == 0 {
        return Ok(());
    }
    Err(CliError::usage(format!(
        "nothing replayed: {hidden} of the selected messages in {parking} show no headers over \
         AMQP 1.0, as RabbitMQ 3.x shows a message published over AMQP 0-9-1 (one parked by an \
         AMQP 0-9-1 consumer), and a copy replayed over AMQP 1.0 would lose them: replay over \
         AMQP 0-9-1 (without --protocol amqp10)"
    )))
}

/// A parking-lot error as the command reports it. A queue found missing only by the walk (a
/// protocol that cannot look first) is reported as [`open`] reports it.
fn walk_error(what: &str, queue: &QueueArgs, e: ParkingError) -> CliError {
    let done = e.report();
    let cause = match &e {
        ParkingError::Interrupted { source, .. } => source,
        e => e,
    };
    if done.replayed == 0 && done.purged == 0 {
        match cause {
            ParkingError::UnknownQueue { .. } => return no_parking_queue(queue),
            ParkingError::CopyRefused {
                source: Some(TransportError::MissingAddress { .. }),
                ..
            } => return no_work_queue(queue),
            _ => {}
        }
    }
    CliError::failure_from(walk_error_text(what, &done), e)
}

/// What a walk that failed after doing `done` says.
pub(crate) fn walk_error_text(what: &str, done: &ParkingReport) -> String {
    if *done == ParkingReport::default() {
        format!("{what} failed")
    } else {
        format!(
            "{what} stopped after {} replayed and {} purged; every other message is still parked",
            done.replayed, done.purged
        )
    }
}

/// A progress bar on standard error, hidden when that is not a terminal; without a total, a
/// count.
fn progress_bar(total: Option<u64>) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
    let template = match total {
        Some(_) => "{bar:40} {pos}/{len} read ({per_sec}, {eta} left)",
        None => "{spinner} {pos} read ({per_sec})",
    };
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

async fn list<T: Transport>(
    lot: &ParkingLot<T>,
    queue: &QueueArgs,
    filter: &ParkedFilter,
    limit: Option<u64>,
    json: bool,
    total: Option<u64>,
) -> Result<(), CliError> {
    // The table's header comes with the first line, or after a walk that listed none: not
    // before an error that only the walk finds (a missing queue, over AMQP 1.0).
    let header = || {
        outln!(
            "{:<24} {:<18} {:>8} {:>7}  {:<24}  LAST ERROR",
            "ID",
            "REASON",
            "ATTEMPTS",
            "CRASHES",
            "PARKED AT"
        );
    };
    let mut listed = 0u64;
    let mut stopped = false;
    let report = lot
        .browse(filter, |parked| {
            if limit.is_some_and(|n| listed >= n) {
                stopped = true;
                return ControlFlow::Break(());
            }
            if !json && listed == 0 {
                header();
            }
            listed += 1;
            if json {
                outln!("{}", record_json(&parked));
            } else {
                outln!("{}", record_line(&parked));
            }
            if limit.is_some_and(|n| listed >= n) {
                stopped = true;
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .await
        .map_err(|e| walk_error("listing", queue, e))?;
    if !json {
        if listed == 0 {
            header();
        }
        // A walk that went to the end counted the queue.
        let Some(total) = total.or((!stopped).then_some(report.seen)) else {
            outln!(
                "{listed} listed; {} read in {}, which may hold more",
                report.seen,
                lot.parking_queue()
            );
            return Ok(());
        };
        let seen = if report.seen < total {
            format!(", {} of them read", report.seen)
        } else {
            String::new()
        };
        outln!(
            "{listed} listed; {total} parked in {}{seen}",
            lot.parking_queue()
        );
    }
    Ok(())
}

async fn show<T: Transport>(
    lot: &ParkingLot<T>,
    queue: &QueueArgs,
    id: &str,
    json: bool,
) -> Result<(), CliError> {
    let mut found = None;
    lot.browse(&ParkedFilter::ids([id]), |parked| {
        found = Some(parked);
        ControlFlow::Break(())
    })
    .await
    .map_err(|e| walk_error("reading", queue, e))?;
    let Some(parked) = found else {
        return Err(CliError::failure(format!(
            "no message with id {id:?} in {}",
            lot.parking_queue()
        )));
    };
    if json {
        let text = serde_json::to_string_pretty(&message_json(&parked))
            .map_err(|e| CliError::failure_from("cannot write the message as JSON", e))?;
        outln!("{text}");
    } else {
        outln!("{}", message_text(&parked, lot.parking_queue()).trim_end());
    }
    Ok(())
}

/// A time as RFC 3339, to the millisecond, in UTC.
pub(crate) fn time_text(t: Timestamp) -> String {
    let system = UNIX_EPOCH.checked_add(Duration::from_millis(t.as_millis()));
    match system {
        Some(t) => humantime::format_rfc3339_millis(t).to_string(),
        None => format!("{} ms", t.as_millis()),
    }
}

/// Text cut to its first line, with control characters shown as spaces and `…` where
/// something was cut.
pub(crate) fn one_line(text: &str, max_chars: usize) -> String {
    let first = text.lines().next().unwrap_or("");
    let mut out: String = first
        .chars()
        .take(max_chars)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if first.chars().count() > max_chars || first.len() < text.trim_end().len() {
        out.push('…');
    }
    out
}

/// Whether a counter of the engine's record has a value on this message: its header is
/// there, or it is attempts or crashes and the message carries the engine's record at all
/// (clones leave out those counters when they are 0, see `EngineHeaders::write_into`).
fn counter_known(headers: &Headers, name: &str) -> bool {
    headers.get(name).is_some()
        || ([headers::ATTEMPTS, headers::CRASHES].contains(&name)
            && (headers.get(headers::ORIGIN_QUEUE).is_some()
                || headers.get(headers::REASON).is_some()))
}

/// A counter of the engine's record as a list shows it: `malformed` when its header is
/// unusable, `-` when the message has none.
fn counter_field(headers: &Headers, record: &ParkedRecord<'_>, name: &str, n: u32) -> String {
    if record.malformed.contains(name) {
        "malformed".into()
    } else if counter_known(headers, name) {
        n.to_string()
    } else {
        "-".into()
    }
}

fn record_line(parked: &ParkedMessage) -> String {
    let headers = parked.message().headers();
    let record = parked.record();
    let attempts = counter_field(headers, &record, headers::ATTEMPTS, record.attempts);
    let crashes = counter_field(headers, &record, headers::CRASHES, record.crashes);
    let parked_at = match parked.parked_at() {
        Some(t) => time_text(t),
        None if record.malformed.contains(headers::LAST_FAILURE) => "malformed".into(),
        None => "-".into(),
    };
    let error = match record.last_error {
        Some(e) => one_line(e, 120),
        None if record.malformed.contains(headers::LAST_ERROR) => "malformed".into(),
        None => "-".into(),
    };
    format!(
        "{:<24} {:<18} {:>8} {:>7}  {:<24}  {error}",
        id_text(parked),
        parked.reason().as_str(),
        attempts,
        crashes,
        parked_at
    )
}

pub(crate) fn id_text(parked: &ParkedMessage) -> String {
    parked
        .id()
        .map_or_else(|| "(no id)".to_owned(), |id| one_line(id, 64))
}

/// Every diagnostic field of a parked message.
pub(crate) fn record_json(parked: &ParkedMessage) -> Value {
    record_json_of(parked.id(), parked.message().headers())
}

/// Every diagnostic field of a parked message with message id `id` and `headers`: a field is
/// `"malformed"` when its header is unusable and `null` when the message has no value for
/// it (a header left out because it held its default has one: see `ParkedRecord`).
pub(crate) fn record_json_of(id: Option<&str>, headers: &Headers) -> Value {
    let r = ParkedRecord::decode(headers);
    let time = |t: Option<Timestamp>| t.map_or(Value::Null, |t| json!(time_text(t)));
    let f = |name: &str, value: Value| {
        if r.malformed.contains(name) {
            json!("malformed")
        } else {
            value
        }
    };
    let count = |name: &str, n: u32| {
        f(
            name,
            if counter_known(headers, name) {
                json!(n)
            } else {
                Value::Null
            },
        )
    };
    json!({
        "id": id,
        "reason": ParkedReason::of(headers).as_str(),
        "attempts": count(headers::ATTEMPTS, r.attempts),
        "crashes": count(headers::CRASHES, r.crashes),
        "parked_at": time(retry_core::parked_at(headers)),
        "first_failure": f(headers::FIRST_FAILURE, time(r.first_failure)),
        "last_failure": f(headers::LAST_FAILURE, time(r.last_failure)),
        "last_error": f(headers::LAST_ERROR, json!(r.last_error)),
        "origin_queue": f(headers::ORIGIN_QUEUE, json!(r.origin_queue)),
        "origin_exchange": f(headers::ORIGIN_EXCHANGE, json!(r.origin_exchange)),
        "origin_routing_key": f(headers::ORIGIN_ROUTING_KEY, json!(r.origin_routing_key)),
        "replays": count(REPLAYS, r.replays),
        "replayed_at": f(REPLAYED_AT, time(r.replayed_at)),
        "previous_reason": f(PREVIOUS_REASON, json!(r.previous_reason)),
        "previous_error": f(PREVIOUS_ERROR, json!(r.previous_error)),
        "malformed": r.malformed.names().collect::<Vec<_>>(),
    })
}

pub(crate) fn properties_json(p: &Properties) -> Value {
    json!({
        "content_type": p.content_type,
        "content_encoding": p.content_encoding,
        "message_id": p.message_id,
        "correlation_id": p.correlation_id,
        "reply_to": p.reply_to,
        "timestamp": p.timestamp.map(time_text),
        "priority": p.priority,
        "type": p.kind,
        "app_id": p.app_id,
        "persistent": p.persistent,
    })
}

/// The body as JSON: text when it is UTF-8, hex otherwise.
fn body_json(body: &[u8]) -> Value {
    match std::str::from_utf8(body) {
        Ok(text) => json!({ "length": body.len(), "text": text }),
        Err(_) => json!({ "length": body.len(), "hex": hex(body) }),
    }
}

fn message_json(parked: &ParkedMessage) -> Value {
    let message = parked.message();
    json!({
        "record": record_json(parked),
        "properties": properties_json(message.properties()),
        "headers": Value::Object(
            message
                .headers()
                .iter()
                .map(|(k, v)| (k.to_owned(), header_json(v)))
                .collect(),
        ),
        "body": body_json(message.body()),
    })
}

/// A message in full, as text.
fn message_text(parked: &ParkedMessage, parking: &str) -> String {
    use std::fmt::Write as _;
    let message = parked.message();
    let mut out = String::new();
    let _ = writeln!(out, "message {} in {parking}", id_text(parked));
    let _ = writeln!(out, "\nrecord");
    if let Value::Object(fields) = record_json(parked) {
        for (name, value) in fields {
            if !value.is_null() && value != json!([]) {
                let _ = writeln!(out, "  {name:<19} {}", value_text(&value));
            }
        }
    }
    let _ = writeln!(out, "\nproperties");
    if let Value::Object(fields) = properties_json(message.properties()) {
        for (name, value) in fields {
            if !value.is_null() {
                let _ = writeln!(out, "  {name:<19} {}", value_text(&value));
            }
        }
    }
    let _ = writeln!(out, "\nheaders");
    let width = message.headers().iter().map(|(k, _)| k.len()).max();
    for (name, value) in message.headers().iter() {
        let mut text = value_text(&header_json(value));
        if [headers::FIRST_FAILURE, headers::LAST_FAILURE, REPLAYED_AT].contains(&name)
            && let Some(ms) = value.as_u64()
        {
            text = format!("{text} ({})", time_text(Timestamp::from_millis(ms)));
        }
        let _ = writeln!(out, "  {name:<w$}  {text}", w = width.unwrap_or(0));
    }
    let body = message.body();
    match std::str::from_utf8(body) {
        Ok(text) => {
            let _ = writeln!(out, "\nbody ({} bytes, UTF-8)", body.len());
            for line in text.lines() {
                let _ = writeln!(out, "  {line}");
            }
        }
        Err(_) => {
            let _ = writeln!(out, "\nbody ({} bytes, not UTF-8, in hex)", body.len());
            for (i, chunk) in body.chunks(16).enumerate() {
                let _ = writeln!(out, "  {:08x}  {}", i * 16, hex(chunk));
            }
        }
    }
    out
}

/// A JSON value as a line of text: strings without their quotes, but for the empty one.
fn value_text(value: &Value) -> String {
    match value {
        Value::String(s) if s.is_empty() => "\"\"".into(),
        Value::String(s) => one_line(s, 200),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(", "),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_cuts_at_the_first_line_and_marks_the_cut() {
        assert_eq!(one_line("timeout", 120), "timeout");
        assert_eq!(one_line("first\nsecond", 120), "first…");
        assert_eq!(one_line("tab\there", 120), "tab here");
        assert_eq!(one_line("abcdef", 3), "abc…");
        assert_eq!(one_line("", 3), "");
        assert_eq!(one_line("trailing newline\n", 120), "trailing newline");
    }

    #[test]
    fn when_reads_a_time_or_a_duration_ago() {
        assert_eq!(
            parse_when("2026-12-01T09:30:00Z"),
            Ok(Timestamp::from_millis(1_796_117_400_000))
        );
        let two_hours_ago = parse_when("2h").unwrap();
        let now = Timestamp::from_system_time(SystemTime::now());
        let ago = now.saturating_duration_since(two_hours_ago);
        assert!(
            ago >= Duration::from_secs(7199) && ago <= Duration::from_secs(7201),
            "{ago:?}"
        );
        assert!(parse_when("yesterday").is_err());
    }

    #[test]
    fn a_rate_must_be_above_zero() {
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        for bad in ["0", "-1", "NaN", "inf", "fast"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn time_text_is_rfc3339_in_utc() {
        assert_eq!(
            time_text(Timestamp::from_millis(1_796_117_400_123)),
            "2026-12-01T09:30:00.123Z"
        );
    }
}
