//! A transport-neutral header map and the engine's own header schema.
//!
//! Transports convert their native headers (AMQP 0-9-1 field tables, AMQP 1.0 application
//! properties) into [`Headers`] for reading, and write the engine's headers back with
//! [`EngineHeaders::write_into`] or [`clone_headers`]. The schema is documented in the crate
//! docs.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::time::{Timestamp, duration_millis};

/// Failed runs so far (integer).
pub const ATTEMPTS: &str = "x-retry-attempts";
/// Crashes so far: solo runs of the message that took their consumer down (integer).
pub const CRASHES: &str = "x-retry-crashes";
/// First failure, milliseconds since the Unix epoch (integer).
pub const FIRST_FAILURE: &str = "x-retry-first-failure";
/// Latest failure, milliseconds since the Unix epoch (integer).
pub const LAST_FAILURE: &str = "x-retry-last-failure";
/// The latest failure's cause, at most [`MAX_ERROR_LEN`] bytes (string).
pub const LAST_ERROR: &str = "x-retry-last-error";
/// The queue the message was first consumed from (string).
pub const ORIGIN_QUEUE: &str = "x-retry-origin-queue";
/// The exchange the message was first published to (string).
pub const ORIGIN_EXCHANGE: &str = "x-retry-origin-exchange";
/// The routing key the message was first published with (string).
pub const ORIGIN_ROUTING_KEY: &str = "x-retry-origin-routing-key";
/// Why the message was parked: see [`DeadLetterReason`](crate::DeadLetterReason) (string).
pub const REASON: &str = "x-retry-reason";
/// The delay this copy was sent through, in milliseconds (integer).
pub const DELAY: &str = "x-retry-delay";

/// Headers the broker owns. Clones drop them: the engine's headers are the record, and a
/// broker may refuse or misread a client-supplied `x-death`.
pub const BROKER_OWNED: [&str; 7] = [
    "x-death",
    "x-delivery-count",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-queue",
    "x-last-death-reason",
];

/// The deepest nesting of tables and arrays a transport reads from the network: a value
/// nested deeper is read as [`HeaderValue::Null`], so a hostile header cannot make decoding
/// (or dropping the result) recurse without bound. `x-death`, the deepest header a broker
/// writes, nests three levels.
pub const MAX_DEPTH: usize = 32;

/// The longest last-error text kept, in bytes; longer causes are cut at a character boundary
/// and end with `…`.
pub const MAX_ERROR_LEN: usize = 1024;

/// A header value, wide enough for AMQP 0-9-1 field values and AMQP 1.0 simple types.
#[derive(Clone, Debug, PartialEq)]
pub enum HeaderValue {
    /// No value (AMQP void / null).
    Null,
    /// A boolean.
    Bool(bool),
    /// A signed integer of any width.
    Int(i64),
    /// An unsigned integer that does not fit `i64`'s range or came typed as unsigned.
    UInt(u64),
    /// A floating-point number.
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// An AMQP timestamp.
    Timestamp(Timestamp),
    /// An array.
    Array(Vec<HeaderValue>),
    /// A nested table.
    Table(Headers),
}

impl From<&str> for HeaderValue {
    fn from(s: &str) -> Self {
        HeaderValue::Str(s.to_owned())
    }
}

impl From<String> for HeaderValue {
    fn from(s: String) -> Self {
        HeaderValue::Str(s)
    }
}

impl From<i64> for HeaderValue {
    fn from(n: i64) -> Self {
        HeaderValue::Int(n)
    }
}

impl From<bool> for HeaderValue {
    fn from(b: bool) -> Self {
        HeaderValue::Bool(b)
    }
}

/// An ordered map of header names to values.
///
/// ```
/// use retry_core::{HeaderValue, Headers};
///
/// let mut h = Headers::new();
/// h.insert("x-retry-attempts", 2i64);
/// assert_eq!(h.get("x-retry-attempts"), Some(&HeaderValue::Int(2)));
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Headers(BTreeMap<String, HeaderValue>);

impl Headers {
    /// An empty map.
    pub fn new() -> Self {
        Headers(BTreeMap::new())
    }

    /// The value of `name`, if present.
    pub fn get(&self, name: &str) -> Option<&HeaderValue> {
        self.0.get(name)
    }

    /// Sets `name`, returning the previous value.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        value: impl Into<HeaderValue>,
    ) -> Option<HeaderValue> {
        self.0.insert(name.into(), value.into())
    }

    /// Removes `name`, returning its value.
    pub fn remove(&mut self, name: &str) -> Option<HeaderValue> {
        self.0.remove(name)
    }

    /// The entries in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HeaderValue)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<String>, V: Into<HeaderValue>> FromIterator<(K, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Headers(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

