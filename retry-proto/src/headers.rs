//! A transport-neutral header map and the engine's own header schema.
//!
//! Transports convert their native headers (AMQP 0-9-1 field tables, AMQP 1.0 application
//! properties) into [`Headers`] for reading, and write the engine's headers back with
//! [`EngineHeaders::write_into`] or [`clone_headers`]. The schema is documented in the crate
//! docs.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;
use std::time::Duration;

use crate::time::{Timestamp, duration_millis};

/// Failed runs so far (integer); absent when there are none.
pub const ATTEMPTS: &str = "x-retry-attempts";
/// Crashes so far: solo runs of the message that took their consumer down (integer); absent
/// when there are none.
pub const CRASHES: &str = "x-retry-crashes";
/// First failure, milliseconds since the Unix epoch (integer).
pub const FIRST_FAILURE: &str = "x-retry-first-failure";
/// Latest failure, milliseconds since the Unix epoch (integer); absent when it is the first
/// failure ([`FIRST_FAILURE`]).
pub const LAST_FAILURE: &str = "x-retry-last-failure";
/// The latest failure's cause, at most [`MAX_ERROR_LEN`] bytes (string).
pub const LAST_ERROR: &str = "x-retry-last-error";
/// The queue the message was first consumed from (string).
pub const ORIGIN_QUEUE: &str = "x-retry-origin-queue";
/// The exchange the message was first published to (string); absent for the default
/// exchange (`""`).
pub const ORIGIN_EXCHANGE: &str = "x-retry-origin-exchange";
/// The routing key the message was first published with (string); absent when it is the
/// origin queue's name ([`ORIGIN_QUEUE`]).
pub const ORIGIN_ROUTING_KEY: &str = "x-retry-origin-routing-key";
/// Why the message was parked: see [`DeadLetterReason`] (string).
pub const REASON: &str = "x-retry-reason";
/// The delay this copy was sent through, in milliseconds (integer).
pub const DELAY: &str = "x-retry-delay";
/// On replayed copies: how many times the message was replayed from its parking queue
/// (integer).
pub const REPLAYS: &str = "x-retry-replays";
/// On replayed copies: when the latest replay was made, milliseconds since the Unix epoch
/// (integer).
pub const REPLAYED_AT: &str = "x-retry-replayed-at";
/// On replayed copies: why the message had been parked before its latest replay (string).
pub const PREVIOUS_REASON: &str = "x-retry-previous-reason";
/// On replayed copies: the last error it had been parked with (string).
pub const PREVIOUS_ERROR: &str = "x-retry-previous-error";
/// Marks a topology probe: a consumer acknowledges a delivery carrying it without running
/// the handler (any value).
pub const PROBE: &str = "x-retry-probe";
/// On a suspect's copy in the isolation queue: a token the engine draws for it, unique to
/// that copy, so that a suspect this process put back (and so excused) is told apart from
/// another copy with the same id or body (integer).
pub const SUSPECT: &str = "x-retry-suspect";
/// A transport's stamp on one publish, so that a returned message names the publish it
/// belongs to (see [`ReturnMatcher`](crate::ReturnMatcher)); integer. Clones drop it.
pub const PUBLISH_ID: &str = "x-retry-publish-id";

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

/// Why a message was parked (or dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// Every attempt failed: `attempts-exhausted`.
    AttemptsExhausted,
    /// The cap on time since the first failure was reached: `max-elapsed`.
    MaxElapsed,
    /// The handler reported a permanent failure: `permanent`.
    Permanent,
    /// Running alone, the message took its consumer down more often than the crash limit
    /// allows: `crash-loop`.
    CrashLoop,
}

impl DeadLetterReason {
    /// Every reason, in the order of their header spellings' documentation: what a metrics
    /// layer or a report keeps one counter per reason with.
    ///
    /// ```
    /// use retry_proto::DeadLetterReason;
    ///
    /// let spellings = DeadLetterReason::ALL.map(DeadLetterReason::as_str);
    /// assert_eq!(spellings, ["attempts-exhausted", "max-elapsed", "permanent", "crash-loop"]);
    /// ```
    pub const ALL: [DeadLetterReason; 4] = [
        DeadLetterReason::AttemptsExhausted,
        DeadLetterReason::MaxElapsed,
        DeadLetterReason::Permanent,
        DeadLetterReason::CrashLoop,
    ];

