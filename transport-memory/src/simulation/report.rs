//! What a simulation run came to: where each message ended, what it went through, and the
//! trace.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use retry_core::{DeadLetterReason, RunReport, Terminal, Timestamp, format_delay};

use crate::broker::trace::{Elapsed, Trace, describe_terminal};
use crate::simulation::script::Step;

/// Where a message ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fate {
    /// A handler succeeded on it.
    Handled {
        /// The virtual time its handler succeeded.
        at: Timestamp,
        /// On which run number (the engine's attempt).
        attempt: u32,
    },
    /// It waits in the parking queue.
    Parked {
        /// Why: the engine's `x-retry-reason`, or the broker's `x-death` reason when the
        /// broker parked it (a quorum delivery limit).
        reason: String,
    },
    /// It was dropped, as the policy allows.
    Dropped {
        /// The rule that let it go, e.g. attempts exhausted under `Exhausted::Drop`.
        reason: DeadLetterReason,
    },
    /// It is still on its way: in this queue, or held by a consumer when `None`.
    Pending {
        /// The queue holding a copy, if one does.
        queue: Option<String>,
    },
    /// It is nowhere: not handled, parked or dropped, and in no queue. A bug.
    Lost,
}

impl fmt::Display for Fate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fate::Handled { attempt, .. } => write!(f, "handled on attempt {attempt}"),
            Fate::Parked { reason } => write!(f, "parked ({reason})"),
            Fate::Dropped { reason } => write!(f, "dropped ({reason})"),
            Fate::Pending { queue: Some(q) } => write!(f, "pending in {q}"),
            Fate::Pending { queue: None } => f.write_str("pending, held by a consumer"),
            Fate::Lost => f.write_str("LOST"),
        }
    }
}

/// How one handler run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// When it started.
    pub at: Timestamp,
    /// The engine's run number.
    pub attempt: u32,
    /// The simulation's consumer number.
    pub consumer: u32,
    /// Whether it ran alone: a suspect taken from the isolation queue.
    pub solo: bool,
    /// What it did: its script's step, or for your own handler, `Succeed` or `Fail` with
    /// the error's text.
    pub step: Step,
    /// Whether it came to that end: `false` when it was cut short, its consumer dying first
    /// (another message crashed it), the handler timeout or a shutdown cancelling it, or a
    /// `Hang`.
    pub ended: bool,
}

/// One thing that happened to a message, in [`MessageReport::events`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageEvent<'a> {
    /// A handler run started.
    Run(&'a Run),
    /// The driver reported how a delivery ended.
    Ended(Timestamp, &'a Terminal),
}

impl MessageEvent<'_> {
    /// When it happened.
    pub fn at(&self) -> Timestamp {
        match self {
            MessageEvent::Run(r) => r.at,
            MessageEvent::Ended(at, _) => *at,
        }
    }
}

/// Which list an event of a message is in, in the order things happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Happened {
    Run(usize),
    Ended(usize),
}

/// One message's story.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct MessageReport {
    /// Its `message-id`.
    pub id: String,
    /// When it was published.
    pub published_at: Timestamp,
    /// Where it ended.
    pub fate: Fate,
    /// Every handler run, in order.
    pub runs: Vec<Run>,
    /// How each delivery of it ended, as the driver reported.
    pub terminals: Vec<(Timestamp, Terminal)>,
    /// The delays the engine sent it through, in order (retries and crash diversions).
    pub delays: Vec<Duration>,
    /// Crashes counted by the engine (diversions, and the crash-loop park): solo runs that
    /// took their consumer down.
    pub crashes: u32,
    /// Times it came back redelivered from the work queue and was isolated as a suspect.
    pub isolations: u32,
    /// Fetches of it lost in flight ([`SimEvent::LoseFetches`](crate::SimEvent::LoseFetches),
    /// [`FaultRates::lost_fetches`](crate::FaultRates::lost_fetches)), each sending it back
    /// to its queue redelivered through no crash of its own.
    pub lost_fetches: u32,
    /// Copies that ended beyond the first (handled, parked or dropped again): the
    /// duplicates that at-least-once delivery allows.
    pub duplicates: u32,
    pub(crate) order: Vec<Happened>,
}

impl MessageReport {
    /// The highest attempt any run reached.
    pub fn attempts(&self) -> u32 {
        self.runs.iter().map(|r| r.attempt).max().unwrap_or(0)
    }

