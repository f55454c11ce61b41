//! Queues: their arguments, their messages, and the order messages leave them in.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use retry_core::{HeaderValue, Headers, QueueType, Timestamp};

use crate::broker::error::BrokerError;
use crate::broker::message::{QueuedMessage, Stored};
use crate::broker::trace::DeathReason;

/// What a queue does when a publish would take it past `x-max-length`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QueueOverflow {
    /// Dead-letter (or drop) the oldest message to make room, with reason `maxlen`
    /// (RabbitMQ's default).
    #[default]
    DropHead,
    /// Refuse the publish: a negative confirm for publishers in confirm mode.
    RejectPublish,
}

impl QueueOverflow {
    fn as_str(self) -> &'static str {
        match self {
            QueueOverflow::DropHead => "drop-head",
            QueueOverflow::RejectPublish => "reject-publish",
        }
    }
}

/// The arguments of a queue, typed: the subset of RabbitMQ's `x-` arguments the retry
/// engine relies on. Build one with the `with_*` methods, from a plan's
/// [`QueueArguments`](retry_core::QueueArguments), or from an AMQP argument table with
/// [`from_arguments`].
///
/// ```
/// use transport_memory::{QueueOverflow, QueueOptions};
/// use std::time::Duration;
///
/// let delay = QueueOptions::new()
///     .with_message_ttl(Duration::from_secs(30))
///     .with_dead_letter_exchange("")
///     .with_dead_letter_routing_key("comments");
/// let bounded = QueueOptions::new().with_max_length(100).with_overflow(QueueOverflow::RejectPublish);
/// # let _ = (delay, bounded);
/// ```
///
/// [`from_arguments`]: QueueOptions::from_arguments
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueOptions {
    /// `x-queue-type`: classic or quorum.
    pub queue_type: QueueType,
    /// `x-message-ttl`: how long a message may wait in the queue.
    pub message_ttl: Option<Duration>,
    /// `x-dead-letter-exchange`; `""` is the default exchange.
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`; without it dead letters keep their routing keys.
    pub dead_letter_routing_key: Option<String>,
    /// `x-max-length`: the most ready messages the queue holds.
    pub max_length: Option<u64>,
    /// `x-overflow`.
    pub overflow: QueueOverflow,
    /// `x-delivery-limit` (quorum queues only; classic queues ignore it, as RabbitMQ does).
    pub delivery_limit: Option<u32>,
    /// `x-dead-letter-strategy: at-least-once` (quorum queues with `reject-publish` only;
    /// elsewhere RabbitMQ falls back to at-most-once and so does this model).
    pub at_least_once: bool,
}

impl QueueOptions {
    /// A classic queue with no arguments.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `x-queue-type`.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets `x-message-ttl`.
    pub fn with_message_ttl(mut self, ttl: Duration) -> Self {
        self.message_ttl = Some(ttl);
        self
    }

    /// Sets `x-dead-letter-exchange`.
    pub fn with_dead_letter_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.dead_letter_exchange = Some(exchange.into());
        self
    }

    /// Sets `x-dead-letter-routing-key`.
    pub fn with_dead_letter_routing_key(mut self, key: impl Into<String>) -> Self {
        self.dead_letter_routing_key = Some(key.into());
        self
    }

    /// Sets `x-max-length`.
    pub fn with_max_length(mut self, max: u64) -> Self {
        self.max_length = Some(max);
        self
    }

    /// Sets `x-overflow`.
    pub fn with_overflow(mut self, overflow: QueueOverflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// Sets `x-delivery-limit`.
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Sets `x-dead-letter-strategy: at-least-once`.
    pub fn with_at_least_once(mut self, on: bool) -> Self {
        self.at_least_once = on;
        self
    }

    /// Reads an AMQP argument table. Unknown arguments are ignored, as RabbitMQ ignores them;
    /// known ones with unusable values are refused, as RabbitMQ refuses them with
    /// `PRECONDITION_FAILED`.
    ///
    /// ```
    /// use retry_core::Headers;
    /// use transport_memory::{QueueOverflow, QueueOptions};
    ///
    /// let args: Headers = [("x-max-length", 2i64)].into_iter().collect();
    /// let mut args = args;
    /// args.insert("x-overflow", "reject-publish");
    /// let options = QueueOptions::from_arguments(&args)?;
    /// assert_eq!(options.max_length, Some(2));
    /// assert_eq!(options.overflow, QueueOverflow::RejectPublish);
    ///
    /// let bad: Headers = [("x-message-ttl", -1i64)].into_iter().collect();
    /// assert!(QueueOptions::from_arguments(&bad).is_err());
    /// # Ok::<(), transport_memory::BrokerError>(())
    /// ```
    pub fn from_arguments(args: &Headers) -> Result<Self, BrokerError> {
        let invalid = |argument: &str, reason: &str| BrokerError::InvalidArgument {
            argument: argument.to_owned(),
            reason: reason.to_owned(),
        };
        let int = |name: &str, max: u64| -> Result<Option<u64>, BrokerError> {
            match args.get(name) {
                None => Ok(None),
                Some(HeaderValue::Int(n)) => u64::try_from(*n)
                    .ok()
                    .filter(|n| *n <= max)
                    .map(Some)
                    .ok_or_else(|| invalid(name, "must be a non-negative integer in range")),
                Some(HeaderValue::UInt(n)) if *n <= max => Ok(Some(*n)),
                Some(_) => Err(invalid(name, "must be a non-negative integer in range")),
            }
        };
        let text = |name: &str| -> Result<Option<String>, BrokerError> {
            match args.get(name) {
                None => Ok(None),
                Some(HeaderValue::Str(s)) => Ok(Some(s.clone())),
                Some(_) => Err(invalid(name, "must be a string")),
            }
        };
        let queue_type = match text("x-queue-type")?.as_deref() {
            None | Some("classic") => QueueType::Classic,
            Some("quorum") => QueueType::Quorum,
            Some(_) => return Err(invalid("x-queue-type", "must be classic or quorum")),
        };
        let overflow = match text("x-overflow")?.as_deref() {
            None | Some("drop-head") => QueueOverflow::DropHead,
            Some("reject-publish") => QueueOverflow::RejectPublish,
            Some(_) => {
                return Err(invalid("x-overflow", "must be drop-head or reject-publish"));
            }
        };
        let at_least_once = match text("x-dead-letter-strategy")?.as_deref() {
            None | Some("at-most-once") => false,
            Some("at-least-once") => true,
            Some(_) => {
                return Err(invalid(
                    "x-dead-letter-strategy",
                    "must be at-most-once or at-least-once",
                ));
            }
        };
        Ok(QueueOptions {
            queue_type,
            message_ttl: int("x-message-ttl", u64::from(u32::MAX))?.map(Duration::from_millis),
            dead_letter_exchange: text("x-dead-letter-exchange")?,
            dead_letter_routing_key: text("x-dead-letter-routing-key")?,
            max_length: int("x-max-length", i64::MAX as u64)?,
            overflow,
            delivery_limit: int("x-delivery-limit", u64::from(u32::MAX))?
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
            at_least_once,
        })
    }

    /// The first argument on which `self` (what the broker has) and `wanted` differ, as
    /// (argument, existing, wanted), in RabbitMQ's spelling.
    pub(crate) fn difference(&self, wanted: &QueueOptions) -> Option<(String, String, String)> {
        fn show<T: std::fmt::Debug>(v: &Option<T>) -> String {
            match v {
                Some(v) => format!("{v:?}"),
                None => "none".to_owned(),
            }
        }
        let ms = |d: &Option<Duration>| d.map(|d| d.as_millis());
        let checks: [(&str, String, String); 8] = [
            (
                "x-queue-type",
                queue_type_str(self.queue_type).to_owned(),
                queue_type_str(wanted.queue_type).to_owned(),
            ),
            (
                "x-message-ttl",
                show(&ms(&self.message_ttl)),
                show(&ms(&wanted.message_ttl)),
            ),
            (
                "x-dead-letter-exchange",
                show(&self.dead_letter_exchange),
                show(&wanted.dead_letter_exchange),
            ),
            (
                "x-dead-letter-routing-key",
                show(&self.dead_letter_routing_key),
                show(&wanted.dead_letter_routing_key),
            ),
            (
                "x-max-length",
                show(&self.max_length),
                show(&wanted.max_length),
            ),
            (
                "x-overflow",
                self.overflow.as_str().to_owned(),
                wanted.overflow.as_str().to_owned(),
            ),
            (
                "x-delivery-limit",
                show(&self.delivery_limit),
                show(&wanted.delivery_limit),
            ),
            (
                "x-dead-letter-strategy",
                strategy_str(self.at_least_once).to_owned(),
                strategy_str(wanted.at_least_once).to_owned(),
            ),
        ];
        checks
            .into_iter()
            .find(|(_, a, b)| a != b)
            .map(|(name, a, b)| (name.to_owned(), a, b))
    }

    /// Whether dead-lettering is at-least-once: RabbitMQ honours the strategy only on quorum
    /// queues that refuse publishes when full.
    pub(crate) fn effective_at_least_once(&self) -> bool {
        self.at_least_once
            && self.queue_type == QueueType::Quorum
            && self.overflow == QueueOverflow::RejectPublish
            && self.dead_letter_exchange.is_some()
    }
}

