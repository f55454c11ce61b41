//! The event trace: everything the broker and the simulation did, with virtual timestamps.

use std::fmt;
use std::sync::Arc;

use retry_core::{Terminal, Timestamp, format_delay};

use crate::broker::message::MessageKey;

/// A message as the trace names it: its key and its `message-id` (or key) label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageRef {
    /// The identity shared by all its copies.
    pub key: MessageKey,
    /// Its `message-id`, or its key when it has none.
    pub label: Arc<str>,
}

impl MessageRef {
    pub(crate) fn new(key: MessageKey, label: &Arc<str>) -> Self {
        MessageRef {
            key,
            label: label.clone(),
        }
    }
}

/// Who published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Publisher {
    /// A producer outside any consumer connection (the test itself).
    Producer,
    /// A client connection, such as a consumer's engine publishing a clone.
    Connection(u64),
}

/// What became of a publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Confirmed, and routed to these queues (none for a non-mandatory unroutable publish,
    /// which the broker confirms and drops).
    Routed(Vec<Arc<str>>),
    /// Refused with a negative confirm: a full `reject-publish` queue, or an injected fault.
    Refused,
    /// Returned: `mandatory` and unroutable.
    Returned,
    /// Lost before reaching the broker (an injected fault): the publisher sees a failure.
    Lost,
    /// Routed, but the confirm was lost (an injected fault): the publisher sees a failure
    /// and the message is in the queues all the same.
    ConfirmLost(Vec<Arc<str>>),
    /// Failed: the connection is closed or the exchange does not exist.
    Failed(Arc<str>),
}

/// Why the broker dead-lettered a message: the `reason` of its `x-death` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeathReason {
    /// Its TTL ran out.
    Expired,
    /// A consumer rejected it without requeue.
    Rejected,
    /// The queue was over `x-max-length` with `drop-head`.
    MaxLen,
    /// A quorum queue's `x-delivery-limit` was passed.
    DeliveryLimit,
}

impl DeathReason {
    /// RabbitMQ's spelling in `x-death`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Expired => "expired",
            DeathReason::Rejected => "rejected",
            DeathReason::MaxLen => "maxlen",
            DeathReason::DeliveryLimit => "delivery_limit",
        }
    }
}

impl fmt::Display for DeathReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One thing that happened.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EventKind {
    /// A message was published.
    Published {
        /// The message.
        message: MessageRef,
        /// Who published it.
        by: Publisher,
        /// To which exchange.
        exchange: Arc<str>,
        /// With which routing key.
        routing_key: Arc<str>,
        /// What became of it.
        outcome: PublishOutcome,
    },
    /// A message was delivered to a consumer.
    Delivered {
        /// The message.
        message: MessageRef,
        /// From which queue.
        queue: Arc<str>,
        /// To which connection.
        connection: u64,
        /// Its delivery tag there.
        tag: u64,
        /// The redelivered flag.
        redelivered: bool,
    },
    /// A delivery was acknowledged.
    Acked {
        /// The message.
        message: MessageRef,
        /// Its queue.
        queue: Arc<str>,
        /// Its delivery tag.
        tag: u64,
    },
    /// A delivery was requeued by its consumer, or returned because its connection closed.
    Requeued {
        /// The message.
        message: MessageRef,
        /// Its queue.
        queue: Arc<str>,
        /// Its delivery tag.
        tag: u64,
        /// Whether a consumer asked for it (otherwise its connection closed).
        by_consumer: bool,
    },
    /// A message was dead-lettered.
    DeadLettered {
        /// The message.
        message: MessageRef,
        /// The queue it left.
        queue: Arc<str>,
        /// What made the queue dead-letter it: rejected, expired, over its length limit or
        /// its delivery limit.
        reason: DeathReason,
        /// The dead-letter exchange.
        exchange: Arc<str>,
        /// The routing key it was dead-lettered with.
        routing_key: Arc<str>,
        /// The queues it reached.
        routed: Vec<Arc<str>>,
    },
    /// A message was removed for good by the broker.
    Discarded {
        /// The message.
        message: MessageRef,
        /// The queue it left.
        queue: Arc<str>,
        /// What removed it and why it went nowhere, e.g. "expired, no dead-letter exchange".
        why: &'static str,
    },
    /// A client connected.
    ConnectionOpened {
        /// The connection.
        connection: u64,
    },
    /// A connection closed; its unacknowledged deliveries went back to their queues.
    ConnectionClosed {
        /// The connection.
        connection: u64,
        /// What closed it, as the broker words it: the client, a fault, the consumer timeout.
        reason: Arc<str>,
    },
    /// A consumer started.
    ConsumerStarted {
        /// Its connection.
        connection: u64,
        /// Its queue.
        queue: Arc<str>,
        /// Its prefetch.
        prefetch: u16,
    },
    /// A fault was injected.
    Fault {
        /// The fault and what it hit, e.g. which publish was lost or refused.
        description: Arc<str>,
    },
    /// A handler run began.
    HandlerStarted {
        /// The message.
        message: MessageRef,
        /// The simulation's consumer number.
        consumer: u32,
        /// The run number the engine gave it.
        attempt: u32,
    },
    /// A handler run ended (a crash ends none: the consumer dies with it).
    HandlerFinished {
        /// The message.
        message: MessageRef,
        /// The simulation's consumer number.
        consumer: u32,
        /// How it ended, as text.
        outcome: Arc<str>,
    },
    /// The driver reported how a delivery ended.
    Terminal {
        /// The message.
        message: MessageRef,
        /// The engine's terminal for the delivery: handled, retried, isolated, parked...
        terminal: Terminal,
    },
    /// A simulated consumer process started.
    ConsumerAttached {
        /// Its number.
        consumer: u32,
        /// Its connection.
        connection: u64,
    },
    /// A simulated consumer process died.
    ConsumerCrashed {
        /// Its number.
        consumer: u32,
        /// What killed it: a scripted crash, a random crash, or its handler.
        reason: Arc<str>,
    },
    /// A simulated consumer's run ended.
    ConsumerStopped {
        /// Its number.
        consumer: u32,
        /// How it ended, as text.
        outcome: Arc<str>,
    },
}