    /// Its runs and outcomes interleaved as they happened (copies of one message can run at
    /// the same instant).
    pub fn events(&self) -> impl Iterator<Item = MessageEvent<'_>> + '_ {
        self.order.iter().filter_map(|h| match *h {
            Happened::Run(i) => self.runs.get(i).map(MessageEvent::Run),
            Happened::Ended(i) => self
                .terminals
                .get(i)
                .map(|(at, t)| MessageEvent::Ended(*at, t)),
        })
    }

    /// A readable timeline of the message: runs and outcomes with times since `start`.
    pub fn timeline(&self, start: Timestamp) -> String {
        let line = |at: Timestamp, text: &str| {
            let since = at.as_millis().saturating_sub(start.as_millis());
            format!("{:>15}  {text}\n", Elapsed(since).to_string())
        };
        let mut out = line(self.published_at, "published");
        for e in self.events() {
            let text = match e {
                MessageEvent::Run(r) => format!(
                    "run, attempt {} on consumer {}: {}",
                    r.attempt, r.consumer, r.step
                ),
                MessageEvent::Ended(_, t) => describe_terminal(t),
            };
            out.push_str(&line(e.at(), &text));
        }
        out.push_str(&format!("{:>15}  => {}\n", "", self.fate));
        out
    }
}

/// Totals over all messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Totals {
    /// Messages the simulation follows: those it published, and any other a handler ran
    /// on (followed from that first run).
    pub published: u64,
    /// Messages handled.
    pub handled: u64,
    /// Messages parked.
    pub parked: u64,
    /// Messages dropped by the policy.
    pub dropped: u64,
    /// Messages still on their way.
    pub pending: u64,
    /// Messages nowhere at all.
    pub lost: u64,
    /// Extra copies that ended (handled, parked or dropped) beyond each message's first.
    pub duplicates: u64,
    /// Handler runs.
    pub runs: u64,
    /// Deliveries to consumers.
    pub deliveries: u64,
}

/// Why a run stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Nothing was left to run and nothing was due.
    Quiet,
    /// The virtual-time limit was reached with work still due.
    Horizon,
}

/// A consumer process of the simulation and how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerReport {
    /// Its number.
    pub number: u32,
    /// `Running` until stopped; the driver's report when it returned; `Crashed` when it
    /// was killed.
    pub state: ConsumerState,
}

/// How a simulated consumer process ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConsumerState {
    /// Still running.
    Running,
    /// Killed by a crash.
    Crashed,
    /// Its run returned this report.
    Finished(RunReport),
    /// Its run returned an error.
    Failed(String),
}

/// The result of a simulation run.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Report {
    /// Why the run stopped.
    pub stop: Stop,
    /// The virtual time the simulation started at.
    pub started_at: Timestamp,
    /// The virtual time it stopped at.
    pub ended_at: Timestamp,
    /// Every message published through the simulation, by id.
    pub messages: BTreeMap<String, MessageReport>,
    /// The consumer processes.
    pub consumers: Vec<ConsumerReport>,
    /// The event trace (empty when tracing is off).
    pub trace: Trace,
    /// Deliveries to consumers.
    pub deliveries: u64,
}

impl Report {
    /// The story of the message `id`.
    pub fn message(&self, id: &str) -> Option<&MessageReport> {
        self.messages.get(id)
    }

    /// Where the message `id` ended.
    pub fn fate(&self, id: &str) -> Option<&Fate> {
        self.message(id).map(|m| &m.fate)
    }

    /// Virtual time the run covered.
    pub fn elapsed(&self) -> Duration {
        self.ended_at.saturating_duration_since(self.started_at)
    }

    /// Totals over all messages.
    pub fn totals(&self) -> Totals {
        let mut t = Totals {
            deliveries: self.deliveries,
            ..Totals::default()
        };
        for m in self.messages.values() {
            t.published += 1;
            t.runs += m.runs.len() as u64;
            t.duplicates += u64::from(m.duplicates);
            match m.fate {
                Fate::Handled { .. } => t.handled += 1,
                Fate::Parked { .. } => t.parked += 1,
                Fate::Dropped { .. } => t.dropped += 1,
                Fate::Pending { .. } => t.pending += 1,
                Fate::Lost => t.lost += 1,
            }
        }
        t
    }

    /// A one-line summary per message: id, fate, runs and delays.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for m in self.messages.values() {
            let delays: Vec<String> = m.delays.iter().map(|d| format_delay(*d)).collect();
            out.push_str(&format!(
                "{:<12} {:<36} runs {:>2}  crashes {}  delays [{}]\n",
                m.id,
                m.fate.to_string(),
                m.runs.len(),
                m.crashes,
                delays.join(", ")
            ));
        }
        out
    }
}