fn queue_type_str(t: QueueType) -> &'static str {
    match t {
        QueueType::Classic => "classic",
        QueueType::Quorum => "quorum",
    }
}

fn strategy_str(at_least_once: bool) -> &'static str {
    if at_least_once {
        "at-least-once"
    } else {
        "at-most-once"
    }
}

/// A queue's state: its messages, its consumers, and who waits for it.
#[derive(Debug)]
pub(crate) struct Queue {
    name: Arc<str>,
    options: QueueOptions,
    /// The options' dead-letter exchange and key, shared by every dead letter.
    dead_letter_exchange: Option<Arc<str>>,
    dead_letter_routing_key: Option<Arc<str>>,
    ready: VecDeque<Stored>,
    /// Consumers as (connection, consumer index), served round-robin.
    consumers: Vec<(usize, usize)>,
    next_consumer: usize,
    unacked: usize,
    /// At-least-once dead letters that could not be routed yet; retried when the topology
    /// changes, as RabbitMQ retries them until they are routed.
    stuck_dead_letters: Vec<(Stored, DeathReason)>,
    /// Clients waiting for a message to be ready here (a watch of the isolation queue).
    watchers: Vec<Waker>,
}

impl Queue {
    pub(crate) fn new(name: Arc<str>, options: QueueOptions) -> Self {
        Queue {
            name,
            dead_letter_exchange: options.dead_letter_exchange.as_deref().map(Arc::from),
            dead_letter_routing_key: options.dead_letter_routing_key.as_deref().map(Arc::from),
            options,
            ready: VecDeque::new(),
            consumers: Vec::new(),
            next_consumer: 0,
            unacked: 0,
            stuck_dead_letters: Vec::new(),
            watchers: Vec::new(),
        }
    }

    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    pub(crate) fn options(&self) -> &QueueOptions {
        &self.options
    }

