//! `retryctl parked`: list, show, replay and purge a work queue's parked messages.
//!
//! Every command walks the parking queue with [`ParkingLot`]: messages it does not take stay
//! where they are, unchanged, and one message at a time is held in memory, whatever the
//! length of the queue.
//!
//! The commands run on whatever transport the registry connects ([`DynTransport`]): its
//! [`Admin`] counts the queues and says which messages hide headers a replay would lose.

use std::ops::ControlFlow;

use clap::{ArgGroup, Args, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use retry_core::{
    Admin, Depth, DynTransport, ParkedFilter, ParkedReason, ParkingError, ParkingLot,
    ReplayOptions, Timestamp, TopologyPlan, Transport, TransportError,
};

use crate::broker::{Broker, depth};
use crate::error::CliError;
use crate::present::{
    hidden_headers_refusal, message_json, message_text, parse_when, record_json, record_line,
    replay_line, walk_error_text,
};
use crate::runtime::{block_on, outln};

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

/// Runs a `parked` subcommand against `broker`, over the transport its URL calls for.
pub fn run(command: ParkedCommand, broker: &Broker) -> Result<(), CliError> {
    if let ParkedCommand::Purge { yes: false, .. } = command {
        return Err(CliError::usage(
            "purge removes the selected messages for good: add --yes to confirm",
        ));
    }
    block_on(broker.with_transport(&[], async |transport| run_on(command, transport).await))
}

async fn run_on(command: ParkedCommand, transport: &DynTransport) -> Result<(), CliError> {
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
            if transport.may_hide_headers() {
                refuse_hidden_headers(transport, &lot, &queue, &select.filter.filter()).await?;
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
async fn open(
    transport: &DynTransport,
    queue: &QueueArgs,
    replays: bool,
) -> Result<(ParkingLot<DynTransport>, Option<u64>), CliError> {
    let parking = queue.parking_queue();
    let total = match depth(transport, &parking).await? {
        Depth::Missing => return Err(no_parking_queue(queue)),
        Depth::Ready(n) => Some(n),
        Depth::Unknown => None,
    };
    if replays && matches!(depth(transport, &queue.queue).await?, Depth::Missing) {
        return Err(no_work_queue(queue));
    }
    let lot = ParkingLot::with_queues(transport.clone(), queue.queue.as_str(), parking);
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

/// Refuses a replay (exit 2) when a message it selects may have headers the transport does
/// not show: its copy would go out without them.
async fn refuse_hidden_headers(
    transport: &DynTransport,
    lot: &ParkingLot<DynTransport>,
    queue: &QueueArgs,
    filter: &ParkedFilter,
) -> Result<(), CliError> {
    let (hidden, why) = count_hidden_headers(transport, lot, filter)
        .await
        .map_err(|e| walk_error("reading", queue, e))?;
    hidden_headers_refusal(hidden, lot.parking_queue(), why.as_deref())
}

/// How many of the messages `filter` selects may have headers the transport does not show,
/// and what it says of the first.
pub(crate) async fn count_hidden_headers(
    transport: &DynTransport,
    lot: &ParkingLot<DynTransport>,
    filter: &ParkedFilter,
) -> Result<(u64, Option<String>), ParkingError> {
    let mut hidden = 0u64;
    let mut why = None;
    lot.browse(filter, |parked| {
        if let Some(said) = transport.hidden_headers(parked.message()) {
            hidden += 1;
            why.get_or_insert(said);
        }
        ControlFlow::Continue(())
    })
    .await?;
    Ok((hidden, why))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_must_be_above_zero() {
        assert_eq!(parse_rate("2.5"), Ok(2.5));
        for bad in ["0", "-1", "NaN", "inf", "fast"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }
}
