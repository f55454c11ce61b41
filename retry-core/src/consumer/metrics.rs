//! The consumer's metrics, emitted through the [`metrics`] facade.
//!
//! Every handle is registered once, when a run starts, with its labels; the run loop then
//! only increments or records. With no recorder installed the handles are no-ops, so the
//! loop pays a branch per metric and nothing more. A recorder installed after a run started
//! sees nothing of that run.

use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, SharedString, Unit, counter, describe_counter, describe_gauge,
    describe_histogram, gauge, histogram,
};

use crate::Lane;
use crate::headers::DeadLetterReason;
use crate::{Confirm, Terminal};

/// `retry_deliveries_total{queue, lane}`.
pub const DELIVERIES: &str = "retry_deliveries_total";
/// `retry_terminals_total{queue, lane, terminal, reason}`.
pub const TERMINALS: &str = "retry_terminals_total";
/// `retry_handler_seconds{queue, lane, outcome}`.
pub const HANDLER_SECONDS: &str = "retry_handler_seconds";
/// `retry_publish_confirm_seconds{queue, lane}`.
pub const PUBLISH_CONFIRM_SECONDS: &str = "retry_publish_confirm_seconds";
/// `retry_in_flight{queue}`.
pub const IN_FLIGHT: &str = "retry_in_flight";
/// `retry_handled_attempt{queue, lane}`.
pub const HANDLED_ATTEMPT: &str = "retry_handled_attempt";
/// `retry_storm_paused{queue}`.
pub const STORM_PAUSED: &str = "retry_storm_paused";

const CONFIRMS: [Confirm; 4] = [
    Confirm::Ack,
    Confirm::Nack,
    Confirm::Returned,
    Confirm::Failed,
];

/// How a handler run ended, as the `outcome` label of [`HANDLER_SECONDS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RunOutcome {
    Success,
    Transient,
    Permanent,
    RetryAfter,
    Panic,
    Timeout,
}

impl RunOutcome {
    /// In declaration order, so `outcome as usize` indexes it.
    const ALL: [RunOutcome; 6] = [
        RunOutcome::Success,
        RunOutcome::Transient,
        RunOutcome::Permanent,
        RunOutcome::RetryAfter,
        RunOutcome::Panic,
        RunOutcome::Timeout,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            RunOutcome::Success => "success",
            RunOutcome::Transient => "transient",
            RunOutcome::Permanent => "permanent",
            RunOutcome::RetryAfter => "retry-after",
            RunOutcome::Panic => "panic",
            RunOutcome::Timeout => "timeout",
        }
    }
}

fn confirm_index(confirm: Confirm) -> usize {
    match confirm {
        Confirm::Ack => 0,
        Confirm::Nack => 1,
        Confirm::Returned => 2,
        Confirm::Failed => 3,
    }
}

pub(super) fn confirm_label(confirm: Confirm) -> &'static str {
    match confirm {
        Confirm::Ack => "ack",
        Confirm::Nack => "nack",
        Confirm::Returned => "returned",
        Confirm::Failed => "failed",
    }
}

pub(super) fn lane_label(lane: Lane) -> &'static str {
    match lane {
        Lane::Work => "work",
        Lane::Isolation => "isolation",
    }
}

/// The handles of one lane.
struct LaneMetrics {
    deliveries: Counter,
    handled: Counter,
    retried: Counter,
    isolated: Counter,
    diverted: Counter,
    parked: [Counter; 4],
    dropped: [Counter; 4],
    requeued: [Counter; 4],
    handler: [Histogram; 6],
    publish_confirm: Histogram,
    handled_attempt: Histogram,
}