/// An event at a virtual time.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// The virtual time it happened at.
    pub at: Timestamp,
    /// What happened.
    pub kind: EventKind,
}

impl EventKind {
    /// The message the event is about, if any.
    pub fn message(&self) -> Option<&MessageRef> {
        match self {
            EventKind::Published { message, .. }
            | EventKind::Delivered { message, .. }
            | EventKind::Acked { message, .. }
            | EventKind::Requeued { message, .. }
            | EventKind::DeadLettered { message, .. }
            | EventKind::Discarded { message, .. }
            | EventKind::HandlerStarted { message, .. }
            | EventKind::HandlerFinished { message, .. }
            | EventKind::Terminal { message, .. } => Some(message),
            _ => None,
        }
    }
}

/// The events of a run, in order, with the virtual time the run started at.
///
/// `Display` renders one line per event with the time since the start; the text is
/// deterministic, so two runs of the same script can be compared as strings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    start: Timestamp,
    events: Vec<Event>,
}

impl Trace {
    pub(crate) fn new(start: Timestamp) -> Self {
        Trace {
            start,
            events: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, at: Timestamp, kind: EventKind) {
        self.events.push(Event { at, kind });
    }

    /// When the run started.
    pub fn start(&self) -> Timestamp {
        self.start
    }

    /// The events.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Only the events about the message labelled `label`.
    pub fn for_message(&self, label: &str) -> Trace {
        Trace {
            start: self.start,
            events: self
                .events
                .iter()
                .filter(|e| e.kind.message().is_some_and(|m| &*m.label == label))
                .cloned()
                .collect(),
        }
    }

    /// The rendered text.
    pub fn render(&self) -> String {
        self.to_string()
    }
}

/// `HH:MM:SS.mmm` since the start, with a day count in front past the first day.
pub(crate) struct Elapsed(pub(crate) u64);

impl fmt::Display for Elapsed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0;
        let (days, rest) = (ms / 86_400_000, ms % 86_400_000);
        let (h, m, s, milli) = (
            rest / 3_600_000,
            rest / 60_000 % 60,
            rest / 1000 % 60,
            rest % 1000,
        );
        if days > 0 {
            write!(f, "{days}d{h:02}:{m:02}:{s:02}.{milli:03}")
        } else {
            write!(f, "{h:02}:{m:02}:{s:02}.{milli:03}")
        }
    }
}

fn queues(f: &mut fmt::Formatter<'_>, routed: &[Arc<str>]) -> fmt::Result {
    if routed.is_empty() {
        return f.write_str("no queue");
    }
    for (i, q) in routed.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        f.write_str(q)?;
    }
    Ok(())
}