    /// Where this reason stands in [`DeadLetterReason::ALL`].
    ///
    /// ```
    /// use retry_proto::DeadLetterReason;
    ///
    /// for (i, reason) in DeadLetterReason::ALL.into_iter().enumerate() {
    ///     assert_eq!(reason.index(), i);
    /// }
    /// ```
    pub fn index(self) -> usize {
        match self {
            DeadLetterReason::AttemptsExhausted => 0,
            DeadLetterReason::MaxElapsed => 1,
            DeadLetterReason::Permanent => 2,
            DeadLetterReason::CrashLoop => 3,
        }
    }

    /// The header spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::AttemptsExhausted => "attempts-exhausted",
            DeadLetterReason::MaxElapsed => "max-elapsed",
            DeadLetterReason::Permanent => "permanent",
            DeadLetterReason::CrashLoop => "crash-loop",
        }
    }

    /// Parses the header spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "attempts-exhausted" => DeadLetterReason::AttemptsExhausted,
            "max-elapsed" => DeadLetterReason::MaxElapsed,
            "permanent" => DeadLetterReason::Permanent,
            "crash-loop" => DeadLetterReason::CrashLoop,
            _ => return None,
        })
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl HeaderValue {
    /// A non-negative integer, whether it came signed or unsigned; `None` for a negative
    /// number or any other type.
    ///
    /// ```
    /// use retry_proto::HeaderValue;
    ///
    /// assert_eq!(HeaderValue::Int(3).as_u64(), Some(3));
    /// assert_eq!(HeaderValue::UInt(3).as_u64(), Some(3));
    /// assert_eq!(HeaderValue::Int(-1).as_u64(), None);
    /// assert_eq!(HeaderValue::from("3").as_u64(), None);
    /// ```
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            HeaderValue::Int(n) => u64::try_from(*n).ok(),
            HeaderValue::UInt(n) => Some(*n),
            _ => None,
        }
    }

    /// An integer, whether it came signed or unsigned; `None` for an unsigned number past
    /// `i64::MAX` or any other type.
    ///
    /// ```
    /// use retry_proto::HeaderValue;
    ///
    /// assert_eq!(HeaderValue::Int(-2).as_i64(), Some(-2));
    /// assert_eq!(HeaderValue::UInt(u64::MAX).as_i64(), None);
    /// ```
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            HeaderValue::Int(n) => Some(*n),
            HeaderValue::UInt(n) => i64::try_from(*n).ok(),
            _ => None,
        }
    }

    /// A string: `Str` as it is, or `Bytes` that are valid UTF-8 (AMQP 0-9-1 brokers
    /// write some fields, such as `x-death`'s `queue`, as either).
    ///
    /// ```
    /// use retry_proto::HeaderValue;
    ///
    /// assert_eq!(HeaderValue::from("rejected").as_str(), Some("rejected"));
    /// assert_eq!(HeaderValue::Bytes(b"expired".to_vec()).as_str(), Some("expired"));
    /// assert_eq!(HeaderValue::Int(1).as_str(), None);
    /// ```
    pub fn as_str(&self) -> Option<&str> {
        match self {
            HeaderValue::Str(s) => Some(s),
            HeaderValue::Bytes(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// A point in time: an AMQP timestamp, or a non-negative integer of milliseconds
    /// since the Unix epoch (how the engine writes its `x-retry-*-failure` headers).
    ///
    /// ```
    /// use retry_proto::{HeaderValue, Timestamp};
    ///
    /// let t = Timestamp::from_millis(1_700_000_000_000);
    /// assert_eq!(HeaderValue::Timestamp(t).as_timestamp(), Some(t));
    /// assert_eq!(HeaderValue::Int(1_700_000_000_000).as_timestamp(), Some(t));
    /// ```
    pub fn as_timestamp(&self) -> Option<Timestamp> {
        match self {
            HeaderValue::Timestamp(t) => Some(*t),
            other => other.as_u64().map(Timestamp::from_millis),
        }
    }

    /// The elements of an array.
    pub fn as_array(&self) -> Option<&[HeaderValue]> {
        match self {
            HeaderValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// A nested table.
    pub fn as_table(&self) -> Option<&Headers> {
        match self {
            HeaderValue::Table(t) => Some(t),
            _ => None,
        }
    }
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
/// Kept as a vector sorted by name: header maps are small, and a vector clones with one
/// allocation where a tree allocates per node. Names the engine and brokers write
/// (`x-retry-*`, `x-death` and its fields, ...) are stored as `&'static str`, so copying or
/// rewriting them allocates nothing.
///
/// ```
/// use retry_proto::{HeaderValue, Headers};
///
/// let mut h = Headers::new();
/// h.insert("x-retry-attempts", 2i64);
/// assert_eq!(h.get("x-retry-attempts"), Some(&HeaderValue::Int(2)));
/// ```
#[derive(Clone, Default, PartialEq)]
pub struct Headers(Vec<(Name, HeaderValue)>);

/// A header name: a well-known one shared, any other owned.
type Name = Cow<'static, str>;

/// Up to this many entries, a lookup scans for an equal name rather than binary-searching.
const SCAN: usize = 16;

/// Names stored without allocating, sorted for a binary search.
const WELL_KNOWN: [&str; 31] = [
    "count",
    "exchange",
    "original-expiration",
    "queue",
    "reason",
    "routing-keys",
    "time",
    "x-death",
    "x-delivery-count",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-queue",
    "x-last-death-reason",
    ATTEMPTS,
    CRASHES,
    DELAY,
    FIRST_FAILURE,
    LAST_ERROR,
    LAST_FAILURE,
    ORIGIN_EXCHANGE,
    ORIGIN_QUEUE,
    ORIGIN_ROUTING_KEY,
    PREVIOUS_ERROR,
    PREVIOUS_REASON,
    PROBE,
    PUBLISH_ID,
    REASON,
    REPLAYED_AT,
    REPLAYS,
    SUSPECT,
];

fn well_known(name: &str) -> Option<&'static str> {
    WELL_KNOWN.binary_search(&name).ok().map(|i| WELL_KNOWN[i])
}

/// A name read or built at run time: a well-known one is shared rather than kept.
fn name_of(name: String) -> Name {
    match well_known(&name) {
        Some(known) => Cow::Borrowed(known),
        None => Cow::Owned(name),
    }
}

/// Whether two header names are equal, compared inline eight bytes at a time rather than
/// by a call to `memcmp` (header lookups are the commonest operation of a delivery, and
/// names are short). The engine's names share their `x-retry-` prefix and several share a
/// length, so the last eight bytes, where those names differ, are compared first.
#[inline]
fn same_name(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    match (a.last_chunk::<8>(), b.last_chunk::<8>()) {
        (Some(x), Some(y)) => {
            // The last word is equal: the words before it decide (the last may overlap
            // the one before it).
            x == y
                && a.as_chunks::<8>()
                    .0
                    .iter()
                    .zip(b.as_chunks::<8>().0)
                    .all(|(x, y)| x == y)
        }
        _ => a.iter().zip(b).all(|(x, y)| x == y),
    }
}

/// The order of two header names, the order of their bytes, compared inline eight bytes
/// at a time, as [`same_name`] does, rather than by a call to `memcmp`: placing a name
/// orders it against several others, and most share the `x-retry-` prefix.
#[inline]
fn name_order(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (words_a, words_b) = (a.as_chunks::<8>().0, b.as_chunks::<8>().0);
    for (x, y) in words_a.iter().zip(words_b) {
        if x != y {
            // Big-endian, so that the first byte that differs decides.
            return u64::from_be_bytes(*x).cmp(&u64::from_be_bytes(*y));
        }
    }
    let n = 8 * words_a.len().min(words_b.len());
    for (x, y) in a[n..].iter().zip(&b[n..]) {
        if x != y {
            return x.cmp(y);
        }
    }
    a.len().cmp(&b.len())
}

impl Headers {
    /// An empty map.
    pub fn new() -> Self {
        Headers(Vec::new())
    }

    /// An empty map with room for `n` entries.
    pub fn with_capacity(n: usize) -> Self {
        Headers(Vec::with_capacity(n))
    }

    /// Where `name` is, or where it would go: what [`set`](Self::set) needs. A small map is
    /// walked in order, each name ordered against `name` inline ([`name_order`]), up to the
    /// first that is not less: that is where `name` is or goes, found in one pass (a scan
    /// for an equal name first, as reads do, costs more than it saves here: most names set
    /// are new or near the front). Larger maps are binary-searched.
    fn find(&self, name: &str) -> Result<usize, usize> {
        if self.0.len() > SCAN {
            return self.0.binary_search_by(|(k, _)| name_order(k, name));
        }
        for (i, (k, _)) in self.0.iter().enumerate() {
            match name_order(k, name) {
                Ordering::Less => {}
                Ordering::Equal => return Ok(i),
                Ordering::Greater => return Err(i),
            }
        }
        Err(self.0.len())
    }

    /// Where `name` is, if present: what reads need. Most maps are small and most lookups
    /// are for names the map has: a small map is scanned for an equal name, comparing
    /// lengths before bytes ([`same_name`]), rather than ordering names; a read of a name
    /// the map does not have scans it all, and needs no place for it.
    fn position(&self, name: &str) -> Option<usize> {
        if self.0.len() <= SCAN {
            let same = |(k, _): &(Name, HeaderValue)| same_name(k, name);
            return self.0.iter().position(same);
        }
        self.0.binary_search_by(|(k, _)| name_order(k, name)).ok()
    }

    /// The value of `name`, if present.
    pub fn get(&self, name: &str) -> Option<&HeaderValue> {
        self.position(name).map(|i| &self.0[i].1)
    }

    /// Sets `name`, returning the previous value.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        value: impl Into<HeaderValue>,
    ) -> Option<HeaderValue> {
        let name: String = name.into();
        self.set(name_of(name), value.into())
    }

    /// Sets `name`, as [`insert`](Self::insert) does, without allocating for the name: for
    /// names known when compiling, such as this module's constants.
    ///
    /// ```
    /// use retry_proto::{headers, HeaderValue, Headers};
    ///
    /// let mut h = Headers::new();
    /// h.insert_static(headers::ATTEMPTS, 1i64);
    /// assert_eq!(h.insert_static(headers::ATTEMPTS, 2i64), Some(HeaderValue::Int(1)));
    /// ```
    pub fn insert_static(
        &mut self,
        name: &'static str,
        value: impl Into<HeaderValue>,
    ) -> Option<HeaderValue> {
        self.set(Cow::Borrowed(name), value.into())
    }

    fn set(&mut self, name: Name, value: HeaderValue) -> Option<HeaderValue> {
        match self.find(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (name, value));
                None
            }
        }
    }

    /// Removes `name`, returning its value.
    pub fn remove(&mut self, name: &str) -> Option<HeaderValue> {
        self.position(name).map(|i| self.0.remove(i).1)
    }

    /// The entries in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HeaderValue)> {
        self.0.iter().map(|(k, v)| (k.as_ref(), v))
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

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Entries<'a>(&'a Headers);
        impl fmt::Debug for Entries<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_map().entries(self.0.iter()).finish()
            }
        }
        f.debug_tuple("Headers").field(&Entries(self)).finish()
    }
}

