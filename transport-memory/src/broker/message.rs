//! Messages going into the broker, held inside it, and handed out of it to clients.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use retry_core::{HeaderValue, Headers, Properties, Timestamp};

/// The broker's identity for a message and all its copies: a number given at publish and
/// carried by every copy the broker stores. Dead-lettering keeps it, and so do the clones the
/// retry engine publishes of a delivery through a [`MemoryTransport`]. It is how a
/// simulation follows one message through retries.
///
/// [`MemoryTransport`]: crate::MemoryTransport
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageKey(pub(crate) u64);

impl MessageKey {
    /// The number behind the key, in publish order from 1.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A message to publish, with the publish's parameters.
///
/// ```
/// use transport_memory::Outgoing;
/// use std::time::Duration;
///
/// let m = Outgoing::to_queue("comments", b"hello".to_vec())
///     .with_message_id("c-1")
///     .with_header("tenant", "acme")
///     .with_expiration(Duration::from_secs(5));
/// assert_eq!(m.routing_key(), "comments");
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outgoing {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: Properties,
    pub(crate) headers: Headers,
    pub(crate) expiration: Option<Duration>,
    pub(crate) mandatory: bool,
}

impl Outgoing {
    /// A message for `exchange` with `routing_key`.
    pub fn new(exchange: impl Into<String>, routing_key: impl Into<String>, body: Vec<u8>) -> Self {
        Outgoing {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body,
            ..Outgoing::default()
        }
    }

    /// A message for the default exchange, which routes it to the queue named `queue`.
    pub fn to_queue(queue: impl Into<String>, body: Vec<u8>) -> Self {
        Self::new("", queue, body)
    }

    /// Sets the `message-id` property.
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.properties.message_id = Some(id.into());
        self
    }

    /// Sets a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<HeaderValue>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Replaces the headers.
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Replaces the properties.
    pub fn with_properties(mut self, properties: Properties) -> Self {
        self.properties = properties;
        self
    }

    /// Sets the per-message TTL (the `expiration` property).
    pub fn with_expiration(mut self, ttl: Duration) -> Self {
        self.expiration = Some(ttl);
        self
    }

    /// Whether to publish with the `mandatory` flag: an unroutable message then comes back as
    /// returned instead of vanishing. Off by default.
    pub fn with_mandatory(mut self, mandatory: bool) -> Self {
        self.mandatory = mandatory;
        self
    }

    /// The exchange.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The routing key.
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }
}

/// A copy of a message waiting in a queue, for inspection.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct QueuedMessage {
    /// The message's identity across copies.
    pub key: MessageKey,
    /// Its `message-id`, or its key when it has none.
    pub label: Arc<str>,
    /// The exchange it was last published or dead-lettered to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// Its body.
    pub body: Vec<u8>,
    /// Its properties.
    pub properties: Properties,
    /// Its headers, `x-death` included.
    pub headers: Headers,
    /// Its per-message TTL, if any.
    pub expiration: Option<Duration>,
    /// When it expires in this queue, if it does.
    pub expires_at: Option<Timestamp>,
    /// Whether its next delivery is flagged redelivered.
    pub redelivered: bool,
    /// Quorum queues: how often it has been returned to the queue.
    pub delivery_count: u32,
}

/// What a publish carries into the broker.
pub(crate) struct Publishing {
    /// The identity of the message this is a clone of; `None` gives it a new one.
    pub(crate) identity: Option<(MessageKey, Arc<str>)>,
    pub(crate) exchange: Arc<str>,
    pub(crate) routing_key: Arc<str>,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: Properties,
    pub(crate) headers: Headers,
    pub(crate) expiration: Option<Duration>,
    pub(crate) mandatory: bool,
}

impl From<Outgoing> for Publishing {
    fn from(m: Outgoing) -> Self {
        Publishing {
            identity: None,
            exchange: Arc::from(m.exchange),
            routing_key: Arc::from(m.routing_key),
            body: m.body,
            properties: m.properties,
            headers: m.headers,
            expiration: m.expiration,
            mandatory: m.mandatory,
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

/// A message handed to a client, pushed to one of its consumers or taken with a get: what
/// the client sees of it. The content moves out of the broker with it.
#[derive(Debug)]
pub(crate) struct Handout {
    /// The connection it was delivered on.
    pub(crate) connection: usize,
    /// Its delivery tag there.
    pub(crate) tag: u64,
    /// The queue it left.
    pub(crate) queue: Arc<str>,
    pub(crate) exchange: Arc<str>,
    pub(crate) routing_key: Arc<str>,
    pub(crate) body: Vec<u8>,
    pub(crate) properties: Properties,
    /// Its headers, with `x-delivery-count` when a quorum queue counts this delivery.
    pub(crate) headers: Headers,
    pub(crate) redelivered: bool,
}

/// What a client keeps of a message handed to it, for as long as the delivery is
/// unacknowledged. Handing a message out moves its content to the client instead of copying
/// it: most deliveries are acknowledged and never needed again, and when one does come back
/// to its queue (a requeue, a rejection, a closed connection) the broker reads its content
/// back from here.
pub(crate) trait Held: Send {
    /// The body.
    fn body(&self) -> &[u8];
    /// The properties.
    fn properties(&self) -> &Properties;
    /// The headers, as handed out.
    fn headers(&self) -> &Headers;
    /// What the client recognises this copy by: no two copies held at once share it.
    fn address(&self) -> usize;
}