impl IntoIterator for Headers {
    type Item = (String, HeaderValue);
    type IntoIter = std::collections::btree_map::IntoIter<String, HeaderValue>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// Where a message came from: the queue it was consumed from and the exchange and routing
/// key of that delivery. Recorded on the first clone and kept by later ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin<'a> {
    /// The work queue.
    pub queue: &'a str,
    /// The exchange of the delivery.
    pub exchange: &'a str,
    /// The routing key of the delivery.
    pub routing_key: &'a str,
}

/// The engine's headers for a clone it publishes. Transports write them over a copy of the
/// original headers ([`clone_headers`]); the body is never touched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineHeaders {
    /// Failed runs so far.
    pub attempts: u32,
    /// Crashes so far.
    pub crashes: u32,
    /// First failure (or crash); `None` keeps the one already on the message, if any.
    pub first_failure: Option<Timestamp>,
    /// Latest failure (or crash); `None` keeps the one already on the message, if any.
    pub last_failure: Option<Timestamp>,
    /// The latest cause, already cut to [`MAX_ERROR_LEN`]; `None` keeps the one already
    /// on the message.
    pub last_error: Option<String>,
    /// Set on parked messages.
    pub reason: Option<crate::DeadLetterReason>,
    /// Set on delayed copies: the delay they go through.
    pub delay: Option<Duration>,
}

impl EngineHeaders {
    /// Writes these headers into `headers`, replacing earlier engine values.
    pub fn write_into(&self, headers: &mut Headers) {
        headers.insert(ATTEMPTS, i64::from(self.attempts));
        headers.insert(CRASHES, i64::from(self.crashes));
        if let Some(t) = self.first_failure {
            headers.insert(FIRST_FAILURE, millis_value(t.as_millis()));
        }
        if let Some(t) = self.last_failure {
            headers.insert(LAST_FAILURE, millis_value(t.as_millis()));
        }
        if let Some(e) = &self.last_error {
            headers.insert(LAST_ERROR, e.as_str());
        }
        match self.reason {
            Some(r) => headers.insert(REASON, r.as_str()),
            None => headers.remove(REASON),
        };
        match self.delay {
            Some(d) => headers.insert(DELAY, millis_value(duration_millis(d))),
            None => headers.remove(DELAY),
        };
    }
}

fn millis_value(ms: u64) -> HeaderValue {
    HeaderValue::Int(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// The headers of a clone: the original's, minus the broker-owned ones, with the origin
/// recorded if it is not yet, and the engine's headers written over.
///
/// ```
/// use retry_core::headers::{self, EngineHeaders, Origin};
/// use retry_core::{Headers, Timestamp};
///
/// let original: Headers = [("x-death", "…"), ("tenant", "acme")].into_iter().collect();
/// let update = EngineHeaders {
///     attempts: 1, crashes: 0,
///     first_failure: Some(Timestamp::from_millis(5)), last_failure: Some(Timestamp::from_millis(5)),
///     last_error: Some("timeout".into()), reason: None, delay: None,
/// };
/// let origin = Origin { queue: "comments", exchange: "", routing_key: "comments" };
/// let clone = headers::clone_headers(&original, origin, &update);
/// assert!(clone.get("x-death").is_none());
/// assert!(clone.get("tenant").is_some());
/// assert!(clone.get(headers::ORIGIN_QUEUE).is_some());
/// ```
pub fn clone_headers(original: &Headers, origin: Origin<'_>, update: &EngineHeaders) -> Headers {
    let mut out = original.clone();
    for name in BROKER_OWNED {
        out.remove(name);
    }
    if out.get(ORIGIN_QUEUE).is_none() {
        out.insert(ORIGIN_QUEUE, origin.queue);
        out.insert(ORIGIN_EXCHANGE, origin.exchange);
        out.insert(ORIGIN_ROUTING_KEY, origin.routing_key);
    }
    update.write_into(&mut out);
    out
}

/// `cause` cut to at most [`MAX_ERROR_LEN`] bytes at a character boundary.
///
/// ```
/// use retry_core::headers::{truncate_error, MAX_ERROR_LEN};
///
/// let long = "é".repeat(2000);
/// let cut = truncate_error(&long);
/// assert!(cut.len() <= MAX_ERROR_LEN);
/// assert!(cut.ends_with('…'));
/// assert_eq!(truncate_error("short"), "short");
/// ```
pub fn truncate_error(cause: &str) -> String {
    if cause.len() <= MAX_ERROR_LEN {
        return cause.to_owned();
    }
    const ELLIPSIS: char = '…';
    let mut end = MAX_ERROR_LEN - ELLIPSIS.len_utf8();
    while !cause.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = String::with_capacity(end + ELLIPSIS.len_utf8());
    out.push_str(&cause[..end]);
    out.push(ELLIPSIS);
    out
}
