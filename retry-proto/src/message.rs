//! `Message` and `Delivery`: what a transport receives and a handler sees.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::facts::{BrokerSignals, DeliveryFacts};
use crate::headers::Headers;
use crate::jitter::message_identity;
use crate::time::Timestamp;

/// The AMQP basic properties a clone carries over from its original. `expiration` is not
/// among them: a clone's per-message TTL is the engine's business.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Properties {
    /// MIME content type.
    pub content_type: Option<String>,
    /// MIME content encoding.
    pub content_encoding: Option<String>,
    /// Application message id; seeds the jitter when present.
    pub message_id: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Reply-to address.
    pub reply_to: Option<String>,
    /// Creation time.
    pub timestamp: Option<Timestamp>,
    /// Priority, 0 to 9.
    pub priority: Option<u8>,
    /// Message type name.
    pub kind: Option<String>,
    /// Creating application.
    pub app_id: Option<String>,
    /// Whether the broker should write it to disk (AMQP delivery mode 2 / durable).
    pub persistent: bool,
}

/// The parts of a received message.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MessageParts {
    /// The queue it was consumed from.
    pub queue: String,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key it was published with.
    pub routing_key: String,
    /// The body, never modified by the engine.
    pub body: Vec<u8>,
    /// Its properties.
    pub properties: Properties,
    /// Its headers, converted from the transport's native form.
    pub headers: Headers,
    /// The transport's own form of what the message came with, where these parts cannot
    /// say it exactly (see [`NativeParts`]).
    pub native: NativeParts,
}

/// A transport's own form of what a message came with, kept beside [`MessageParts`] so that
/// a copy of the message (a retry's clone, a replay from the parking lot) carries what it
/// did not change exactly as it arrived.
///
/// [`Headers`] reads every integer as 64 bits and every float as a double: a header that
/// came as an AMQP 0-9-1 `short-int`, an unsigned `long-uint`, a `float` or a decimal would
/// otherwise be written back with another type, and a
/// reader that expects the type it published (a Java consumer casting to `Integer`, say)
/// would fail on the copy. The AMQP 0-9-1 transport keeps its field table here when some
/// header would change type; on publishing a copy, a header whose value is still the one
/// read from that table is written with its original encoding, and the rest (the engine's
/// own headers) is encoded afresh. Nothing else reads it: the engine and handlers see the
/// neutral parts only, and a transport finds only the type it put here.
///
/// It takes no part in comparisons: two [`MessageParts`] are equal when their neutral parts
/// are, whatever their transports kept.
///
/// ```
/// use retry_proto::NativeParts;
///
/// let native = NativeParts::new(vec![("count", 7u16)]);
/// assert_eq!(native.get::<Vec<(&str, u16)>>(), Some(&vec![("count", 7u16)]));
/// assert!(native.get::<String>().is_none(), "another transport's type is not there");
/// assert!(NativeParts::default().get::<Vec<(&str, u16)>>().is_none());
/// ```
#[derive(Clone, Default)]
pub struct NativeParts(Option<Arc<dyn Any + Send + Sync>>);

impl NativeParts {
    /// Keeps `native`, a transport's own form of what a message came with.
    pub fn new<T: Any + Send + Sync>(native: T) -> Self {
        NativeParts(Some(Arc::new(native)))
    }

    /// What was kept, if something was and it is a `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.as_deref().and_then(|a| a.downcast_ref())
    }
}

impl fmt::Debug for NativeParts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Some(_) => "NativeParts(kept)",
            None => "NativeParts(none)",
        })
    }
}

impl PartialEq for NativeParts {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A received message as a handler sees it: cheap to clone, immutable.
///
/// ```
/// use retry_proto::{Message, MessageParts};
///
/// let msg = Message::new(MessageParts { body: b"hello".to_vec(), ..Default::default() });
/// assert_eq!(msg.body(), b"hello");
/// assert_eq!(msg.attempt(), 1);
/// ```
#[derive(Clone, Debug)]
pub struct Message {
    parts: Arc<MessageParts>,
    attempt: u32,
    delay: Option<Duration>,
}

impl Message {
    /// Wraps received parts; the attempt is 1 until [`with_attempt`](Self::with_attempt).
    pub fn new(parts: MessageParts) -> Self {
        Message {
            parts: Arc::new(parts),
            attempt: 1,
            delay: None,
        }
    }

    /// The same message on run number `attempt` (1-based).
    pub fn with_attempt(&self, attempt: u32) -> Self {
        Message {
            parts: Arc::clone(&self.parts),
            attempt,
            delay: self.delay,
        }
    }

    /// The run number of this handler call (1-based, immediate retries included).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.parts.body
    }

    /// The properties: content type, message id, priority and the rest.
    pub fn properties(&self) -> &Properties {
        &self.parts.properties
    }

    /// The headers.
    pub fn headers(&self) -> &Headers {
        &self.parts.headers
    }

    /// The queue it was consumed from.
    pub fn queue(&self) -> &str {
        &self.parts.queue
    }

    /// The exchange it was published to.
    pub fn exchange(&self) -> &str {
        &self.parts.exchange
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        &self.parts.routing_key
    }

    /// All the parts.
    pub fn parts(&self) -> &MessageParts {
        &self.parts
    }
}

/// A delivery from a transport: the message, what is known about it, and the tag that
/// settles it.
#[derive(Clone, Debug)]
pub struct Delivery<T> {
    /// The transport's handle for settling this delivery.
    pub tag: T,
    /// The message.
    pub message: Message,
    /// The facts the engine decides on.
    pub facts: DeliveryFacts,
}

impl<T> Delivery<T> {
    /// A delivery built from what a transport read off the wire: the message's parts, the
    /// broker's signals and the settling tag. Every transport builds its deliveries here,
    /// so the facts are decoded the same way everywhere: from the parts' headers, with the
    /// jitter seed taken from the message id, or the body when there is none
    /// ([`message_identity`](crate::message_identity)).
    ///
    /// ```
    /// use retry_proto::{BrokerSignals, Delivery, Headers, MessageParts};
    ///
    /// let mut headers = Headers::new();
    /// headers.insert("x-retry-attempts", 2i64);
    /// let parts = MessageParts {
    ///     queue: "comments".into(),
    ///     body: b"hi".to_vec(),
    ///     headers,
    ///     ..MessageParts::default()
    /// };
    /// let signals = BrokerSignals { redelivered: true, delivery_count: None };
    /// let delivery = Delivery::new(7u64, parts, signals);
    /// assert_eq!(delivery.facts.attempts, 2);
    /// assert!(delivery.facts.redelivered);
    /// assert_eq!(delivery.message.queue(), "comments");
    /// ```
    pub fn new(tag: T, parts: MessageParts, signals: BrokerSignals) -> Self {
        let identity = message_identity(parts.properties.message_id.as_deref(), &parts.body);
        let facts = DeliveryFacts::decode(&parts.headers, signals, identity);
        Delivery {
            tag,
            message: Message::new(parts),
            facts,
        }
    }
}