    pub(crate) fn is_quorum(&self) -> bool {
        self.options.queue_type == QueueType::Quorum
    }

    /// Where its dead letters go: `None` when it has no dead-letter exchange.
    pub(crate) fn dead_letter_exchange(&self) -> Option<&Arc<str>> {
        self.dead_letter_exchange.as_ref()
    }

    /// The routing key its dead letters get; `None` keeps theirs.
    pub(crate) fn dead_letter_routing_key(&self) -> Option<&Arc<str>> {
        self.dead_letter_routing_key.as_ref()
    }

    /// Whether a quorum queue's delivery limit is passed at `delivery_count` returns.
    pub(crate) fn over_delivery_limit(&self, delivery_count: u32) -> bool {
        self.options
            .delivery_limit
            .is_some_and(|limit| delivery_count > limit)
    }

    /// When the message entering now expires: the lower of the queue's TTL and the message's
    /// own expiration.
    pub(crate) fn expiry_for(
        &self,
        now: Timestamp,
        expiration: Option<Duration>,
    ) -> Option<Timestamp> {
        let ttl = match (self.options.message_ttl, expiration) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        ttl.map(|t| now + t)
    }

    /// Whether it refuses a publish now: `reject-publish` and full. A classic queue refuses
    /// the publish that would exceed the limit; a quorum queue only refuses once it is over
    /// the limit, so it takes one message past it.
    pub(crate) fn refuses_publish(&self) -> bool {
        let full = |max: u64| match self.is_quorum() {
            true => self.ready.len() as u64 > max,
            false => self.ready.len() as u64 >= max,
        };
        self.options.overflow == QueueOverflow::RejectPublish
            && self.options.max_length.is_some_and(full)
    }

    /// Whether no message is ready.
    pub(crate) fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    /// The ready messages, head first.
    pub(crate) fn ready(&self) -> impl Iterator<Item = &Stored> {
        self.ready.iter()
    }

    /// The number of ready messages.
    pub(crate) fn ready_len(&self) -> usize {
        self.ready.len()
    }

    pub(crate) fn head(&self) -> Option<&Stored> {
        self.ready.front()
    }

    pub(crate) fn pop_head(&mut self) -> Option<Stored> {
        self.ready.pop_front()
    }