impl<K: Into<String>, V: Into<HeaderValue>> FromIterator<(K, V)> for Headers {
    /// A later entry with the same name replaces an earlier one.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut entries: Vec<(Name, HeaderValue)> = iter
            .into_iter()
            .map(|(k, v)| (name_of(k.into()), v.into()))
            .collect();
        // Latest first, so that the stable sort keeps it first among equal names.
        entries.reverse();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries.dedup_by(|later, kept| later.0 == kept.0);
        Headers(entries)
    }
}

/// The entries of a [`Headers`], by value, in name order.
#[derive(Debug)]
pub struct IntoIter(std::vec::IntoIter<(Name, HeaderValue)>);

impl Iterator for IntoIter {
    type Item = (String, HeaderValue);

    fn next(&mut self) -> Option<Self::Item> {
        self.0.next().map(|(k, v)| (k.into_owned(), v))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl IntoIterator for Headers {
    type Item = (String, HeaderValue);
    type IntoIter = IntoIter;
    fn into_iter(self) -> Self::IntoIter {
        IntoIter(self.0.into_iter())
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
    pub reason: Option<DeadLetterReason>,
    /// Set on delayed copies: the delay they go through.
    pub delay: Option<Duration>,
    /// Set on a suspect's copy in the isolation queue: its [`SUSPECT`] token.
    pub suspect: Option<u64>,
}

impl EngineHeaders {
    /// Writes these headers into `headers`, replacing earlier engine values.
    ///
    /// A header that would hold its default is left out (and an earlier value removed): no
    /// attempts or crashes (0), and a last failure equal to the first. Readers
    /// ([`DeliveryFacts`](crate::DeliveryFacts), [`ParkedRecord`](crate::ParkedRecord)) read
    /// an absent counter as 0 and an absent last failure as the first, so a message in this
    /// form and one with every header written read the same.
    ///
    /// ```
    /// use retry_proto::headers::{self, EngineHeaders};
    /// use retry_proto::{Headers, ParkedRecord, Timestamp};
    ///
    /// let t = Timestamp::from_millis(5);
    /// let update = EngineHeaders {
    ///     attempts: 1, crashes: 0, first_failure: Some(t), last_failure: Some(t),
    ///     last_error: Some("timeout".into()), reason: None, delay: None, suspect: None,
    /// };
    /// let mut h = Headers::new();
    /// update.write_into(&mut h);
    /// assert!(h.get(headers::CRASHES).is_none());
    /// assert!(h.get(headers::LAST_FAILURE).is_none());
    /// let record = ParkedRecord::decode(&h);
    /// assert_eq!((record.crashes, record.last_failure), (0, Some(t)));
    /// ```
    pub fn write_into(&self, headers: &mut Headers) {
        set_counter(headers, ATTEMPTS, self.attempts);
        set_counter(headers, CRASHES, self.crashes);
        // The last failure as a reader sees it now: its own header, or the first failure.
        let first_before = headers
            .get(FIRST_FAILURE)
            .and_then(HeaderValue::as_timestamp);
        let last_before = headers
            .get(LAST_FAILURE)
            .and_then(HeaderValue::as_timestamp)
            .or(first_before);
        if let Some(t) = self.first_failure {
            headers.insert_static(FIRST_FAILURE, millis_value(t.as_millis()));
        }
        let first = self.first_failure.or(first_before);
        match self.last_failure.or(last_before) {
            Some(last) if Some(last) != first => {
                headers.insert_static(LAST_FAILURE, millis_value(last.as_millis()))
            }
            _ => headers.remove(LAST_FAILURE),
        };
        if let Some(e) = &self.last_error {
            headers.insert_static(LAST_ERROR, e.as_str());
        }
        match self.reason {
            Some(r) => headers.insert_static(REASON, r.as_str()),
            None => headers.remove(REASON),
        };
        match self.delay {
            Some(d) => headers.insert_static(DELAY, millis_value(duration_millis(d))),
            None => headers.remove(DELAY),
        };
        match self.suspect {
            Some(t) => headers.insert_static(SUSPECT, HeaderValue::Int(t as i64)),
            None => headers.remove(SUSPECT),
        };
    }
}

/// Writes a counter, or removes it when it is 0 (what a reader takes an absent one for).
fn set_counter(headers: &mut Headers, name: &'static str, n: u32) {
    if n == 0 {
        headers.remove(name);
    } else {
        headers.insert_static(name, i64::from(n));
    }
}

fn millis_value(ms: u64) -> HeaderValue {
    HeaderValue::Int(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// The headers of a clone: the original's, minus the broker-owned ones and a transport's
/// [`PUBLISH_ID`] stamp, with the origin recorded if it is not yet, and the engine's headers
/// written over ([`EngineHeaders::write_into`]).
///
/// The origin is written in short: the exchange only when it is not the default exchange
/// (`""`), the routing key only when it differs from the queue's name. Readers
/// ([`ParkedRecord`](crate::ParkedRecord)) read an absent one as that default once
/// [`ORIGIN_QUEUE`] is there.
///
/// ```
/// use retry_proto::headers::{self, EngineHeaders, Origin};
/// use retry_proto::{Headers, ParkedRecord, Timestamp};
///
/// let original: Headers = [("x-death", "…"), ("tenant", "acme")].into_iter().collect();
/// let update = EngineHeaders {
///     attempts: 1, crashes: 0,
///     first_failure: Some(Timestamp::from_millis(5)), last_failure: Some(Timestamp::from_millis(5)),
///     last_error: Some("timeout".into()), reason: None, delay: None, suspect: None,
/// };
/// let origin = Origin { queue: "comments", exchange: "", routing_key: "comments" };
/// let clone = headers::clone_headers(&original, origin, &update);
/// assert!(clone.get("x-death").is_none());
/// assert!(clone.get("tenant").is_some());
/// assert!(clone.get(headers::ORIGIN_QUEUE).is_some());
/// assert!(clone.get(headers::ORIGIN_EXCHANGE).is_none());
/// let record = ParkedRecord::decode(&clone);
/// assert_eq!(record.origin_exchange, Some(""));
/// assert_eq!(record.origin_routing_key, Some("comments"));
/// ```
pub fn clone_headers(original: &Headers, origin: Origin<'_>, update: &EngineHeaders) -> Headers {
    let first = original.get(ORIGIN_QUEUE).is_none();
    // Room for what is usually added: on a first clone the origin queue and five engine
    // headers at most (attempts, the first failure, the last error, the delay or the reason,
    // a crash count or a last failure), on later ones two (a last failure and the reason).
    // Copies wait in delay queues by the thousand, so the room is kept tight.
    let room = if first { 6 } else { 2 };
    // Copied without the broker's entries (x-death can be the largest), rather than copied
    // whole and pruned.
    let mut out = Headers::with_capacity(original.len() + room);
    out.0.extend(
        original
            .0
            .iter()
            .filter(|(k, _)| !BROKER_OWNED.contains(&k.as_ref()) && k != PUBLISH_ID)
            .cloned(),
    );
    if first {
        out.insert_static(ORIGIN_QUEUE, origin.queue);
        if !origin.exchange.is_empty() {
            out.insert_static(ORIGIN_EXCHANGE, origin.exchange);
        }
        if origin.routing_key != origin.queue {
            out.insert_static(ORIGIN_ROUTING_KEY, origin.routing_key);
        }
    }
    update.write_into(&mut out);
    out
}

/// `cause` cut to at most [`MAX_ERROR_LEN`] bytes at a character boundary.
///
/// ```
/// use retry_proto::headers::{truncate_error, MAX_ERROR_LEN};
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
    let end = cause.floor_char_boundary(MAX_ERROR_LEN - ELLIPSIS.len_utf8());
    let mut out = String::with_capacity(end + ELLIPSIS.len_utf8());
    out.push_str(&cause[..end]);
    out.push(ELLIPSIS);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_known_names_are_sorted_and_found() {
        assert!(WELL_KNOWN.windows(2).all(|w| w[0] < w[1]));
        for name in WELL_KNOWN.iter().chain(&BROKER_OWNED) {
            assert_eq!(well_known(name), Some(*name));
        }
        assert_eq!(well_known("tenant"), None);
    }

    #[test]
    fn behaves_as_an_ordered_map() {
        let mut h: Headers = [("b", 1i64), ("a", 2), ("b", 3), ("x-death", 4)]
            .into_iter()
            .collect();
        assert_eq!(
            h.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            ["a", "b", "x-death"]
        );
        assert_eq!(
            h.get("b"),
            Some(&HeaderValue::Int(3)),
            "the later entry wins"
        );
        assert_eq!(h.insert("a", 5i64), Some(HeaderValue::Int(2)));
        assert_eq!(h.insert(String::from("c"), 6i64), None);
        assert_eq!(h.remove("x-death"), Some(HeaderValue::Int(4)));
        assert_eq!(h.remove("x-death"), None);
        assert_eq!(
            h.clone().into_iter().collect::<Vec<_>>(),
            [
                ("a".to_owned(), HeaderValue::Int(5)),
                ("b".to_owned(), HeaderValue::Int(3)),
                ("c".to_owned(), HeaderValue::Int(6)),
            ]
        );
        assert_eq!(
            format!("{h:?}"),
            r#"Headers({"a": Int(5), "b": Int(3), "c": Int(6)})"#
        );
        let same: Headers = [("c", 6i64), ("b", 3), ("a", 5)].into_iter().collect();
        assert_eq!(h, same);
    }

    fn failed(attempts: u32, crashes: u32, first: u64, last: u64) -> EngineHeaders {
        EngineHeaders {
            attempts,
            crashes,
            first_failure: Some(Timestamp::from_millis(first)),
            last_failure: Some(Timestamp::from_millis(last)),
            last_error: Some("timeout".into()),
            reason: None,
            delay: Some(Duration::from_secs(1)),
            suspect: None,
        }
    }

    fn engine_names(h: &Headers) -> Vec<&str> {
        h.iter()
            .map(|(k, _)| k)
            .filter(|k| k.starts_with("x-retry-"))
            .collect()
    }

    const DEFAULT_ORIGIN: Origin<'static> = Origin {
        queue: "comments",
        exchange: "",
        routing_key: "comments",
    };

    #[test]
    fn a_first_clone_leaves_out_what_holds_its_default() {
        let clone = clone_headers(&Headers::new(), DEFAULT_ORIGIN, &failed(1, 0, 5, 5));
        assert_eq!(
            engine_names(&clone),
            [ATTEMPTS, DELAY, FIRST_FAILURE, LAST_ERROR, ORIGIN_QUEUE]
        );
        let routed = Origin {
            queue: "comments",
            exchange: "blog",
            routing_key: "comment.new",
        };
        let clone = clone_headers(&Headers::new(), routed, &failed(1, 2, 5, 9));
        assert_eq!(
            engine_names(&clone),
            [
                ATTEMPTS,
                CRASHES,
                DELAY,
                FIRST_FAILURE,
                LAST_ERROR,
                LAST_FAILURE,
                ORIGIN_EXCHANGE,
                ORIGIN_QUEUE,
                ORIGIN_ROUTING_KEY
            ]
        );
    }

    #[test]
    fn later_clones_write_a_last_failure_once_it_differs_and_drop_it_when_it_does_not() {
        let first = clone_headers(&Headers::new(), DEFAULT_ORIGIN, &failed(1, 0, 5, 5));
        let second = clone_headers(&first, DEFAULT_ORIGIN, &failed(2, 0, 5, 8));
        assert_eq!(second.get(LAST_FAILURE), Some(&HeaderValue::Int(8)));
        // A suspect's copy keeps the dates it came with (`None`): the last failure stays.
        let keep = EngineHeaders {
            first_failure: None,
            last_failure: None,
            suspect: Some(1),
            ..failed(2, 1, 0, 0)
        };
        let isolated = clone_headers(&second, DEFAULT_ORIGIN, &keep);
        assert_eq!(isolated.get(LAST_FAILURE), Some(&HeaderValue::Int(8)));
        assert_eq!(isolated.get(FIRST_FAILURE), Some(&HeaderValue::Int(5)));
        // A message written in full by an earlier version: its defaults are dropped.
        let full: Headers = [
            (ATTEMPTS, HeaderValue::Int(1)),
            (CRASHES, HeaderValue::Int(0)),
            (FIRST_FAILURE, HeaderValue::Int(5)),
            (LAST_FAILURE, HeaderValue::Int(5)),
            (ORIGIN_QUEUE, HeaderValue::from("comments")),
            (ORIGIN_EXCHANGE, HeaderValue::from("")),
            (ORIGIN_ROUTING_KEY, HeaderValue::from("comments")),
        ]
        .into_iter()
        .collect();
        let later = clone_headers(&full, DEFAULT_ORIGIN, &failed(2, 0, 5, 5));
        assert_eq!(later.get(CRASHES), None);
        assert_eq!(later.get(LAST_FAILURE), None);
        // A crash count that falls back to 0 (a replay) is removed, not left behind.
        let replay = EngineHeaders {
            attempts: 0,
            crashes: 0,
            ..failed(0, 0, 5, 5)
        };
        let crashed = clone_headers(&Headers::new(), DEFAULT_ORIGIN, &failed(1, 3, 5, 5));
        let replayed = clone_headers(&crashed, DEFAULT_ORIGIN, &replay);
        assert_eq!(
            (replayed.get(ATTEMPTS), replayed.get(CRASHES)),
            (None, None)
        );
    }

    #[test]
    fn the_short_form_and_the_full_form_read_the_same() {
        use crate::{BrokerSignals, DeliveryFacts, ParkedRecord};
        let full: Headers = [
            (ATTEMPTS, HeaderValue::Int(3)),
            (CRASHES, HeaderValue::Int(0)),
            (FIRST_FAILURE, HeaderValue::Int(5)),
            (LAST_FAILURE, HeaderValue::Int(5)),
            (LAST_ERROR, HeaderValue::from("timeout")),
            (ORIGIN_QUEUE, HeaderValue::from("comments")),
            (ORIGIN_EXCHANGE, HeaderValue::from("")),
            (ORIGIN_ROUTING_KEY, HeaderValue::from("comments")),
            (REASON, HeaderValue::from("attempts-exhausted")),
        ]
        .into_iter()
        .collect();
        let short = clone_headers(
            &Headers::new(),
            DEFAULT_ORIGIN,
            &EngineHeaders {
                reason: Some(DeadLetterReason::AttemptsExhausted),
                delay: None,
                ..failed(3, 0, 5, 5)
            },
        );
        assert!(short.len() < full.len(), "{short:?}");
        assert_eq!(ParkedRecord::decode(&short), ParkedRecord::decode(&full));
        let signals = BrokerSignals::default();
        assert_eq!(
            DeliveryFacts::decode(&short, signals, 7),
            DeliveryFacts::decode(&full, signals, 7)
        );
    }

    #[test]
    fn names_compare_as_their_bytes() {
        let names = [
            "",
            "a",
            "ab",
            "abcdefgh",
            "abcdefgh1",
            "abcdefgi",
            "x-death",
            "x-retry-attempts",
            "x-retry-crashes",
            "x-retry-delay",
            "x-retry-last-error",
            "x-retry-last-failure",
            "x-retry-origin-queue",
            "é",
            "x-retry-attempts-and-more",
        ];
        for a in names {
            for b in names {
                assert_eq!(name_order(a, b), a.cmp(b), "{a:?} against {b:?}");
                assert_eq!(same_name(a, b), a == b, "{a:?} against {b:?}");
            }
        }
    }

    #[test]
    fn large_maps_stay_sorted() {
        let mut h = Headers::new();
        for i in (0..40i64).rev() {
            assert_eq!(h.insert(format!("k{i:02}"), i), None);
        }
        assert_eq!(h.insert("k07", 70i64), Some(HeaderValue::Int(7)));
        assert_eq!(h.remove("k39"), Some(HeaderValue::Int(39)));
        let names: Vec<&str> = h.iter().map(|(k, _)| k).collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(names.len(), 39);
        assert_eq!(h.get("k07"), Some(&HeaderValue::Int(70)));
        assert_eq!(h.get("k40"), None);
    }
}
