//! Queues: their arguments, their messages, and the order messages leave them in.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use retry_core::{HeaderValue, Headers, Properties, QueueArguments, QueueType, Timestamp};

use crate::error::BrokerError;
use crate::message::MessageKey;

/// What a queue does when a publish would take it past `x-max-length`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// Dead-letter (or drop) the oldest message to make room, with reason `maxlen`
    /// (RabbitMQ's default).
    #[default]
    DropHead,
    /// Refuse the publish: a negative confirm for publishers in confirm mode.
    RejectPublish,
}

impl Overflow {
    fn as_str(self) -> &'static str {
        match self {
            Overflow::DropHead => "drop-head",
            Overflow::RejectPublish => "reject-publish",
        }
    }
}

/// The arguments of a queue, typed: the subset of RabbitMQ's `x-` arguments the retry
/// engine relies on. Build one with the `with_*` methods, from a plan's
/// [`QueueArguments`], or from an AMQP argument table with [`from_arguments`].
///
/// ```
/// use transport_memory::{Overflow, QueueOptions};
/// use std::time::Duration;
///
/// let delay = QueueOptions::new()
///     .with_message_ttl(Duration::from_secs(30))
///     .with_dead_letter_exchange("")
///     .with_dead_letter_routing_key("comments");
/// let bounded = QueueOptions::new().with_max_length(100).with_overflow(Overflow::RejectPublish);
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
    pub overflow: Overflow,
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
    pub fn with_overflow(mut self, overflow: Overflow) -> Self {
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
    /// use transport_memory::{Overflow, QueueOptions};
    ///
    /// let args: Headers = [("x-max-length", 2i64)].into_iter().collect();
    /// let mut args = args;
    /// args.insert("x-overflow", "reject-publish");
    /// let options = QueueOptions::from_arguments(&args)?;
    /// assert_eq!(options.max_length, Some(2));
    /// assert_eq!(options.overflow, Overflow::RejectPublish);
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
            None | Some("drop-head") => Overflow::DropHead,
            Some("reject-publish") => Overflow::RejectPublish,
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
            && self.overflow == Overflow::RejectPublish
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

impl From<&QueueArguments> for QueueOptions {
    fn from(args: &QueueArguments) -> Self {
        QueueOptions {
            queue_type: args.queue_type,
            message_ttl: args.message_ttl,
            dead_letter_exchange: args.dead_letter_exchange.clone(),
            dead_letter_routing_key: args.dead_letter_routing_key.clone(),
            max_length: None,
            overflow: match args.overflow {
                Some(retry_core::Overflow::RejectPublish) => Overflow::RejectPublish,
                None => Overflow::DropHead,
            },
            delivery_limit: args.delivery_limit,
            at_least_once: args.at_least_once,
        }
    }
}

/// A message as the broker holds it in a queue.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub(crate) key: MessageKey,
    pub(crate) label: Arc<str>,
    /// Position in the queue; a requeued message goes back to its place.
    pub(crate) seq: u64,
    pub(crate) exchange: Arc<str>,
    pub(crate) routing_key: Arc<str>,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: Properties,
    pub(crate) headers: Headers,
    /// The per-message TTL (`expiration` property).
    pub(crate) expiration: Option<Duration>,
    pub(crate) expires_at: Option<Timestamp>,
    pub(crate) redelivered: bool,
    /// Quorum queues' count of returns to the queue.
    pub(crate) delivery_count: u32,
}

/// A queue's state.
#[derive(Debug)]
pub(crate) struct Queue {
    pub(crate) name: Arc<str>,
    pub(crate) options: QueueOptions,
    /// The options' dead-letter exchange and key, shared by every dead letter.
    pub(crate) dead_letter_exchange: Option<Arc<str>>,
    pub(crate) dead_letter_routing_key: Option<Arc<str>>,
    pub(crate) ready: VecDeque<Stored>,
    /// Consumers as (connection, consumer index), served round-robin.
    pub(crate) consumers: Vec<(usize, usize)>,
    pub(crate) next_consumer: usize,
    pub(crate) unacked: usize,
    /// At-least-once dead letters that could not be routed yet; retried when the topology
    /// changes, as RabbitMQ retries them until they are routed.
    pub(crate) stuck_dead_letters: Vec<(Stored, crate::trace::DeathReason)>,
    /// Clients waiting for a message to be ready here (a watch of the isolation queue).
    pub(crate) watchers: Vec<std::task::Waker>,
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

    pub(crate) fn is_quorum(&self) -> bool {
        self.options.queue_type == QueueType::Quorum
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
}