/// A short human form of how a delivery ended.
pub(crate) fn describe_terminal(t: &Terminal) -> String {
    match t {
        Terminal::Handled { attempt } => format!("handled on attempt {attempt}"),
        Terminal::Retried { attempts, delay } => {
            format!("retry {attempts} scheduled in {}", format_delay(*delay))
        }
        Terminal::Isolated => "suspect: isolated to run alone".to_owned(),
        Terminal::Diverted { crashes, delay } if delay.is_zero() => {
            format!("crash {crashes}: back to the isolation queue")
        }
        Terminal::Diverted { crashes, delay } => {
            format!("crash {crashes}: diverted for {}", format_delay(*delay))
        }
        Terminal::DeadLettered { reason } => format!("parked ({reason})"),
        Terminal::Dropped { reason } => format!("dropped ({reason})"),
        Terminal::Requeued { cause } => format!("requeued: publish got {cause:?}"),
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventKind::Published {
                message,
                by,
                exchange,
                routing_key,
                outcome,
            } => {
                write!(f, "publish   {:<8} ", message.label)?;
                match by {
                    Publisher::Producer => f.write_str("by producer")?,
                    Publisher::Connection(c) => write!(f, "by conn {c}")?,
                }
                write!(f, " to {exchange:?}/{routing_key:?}: ")?;
                match outcome {
                    PublishOutcome::Routed(q) => {
                        f.write_str("-> ")?;
                        queues(f, q)
                    }
                    PublishOutcome::Refused => f.write_str("nacked"),
                    PublishOutcome::Returned => f.write_str("returned unroutable"),
                    PublishOutcome::Lost => f.write_str("lost in transit"),
                    PublishOutcome::ConfirmLost(q) => {
                        f.write_str("confirm lost, but -> ")?;
                        queues(f, q)
                    }
                    PublishOutcome::Failed(why) => write!(f, "failed: {why}"),
                }
            }
            EventKind::Delivered {
                message,
                queue,
                connection,
                tag,
                redelivered,
            } => {
                write!(
                    f,
                    "deliver   {:<8} {queue} -> conn {connection} tag {tag}",
                    message.label
                )?;
                if *redelivered {
                    f.write_str(" (redelivered)")?;
                }
                Ok(())
            }
            EventKind::Acked {
                message,
                queue,
                tag,
            } => write!(f, "ack       {:<8} {queue} tag {tag}", message.label),
            EventKind::Requeued {
                message,
                queue,
                tag,
                by_consumer,
            } => {
                let why = if *by_consumer {
                    "requeued by consumer"
                } else {
                    "returned: connection closed"
                };
                write!(f, "requeue   {:<8} {queue} tag {tag}: {why}", message.label)
            }
            EventKind::DeadLettered {
                message,
                queue,
                reason,
                exchange,
                routing_key,
                routed,
            } => {
                write!(
                    f,
                    "dead-ltr  {:<8} {queue} ({reason}) via {exchange:?}/{routing_key:?} -> ",
                    message.label
                )?;
                queues(f, routed)
            }
            EventKind::Discarded {
                message,
                queue,
                why,
            } => write!(f, "discard   {:<8} {queue}: {why}", message.label),
            EventKind::ConnectionOpened { connection } => {
                write!(f, "connect   conn {connection}")
            }
            EventKind::ConnectionClosed { connection, reason } => {
                write!(f, "close     conn {connection}: {reason}")
            }
            EventKind::ConsumerStarted {
                connection,
                queue,
                prefetch,
            } => write!(
                f,
                "consume   conn {connection} on {queue}, prefetch {prefetch}"
            ),
            EventKind::Fault { description } => write!(f, "FAULT     {description}"),
            EventKind::HandlerStarted {
                message,
                consumer,
                attempt,
            } => write!(
                f,
                "run       {:<8} attempt {attempt} on consumer {consumer}",
                message.label
            ),
            EventKind::HandlerFinished {
                message,
                consumer,
                outcome,
            } => write!(
                f,
                "result    {:<8} {outcome} (consumer {consumer})",
                message.label
            ),
            EventKind::Terminal { message, terminal } => {
                write!(
                    f,
                    "outcome   {:<8} {}",
                    message.label,
                    describe_terminal(terminal)
                )
            }
            EventKind::ConsumerAttached {
                consumer,
                connection,
            } => write!(f, "start     consumer {consumer} on conn {connection}"),
            EventKind::ConsumerCrashed { consumer, reason } => {
                write!(f, "CRASH     consumer {consumer}: {reason}")
            }
            EventKind::ConsumerStopped { consumer, outcome } => {
                write!(f, "stop      consumer {consumer}: {outcome}")
            }
        }
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for e in &self.events {
            let since = e.at.as_millis().saturating_sub(self.start.as_millis());
            writeln!(f, "{:>15}  {}", Elapsed(since).to_string(), e.kind)?;
        }
        Ok(())
    }
}