    /// Adds a message at the tail.
    pub(crate) fn push(&mut self, message: Stored) {
        self.ready.push_back(message);
    }

    /// Adds a message at the head, where a duplicate of the message just delivered waits.
    pub(crate) fn push_front(&mut self, message: Stored) {
        self.ready.push_front(message);
    }

    /// The oldest message, when `drop-head` must make room under `x-max-length`.
    pub(crate) fn take_over_max_length(&mut self) -> Option<Stored> {
        let max = self.options.max_length?;
        if self.options.overflow != QueueOverflow::DropHead || self.ready.len() as u64 <= max {
            return None;
        }
        self.ready.pop_front()
    }

    /// Puts a returned message back in its place: returns are rare and go near the head, so
    /// scan from the front.
    pub(crate) fn put_back(&mut self, message: Stored) {
        let at = self
            .ready
            .iter()
            .position(|m| m.seq > message.seq)
            .unwrap_or(self.ready.len());
        self.ready.insert(at, message);
    }

    /// When the head expires, if it does. Only the head expires: RabbitMQ drops or
    /// dead-letters expired messages when they reach the head, so a message with a long TTL
    /// holds back shorter ones behind it.
    pub(crate) fn head_expiry(&self) -> Option<Timestamp> {
        self.ready.front().and_then(|m| m.expires_at)
    }

    /// Copies of the ready messages, head first.
    pub(crate) fn snapshot(&self) -> Vec<QueuedMessage> {
        self.ready
            .iter()
            .map(|m| QueuedMessage {
                key: m.key,
                label: m.label.clone(),
                exchange: m.exchange.to_string(),
                routing_key: m.routing_key.to_string(),
                body: m.body.clone(),
                properties: m.properties.clone(),
                headers: m.headers.clone(),
                expiration: m.expiration,
                expires_at: m.expires_at,
                redelivered: m.redelivered,
                delivery_count: m.delivery_count,
            })
            .collect()
    }

    /// Adds consumer `consumer` of connection `conn`.
    pub(crate) fn add_consumer(&mut self, conn: usize, consumer: usize) {
        self.consumers.push((conn, consumer));
    }

    /// Removes consumer `consumer` of connection `conn`, if it is here; the round-robin
    /// starts over.
    pub(crate) fn remove_consumer(&mut self, conn: usize, consumer: usize) {
        self.consumers.retain(|&c| c != (conn, consumer));
        self.next_consumer = 0;
    }

    pub(crate) fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    /// The next consumer with room for a delivery, round-robin; `has_room` says which have.
    pub(crate) fn next_consumer(
        &mut self,
        has_room: impl Fn(usize, usize) -> bool,
    ) -> Option<(usize, usize)> {
        let n = self.consumers.len();
        for i in 0..n {
            let at = (self.next_consumer + i) % n;
            let (conn, consumer) = self.consumers[at];
            if has_room(conn, consumer) {
                self.next_consumer = (at + 1) % n;
                return Some((conn, consumer));
            }
        }
        None
    }

    /// A message left for a client, unacknowledged.
    pub(crate) fn delivered(&mut self) {
        self.unacked += 1;
    }

    /// An unacknowledged message was settled or came back.
    pub(crate) fn settled(&mut self) {
        self.unacked -= 1;
    }

    /// Messages delivered and not yet settled.
    pub(crate) fn unacked(&self) -> usize {
        self.unacked
    }

    /// Keeps an at-least-once dead letter that reached no queue.
    pub(crate) fn push_stuck(&mut self, message: Stored, reason: DeathReason) {
        self.stuck_dead_letters.push((message, reason));
    }

    /// The dead letters waiting for a route, to try again.
    pub(crate) fn take_stuck(&mut self) -> Vec<(Stored, DeathReason)> {
        std::mem::take(&mut self.stuck_dead_letters)
    }

    /// The dead letters waiting for a route.
    pub(crate) fn stuck(&self) -> impl Iterator<Item = &Stored> {
        self.stuck_dead_letters.iter().map(|(m, _)| m)
    }

    pub(crate) fn stuck_len(&self) -> usize {
        self.stuck_dead_letters.len()
    }

    /// Wakes `waker` when a message is ready here with no consumer to take it.
    pub(crate) fn watch(&mut self, waker: &Waker) {
        if !self.watchers.iter().any(|w| w.will_wake(waker)) {
            self.watchers.push(waker.clone());
        }
    }

    /// The clients watching, to wake.
    pub(crate) fn take_watchers(&mut self) -> Vec<Waker> {
        std::mem::take(&mut self.watchers)
    }
}