impl LaneMetrics {
    fn register(queue: &SharedString, lane: Lane) -> Self {
        let lane = lane_label(lane);
        let terminal = |terminal: &'static str, reason: Option<&'static str>| match reason {
            None => {
                counter!(TERMINALS, "queue" => queue.clone(), "lane" => lane, "terminal" => terminal)
            }
            Some(reason) => counter!(
                TERMINALS,
                "queue" => queue.clone(), "lane" => lane, "terminal" => terminal, "reason" => reason
            ),
        };
        LaneMetrics {
            deliveries: counter!(DELIVERIES, "queue" => queue.clone(), "lane" => lane),
            handled: terminal("handled", None),
            retried: terminal("retried", None),
            isolated: terminal("isolated", None),
            diverted: terminal("diverted", None),
            parked: DeadLetterReason::ALL.map(|r| terminal("parked", Some(r.as_str()))),
            dropped: DeadLetterReason::ALL.map(|r| terminal("dropped", Some(r.as_str()))),
            requeued: CONFIRMS.map(|c| terminal("requeued", Some(confirm_label(c)))),
            handler: RunOutcome::ALL.map(|o| {
                histogram!(
                    HANDLER_SECONDS,
                    "queue" => queue.clone(), "lane" => lane, "outcome" => o.as_str()
                )
            }),
            publish_confirm: histogram!(PUBLISH_CONFIRM_SECONDS, "queue" => queue.clone(), "lane" => lane),
            handled_attempt: histogram!(HANDLED_ATTEMPT, "queue" => queue.clone(), "lane" => lane),
        }
    }
}

/// The handles of one consumer run.
pub(super) struct Metrics {
    work: LaneMetrics,
    isolation: LaneMetrics,
    in_flight: Gauge,
    storm_paused: Gauge,
}

impl Metrics {
    /// Describes the metrics to the recorder and registers the handles of `queue`.
    pub(super) fn register(queue: &str) -> Self {
        describe();
        let queue = SharedString::from(queue.to_owned());
        let metrics = Metrics {
            work: LaneMetrics::register(&queue, Lane::Work),
            isolation: LaneMetrics::register(&queue, Lane::Isolation),
            in_flight: gauge!(IN_FLIGHT, "queue" => queue.clone()),
            storm_paused: gauge!(STORM_PAUSED, "queue" => queue),
        };
        metrics.in_flight.set(0.0);
        metrics.storm_paused.set(0.0);
        metrics
    }

    fn lane(&self, lane: Lane) -> &LaneMetrics {
        match lane {
            Lane::Work => &self.work,
            Lane::Isolation => &self.isolation,
        }
    }

    pub(super) fn delivered(&self, lane: Lane) {
        self.lane(lane).deliveries.increment(1);
    }

    pub(super) fn handler_ran(&self, lane: Lane, outcome: RunOutcome, took: Duration) {
        self.lane(lane).handler[outcome as usize].record(took.as_secs_f64());
    }

    pub(super) fn confirmed(&self, lane: Lane, took: Duration) {
        self.lane(lane).publish_confirm.record(took.as_secs_f64());
    }

    pub(super) fn settled(&self, lane: Lane, terminal: &Terminal) {
        let m = self.lane(lane);
        match *terminal {
            Terminal::Handled { attempt } => {
                m.handled.increment(1);
                m.handled_attempt.record(f64::from(attempt));
            }
            Terminal::Retried { .. } => m.retried.increment(1),
            Terminal::Isolated => m.isolated.increment(1),
            Terminal::Diverted { .. } => m.diverted.increment(1),
            Terminal::DeadLettered { reason } => m.parked[reason.index()].increment(1),
            Terminal::Dropped { reason } => m.dropped[reason.index()].increment(1),
            Terminal::Requeued { cause } => m.requeued[confirm_index(cause)].increment(1),
        }
    }

    pub(super) fn in_flight(&self, held: usize) {
        self.in_flight.set(held as f64);
    }

    pub(super) fn storm_paused(&self, paused: bool) {
        self.storm_paused.set(if paused { 1.0 } else { 0.0 });
    }
}

fn describe() {
    describe_counter!(
        DELIVERIES,
        "Deliveries taken from the work or isolation queue."
    );
    describe_counter!(
        TERMINALS,
        "Deliveries settled, by how they ended: handled, retried, isolated, diverted, parked, dropped or requeued."
    );
    describe_histogram!(
        HANDLER_SECONDS,
        Unit::Seconds,
        "Handler run time, by outcome."
    );
    describe_histogram!(
        PUBLISH_CONFIRM_SECONDS,
        Unit::Seconds,
        "Time from publishing a clone to its confirm."
    );
    describe_gauge!(IN_FLIGHT, "Deliveries held by the consumer.");
    describe_histogram!(
        HANDLED_ATTEMPT,
        "The attempt on which handled messages succeeded."
    );
    describe_gauge!(
        STORM_PAUSED,
        "1 while storm control holds the work lane back (paused or probing), else 0."
    );
}
