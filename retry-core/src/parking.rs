//! The parking lot: read, replay and purge the messages a work queue parked, on any
//! [`Transport`].
//!
//! A [`ParkingLot`] walks its parking queue one message at a time with a
//! [`QueueWalk`] ([`Transport::walk`]). A message it does not take stays unsettled with the
//! broker until the walk ends and is then put back where it was, so no message is looked at
//! twice in one walk and none is copied or rewritten to be left alone. A message it takes is
//! replayed (a copy published with a confirm, then the original acknowledged) or purged
//! (acknowledged). If the process dies at any point the broker puts back every delivery it
//! had not seen acknowledged: a replay can be repeated, never lost. The lot holds one
//! message at a time, whatever the length of the queue.
//!
//! The pure parts, usable on their own: [`ParkedFilter`] (which messages),
//! [`ParkedReason`] (why, `unknown` or `malformed` included), [`replay_headers`] (what a
//! replayed copy carries).

use std::fmt;
use std::ops::ControlFlow;
use std::str::FromStr;
use std::time::Duration;

use crate::ParkedRecord;
use crate::Timestamp;
use crate::headers::{self, DeadLetterReason, EngineHeaders, HeaderValue, Headers};
use crate::transport::{PublishResult, QueueWalk, Transport, TransportError};
use crate::{Confirm, Publish};
use crate::{Delivery, Message, MessageParts};
use crate::{Route, TopologyPlan};

/// Why a message is in the parking queue, as its headers tell.
///
/// ```
/// use retry_core::{DeadLetterReason, ParkedReason};
///
/// assert_eq!("crash-loop".parse(), Ok(ParkedReason::Known(DeadLetterReason::CrashLoop)));
/// assert_eq!("unknown".parse(), Ok(ParkedReason::Unknown));
/// assert!("crashed".parse::<ParkedReason>().is_err());
/// assert_eq!(ParkedReason::Malformed.to_string(), "malformed");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParkedReason {
    /// The engine parked it, for this reason (`x-retry-reason`).
    Known(DeadLetterReason),
    /// It has no `x-retry-reason`: parked by something else than the engine, such as the
    /// broker's delivery limit or another publisher (`unknown`).
    Unknown,
    /// Its `x-retry-reason` is not a string the engine writes (`malformed`).
    Malformed,
}

impl ParkedReason {
    /// The reason of a parked message's headers.
    ///
    /// ```
    /// use retry_core::{Headers, ParkedReason};
    ///
    /// let headers: Headers = [("x-retry-reason", "permanent")].into_iter().collect();
    /// assert_eq!(ParkedReason::of(&headers).to_string(), "permanent");
    /// assert_eq!(ParkedReason::of(&Headers::new()), ParkedReason::Unknown);
    /// ```
    pub fn of(headers: &Headers) -> Self {
        match headers.get(headers::REASON) {
            None => ParkedReason::Unknown,
            Some(value) => value
                .as_str()
                .and_then(DeadLetterReason::parse)
                .map_or(ParkedReason::Malformed, ParkedReason::Known),
        }
    }

    /// The spelling: a [`DeadLetterReason`]'s, `unknown` or `malformed`.
    pub fn as_str(self) -> &'static str {
        match self {
            ParkedReason::Known(reason) => reason.as_str(),
            ParkedReason::Unknown => "unknown",
            ParkedReason::Malformed => "malformed",
        }
    }
}

impl fmt::Display for ParkedReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reason that is none of the spellings [`ParkedReason`] reads.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown reason {given:?}: expected attempts-exhausted, max-elapsed, permanent, crash-loop, unknown or malformed"
)]
pub struct ParseReasonError {
    /// What was given.
    pub given: String,
}

impl FromStr for ParkedReason {
    type Err = ParseReasonError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "unknown" => Ok(ParkedReason::Unknown),
            "malformed" => Ok(ParkedReason::Malformed),
            other => DeadLetterReason::parse(other)
                .map(ParkedReason::Known)
                .ok_or_else(|| ParseReasonError {
                    given: other.to_owned(),
                }),
        }
    }
}

/// When a message was parked: its latest failure (`x-retry-last-failure`, written when it
/// was parked), or for a message the engine did not park, when the broker last
/// dead-lettered it (the `time` of its latest `x-death` entry).
///
/// ```
/// use retry_core::{Headers, Timestamp, parked_at};
///
/// let headers: Headers = [("x-retry-last-failure", 1_700_000_000_000i64)].into_iter().collect();
/// assert_eq!(parked_at(&headers), Some(Timestamp::from_millis(1_700_000_000_000)));
/// assert_eq!(parked_at(&Headers::new()), None);
/// ```
pub fn parked_at(headers: &Headers) -> Option<Timestamp> {
    if let Some(t) = ParkedRecord::decode(headers).last_failure {
        return Some(t);
    }
    let Some(HeaderValue::Array(deaths)) = headers.get("x-death") else {
        return None;
    };
    match deaths.first()? {
        HeaderValue::Table(death) => match death.get("time")? {
            HeaderValue::Timestamp(t) => Some(*t),
            other => other.as_u64().map(Timestamp::from_millis),
        },
        _ => None,
    }
}

/// Which parked messages an operation takes. Every condition given must hold; with none, all
/// messages match.
///
/// ```
/// use retry_core::{DeadLetterReason, Headers, Message, MessageParts, ParkedFilter, ParkedReason, Properties};
///
/// let parked = Message::new(MessageParts {
///     properties: Properties { message_id: Some("c-7".into()), ..Properties::default() },
///     headers: [("x-retry-reason", "permanent")].into_iter().collect(),
///     ..MessageParts::default()
/// });
/// assert!(ParkedFilter::all().matches(&parked));
/// assert!(ParkedFilter::ids(["c-1", "c-7"]).matches(&parked));
/// assert!(!ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::CrashLoop)).matches(&parked));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParkedFilter {
    ids: Vec<String>,
    reason: Option<ParkedReason>,
    parked_before: Option<Timestamp>,
    parked_after: Option<Timestamp>,
    error_group: Option<String>,
    error_containing: Option<String>,
}

impl ParkedFilter {
    /// Every message.
    pub fn all() -> Self {
        ParkedFilter::default()
    }

    /// Messages whose `message-id` is one of `ids`.
    pub fn ids<I, S>(ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ParkedFilter {
            ids: ids.into_iter().map(Into::into).collect(),
            ..ParkedFilter::default()
        }
    }

    /// Messages parked for `reason`.
    pub fn reason(reason: ParkedReason) -> Self {
        ParkedFilter::all().with_reason(reason)
    }

    /// Only messages parked for `reason`, as well.
    pub fn with_reason(mut self, reason: ParkedReason) -> Self {
        self.reason = Some(reason);
        self
    }

    /// Only messages parked before `t` (see [`parked_at`]; a message with no time does not
    /// match).
    pub fn parked_before(mut self, t: Timestamp) -> Self {
        self.parked_before = Some(t);
        self
    }

    /// Only messages parked at or after `t` (see [`parked_at`]; a message with no time does
    /// not match).
    pub fn parked_after(mut self, t: Timestamp) -> Self {
        self.parked_after = Some(t);
        self
    }

    /// Only messages whose last error folds to `fingerprint` ([`error_fingerprint`]): one
    /// failure group. The empty fingerprint matches messages with no last error.
    ///
    /// ```
    /// use retry_core::{Message, MessageParts, ParkedFilter, error_fingerprint};
    ///
    /// let parked = Message::new(MessageParts {
    ///     headers: [("x-retry-last-error", "order 1234 not found")].into_iter().collect(),
    ///     ..MessageParts::default()
    /// });
    /// let group = error_fingerprint(Some("order 98 not found"));
    /// assert!(ParkedFilter::all().with_error_group(group).matches(&parked));
    /// assert!(!ParkedFilter::all().with_error_group("").matches(&parked));
    /// ```
    pub fn with_error_group(mut self, fingerprint: impl Into<String>) -> Self {
        self.error_group = Some(fingerprint.into());
        self
    }

    /// Only messages whose last error contains `text`, ignoring the case of ASCII letters.
    /// A message with no last error does not match.
    pub fn with_error_containing(mut self, text: impl Into<String>) -> Self {
        self.error_containing = Some(text.into());
        self
    }

    /// Whether it takes every message.
    pub fn is_all(&self) -> bool {
        *self == ParkedFilter::default()
    }

    /// Whether `message` matches.
    pub fn matches(&self, message: &Message) -> bool {
        let headers = message.headers();
        let last_error = if self.error_group.is_some() || self.error_containing.is_some() {
            ParkedRecord::decode(headers).last_error
        } else {
            None
        };
        let fingerprint = match &self.error_group {
            Some(_) => error_fingerprint(last_error),
            None => String::new(),
        };
        self.matches_summary(&ParkedSummary {
            id: message.properties().message_id.as_deref(),
            reason: ParkedReason::of(headers),
            parked_at: parked_at(headers),
            last_error,
            fingerprint: &fingerprint,
        })
    }

    /// Whether a parked message read once into a [`ParkedSummary`] matches: as
    /// [`matches`](Self::matches) on the message, for a reader that matches the same
    /// messages many times (an index of a parking queue).
    pub fn matches_summary(&self, parked: &ParkedSummary<'_>) -> bool {
        if !self.ids.is_empty() && !parked.id.is_some_and(|id| self.ids.iter().any(|w| w == id)) {
            return false;
        }
        if self.reason.is_some_and(|r| r != parked.reason) {
            return false;
        }
        if self
            .error_group
            .as_deref()
            .is_some_and(|group| group != parked.fingerprint)
        {
            return false;
        }
        if let Some(text) = &self.error_containing
            && !parked
                .last_error
                .is_some_and(|e| contains_ignoring_ascii_case(e, text))
        {
            return false;
        }
        if self.parked_before.is_none() && self.parked_after.is_none() {
            return true;
        }
        let Some(at) = parked.parked_at else {
            return false;
        };
        self.parked_before.is_none_or(|t| at < t) && self.parked_after.is_none_or(|t| at >= t)
    }
}

/// What a [`ParkedFilter`] looks at in a parked message.
#[derive(Clone, Copy, Debug)]
pub struct ParkedSummary<'a> {
    /// Its `message-id`.
    pub id: Option<&'a str>,
    /// Why it was parked.
    pub reason: ParkedReason,
    /// When it was parked ([`parked_at`]).
    pub parked_at: Option<Timestamp>,
    /// Its last error (`x-retry-last-error`).
    pub last_error: Option<&'a str>,
    /// [`error_fingerprint`] of `last_error`: read only by a filter with
    /// [`with_error_group`](ParkedFilter::with_error_group).
    pub fingerprint: &'a str,
}

/// Whether `haystack` contains `needle`, ignoring the case of ASCII letters.
fn contains_ignoring_ascii_case(haystack: &str, needle: &str) -> bool {
    let (h, n) = (haystack.as_bytes(), needle.as_bytes());
    n.is_empty() || h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
}

/// The longest fingerprint [`error_fingerprint`] returns, in characters.
pub const FINGERPRINT_MAX_CHARS: usize = 200;

/// A last error with its variable parts folded away, so that failures of the same kind
/// group together, as ServicePulse groups failed messages by exception: the first line
/// only, then UUIDs as `<uuid>`, IPv4 addresses (with their port) as `<ip>`, e-mail
/// addresses as `<email>`, quoted text as `"…"`, runs of hex digits of 8 or more with a
/// digit and a letter in them as `<hex>`, and every other number as `<n>`; cut at
/// [`FINGERPRINT_MAX_CHARS`]. No error (`None`) folds to the empty string.
///
/// ```
/// use retry_core::error_fingerprint;
///
/// assert_eq!(
///     error_fingerprint(Some("order 1234 not found on 10.0.0.7:5432")),
///     "order <n> not found on <ip>",
/// );
/// assert_eq!(
///     error_fingerprint(Some("user \"ann@example.com\" locked, id 3f2a9c1e-0b4d-4c55-9e0a-1b2c3d4e5f60")),
///     "user \"…\" locked, id <uuid>",
/// );
/// assert_eq!(error_fingerprint(Some("timeout after 30s\n  at db.rs:12")), "timeout after <n>s");
/// assert_eq!(error_fingerprint(None), "");
/// ```
pub fn error_fingerprint(error: Option<&str>) -> String {
    let Some(error) = error else {
        return String::new();
    };
    let line = error
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() && out.chars().count() < FINGERPRINT_MAX_CHARS {
        let c = chars[i];
        let word_start = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if (c == '"' || c == '\'')
            && let Some(end) = chars[i + 1..].iter().position(|&q| q == c)
        {
            out.push(c);
            out.push('…');
            out.push(c);
            i += end + 2;
            continue;
        }
        if word_start && let Some(len) = fingerprint_token(&chars[i..]) {
            out.push_str(len.1);
            i += len.0;
            continue;
        }
        if c.is_ascii_digit() {
            while i < chars.len()
                && (chars[i].is_ascii_digit()
                    || (chars[i] == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)))
            {
                i += 1;
            }
            out.push_str("<n>");
            continue;
        }
        out.push(if c.is_control() { ' ' } else { c });
        i += 1;
    }
    out.chars().take(FINGERPRINT_MAX_CHARS).collect()
}

/// A variable token at the start of `chars` that [`error_fingerprint`] folds: its length
/// and its placeholder.
fn fingerprint_token(chars: &[char]) -> Option<(usize, &'static str)> {
    let word = chars
        .iter()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | ':' | '@' | '_' | '+'))
        .count();
    let text: String = chars[..word].iter().collect();
    let text = text.trim_end_matches(['.', ':', '-']);
    let is_hex = |s: &str| s.chars().all(|c| c.is_ascii_hexdigit());
    let uuid = text.len() >= 36 && {
        let parts: Vec<&str> = text[..36].split('-').collect();
        parts.len() == 5
            && parts.iter().map(|p| p.len()).eq([8, 4, 4, 4, 12])
            && parts.iter().all(|p| is_hex(p))
    };
    if uuid {
        return Some((36, "<uuid>"));
    }
    if let Some(at) = text.find('@')
        && at > 0
        && text[at + 1..].contains('.')
    {
        return Some((text.len(), "<email>"));
    }
    let host = text.split(':').next().unwrap_or("");
    let octets: Vec<&str> = host.split('.').collect();
    if octets.len() == 4
        && octets
            .iter()
            .all(|o| !o.is_empty() && o.len() <= 3 && o.chars().all(|c| c.is_ascii_digit()))
    {
        let port = text[host.len()..].strip_prefix(':').map_or(0, |p| {
            1 + p.chars().take_while(char::is_ascii_digit).count()
        });
        return Some((host.len() + port, "<ip>"));
    }
    let run = chars.iter().take_while(|c| c.is_ascii_hexdigit()).count();
    let ends = chars.get(run).is_none_or(|c| !c.is_alphanumeric());
    let hex = &chars[..run];
    if run >= 8
        && ends
        && hex.iter().any(char::is_ascii_digit)
        && hex.iter().any(char::is_ascii_alphabetic)
    {
        return Some((run, "<hex>"));
    }
    None
}

/// The headers of a replayed copy: the parked message's, with the engine's counters reset
/// (attempts, crashes, first and last failure, the reason, the last error and the delay are
/// removed, and the broker's own headers dropped), its history kept (`x-retry-replays` one
/// higher, `x-retry-replayed-at` = `now`, the reason and the last error it was parked with
/// as `x-retry-previous-reason` and `x-retry-previous-error`), and every other header, the
/// user's and the origin, untouched.
///
/// ```
/// use retry_core::headers::{self, HeaderValue};
/// use retry_core::{Headers, Timestamp, replay_headers};
///
/// let parked: Headers = [
///     ("x-retry-attempts", HeaderValue::Int(5)),
///     ("x-retry-reason", "attempts-exhausted".into()),
///     ("x-retry-last-error", "timeout".into()),
///     ("tenant", "acme".into()),
/// ].into_iter().collect();
/// let copy = replay_headers(&parked, Timestamp::from_millis(42));
/// assert_eq!(copy.get(headers::ATTEMPTS), None);
/// assert_eq!(copy.get(headers::REPLAYS), Some(&HeaderValue::Int(1)));
/// assert_eq!(copy.get(headers::REPLAYED_AT), Some(&HeaderValue::Int(42)));
/// assert_eq!(copy.get(headers::PREVIOUS_REASON).and_then(|v| v.as_str()), Some("attempts-exhausted"));
/// assert_eq!(copy.get(headers::PREVIOUS_ERROR).and_then(|v| v.as_str()), Some("timeout"));
/// assert_eq!(copy.get("tenant").and_then(|v| v.as_str()), Some("acme"));
/// ```
pub fn replay_headers(parked: &Headers, now: Timestamp) -> Headers {
    const RESET: [&str; 7] = [
        headers::ATTEMPTS,
        headers::CRASHES,
        headers::FIRST_FAILURE,
        headers::LAST_FAILURE,
        headers::LAST_ERROR,
        headers::REASON,
        headers::DELAY,
    ];
    let replays = parked
        .get(headers::REPLAYS)
        .and_then(HeaderValue::as_u64)
        .map_or(1, |n| n.saturating_add(1));
    let mut out: Headers = parked
        .iter()
        .filter(|(k, _)| !RESET.contains(k) && !headers::BROKER_OWNED.contains(k))
        .map(|(k, v)| (k.to_owned(), v.clone()))
        .collect();
    out.insert_static(headers::REPLAYS, i64::try_from(replays).unwrap_or(i64::MAX));
    out.insert_static(
        headers::REPLAYED_AT,
        i64::try_from(now.as_millis()).unwrap_or(i64::MAX),
    );
    for (from, to) in [
        (headers::REASON, headers::PREVIOUS_REASON),
        (headers::LAST_ERROR, headers::PREVIOUS_ERROR),
    ] {
        match parked.get(from) {
            Some(value) => out.insert_static(to, value.clone()),
            None => out.remove(to),
        };
    }
    out
}

/// A message read from a parking queue.
#[derive(Clone, Debug)]
pub struct ParkedMessage {
    message: Message,
}

impl ParkedMessage {
    /// The message as parked: body, properties and headers.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// Its `message-id`.
    pub fn id(&self) -> Option<&str> {
        self.message.properties().message_id.as_deref()
    }

    /// The engine's record on it; malformed values are listed in its `malformed`.
    pub fn record(&self) -> ParkedRecord<'_> {
        ParkedRecord::decode(self.message.headers())
    }

    /// Why it was parked.
    pub fn reason(&self) -> ParkedReason {
        ParkedReason::of(self.message.headers())
    }

    /// When it was parked (see [`parked_at`]).
    pub fn parked_at(&self) -> Option<Timestamp> {
        parked_at(self.message.headers())
    }
}

/// The slowest replay rate [`ReplayOptions::rate`] takes: one message every 1,000 seconds.
/// A slower rate would leave a walk holding the parking queue for hours per message.
pub const MIN_REPLAY_RATE: f64 = 0.001;

/// How to replay: as fast as confirms come back, by default.
///
/// ```
/// use retry_core::ReplayOptions;
///
/// let careful = ReplayOptions::default().with_rate(20.0).with_dry_run(true);
/// assert_eq!((careful.rate, careful.dry_run), (Some(20.0), true));
/// assert_eq!(ReplayOptions::default().rate, None);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// At most this many replays per second; `None` replays as fast as confirms come back.
    pub rate: Option<f64>,
    /// Count what would be replayed, and replay nothing.
    pub dry_run: bool,
}

impl ReplayOptions {
    /// At most `per_second` replays per second.
    pub fn with_rate(mut self, per_second: f64) -> Self {
        self.rate = Some(per_second);
        self
    }

    /// Counts, and replays nothing.
    pub fn with_dry_run(mut self, on: bool) -> Self {
        self.dry_run = on;
        self
    }
}

/// What one walk of the parking queue did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkingReport {
    /// Messages read.
    pub seen: u64,
    /// Of those, messages the filter matched (and a `pick`, when there is one, took).
    pub matched: u64,
    /// Copies confirmed in the work queue whose original was then acknowledged.
    pub replayed: u64,
    /// Originals acknowledged without a copy.
    pub purged: u64,
    /// Messages read and put back: not matched, replayed already in this walk (parked again
    /// since), matched in a dry run or browsed, or whose copy the broker did not take.
    pub left: u64,
    /// Of those left, messages a replay matched but the transport cannot copy
    /// ([`TransportError::Unsupported`]: one it could not read as it came, whose properties
    /// it holds only as bytes). They stay parked, to be read or purged, and the replay goes
    /// on with the next message.
    pub uncopyable: u64,
}

/// A parking-lot operation failed. Nothing is lost: every message not yet acknowledged is
/// back in the parking queue, or is on its way back as the connection closes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParkingError {
    /// A replay rate ([`ReplayOptions::rate`]) that is not a finite number of at least
    /// [`MIN_REPLAY_RATE`].
    #[error("replay rate {rate} is not a number of messages per second of at least 0.001")]
    InvalidRate {
        /// The rate given.
        rate: f64,
    },
    /// The parking queue does not exist.
    #[error("queue {queue:?} does not exist")]
    UnknownQueue {
        /// Its name.
        queue: String,
    },
    /// The broker did not take a replayed copy; the original stays parked.
    #[error(
        "the broker did not take the replayed copy of {message} into {queue:?} ({answer:?}); the original stays parked"
    )]
    CopyRefused {
        /// The message's id, or `(no message-id)`.
        message: String,
        /// The work queue.
        queue: String,
        /// The broker's answer.
        answer: Confirm,
        /// The transport's error, when the publish failed.
        #[source]
        source: Option<TransportError>,
    },
    /// Reading or settling failed.
    #[error("{operation} on {queue:?} failed")]
    Transport {
        /// What was being done.
        operation: &'static str,
        /// The queue.
        queue: String,
        /// The transport's error.
        #[source]
        source: TransportError,
    },
    /// The report so far, when an operation stopped part way.
    #[error("{source} (after {replayed} replayed, {purged} purged)", replayed = report.replayed, purged = report.purged)]
    Interrupted {
        /// What was done before it stopped.
        report: ParkingReport,
        /// Why it stopped.
        #[source]
        source: Box<ParkingError>,
    },
}

impl ParkingError {
    /// What was done before the operation stopped: zero for an error that stopped it before
    /// anything was done.
    pub fn report(&self) -> ParkingReport {
        match self {
            ParkingError::Interrupted { report, .. } => *report,
            _ => ParkingReport::default(),
        }
    }
}

/// What a replay or purge does with one message its filter matched: the answer of the
/// `pick` of [`ParkingLot::replay_picked`] and [`ParkingLot::purge_picked`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Replay or purge it.
    Take,
    /// Leave it where it is, and go on.
    Leave,
    /// Leave it, and end the walk: every message not taken yet stays where it was.
    Stop,
}

/// Chooses among the messages a filter matched.
type Picker<'p> = &'p mut (dyn FnMut(&Message) -> Pick + Send);

/// What to do with each matching message.
enum Take<'v> {
    Browse(&'v mut (dyn FnMut(ParkedMessage) -> ControlFlow<()> + Send)),
    Replay(ReplayOptions, Picker<'v>),
    Purge(Picker<'v>),
}

/// The parking queue of one work queue, on a transport.
///
/// ```
/// # use retry_core::*;
/// # async fn demo<T: Transport>(transport: T, plan: &TopologyPlan) -> Result<(), ParkingError> {
/// let lot = ParkingLot::new(transport, plan);
/// // Read every parked message, without taking any.
/// lot.browse(&ParkedFilter::all(), |parked| {
///     println!("{:?} {} {:?}", parked.id(), parked.reason(), parked.record().last_error);
///     std::ops::ControlFlow::Continue(())
/// })
/// .await?;
/// // Replay the ones a fixed bug parked.
/// let report = lot
///     .replay(&ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent)), ReplayOptions::default(), |_| {})
///     .await?;
/// println!("replayed {}, left {}", report.replayed, report.left);
/// # Ok(())
/// # }
/// ```
///
/// A complete run on the in-memory broker is in `transport-memory/tests/parking.rs`; on
/// RabbitMQ, `retryctl parked` (the `retryctl` crate) drives it.
pub struct ParkingLot<T> {
    transport: T,
    work_queue: String,
    parking_queue: String,
}

impl<T: Transport> ParkingLot<T> {
    /// The parking queue of `plan`, replaying to its work queue.
    pub fn new(transport: T, plan: &TopologyPlan) -> Self {
        ParkingLot::with_queues(transport, plan.work_queue(), plan.parking_queue())
    }

    /// The parking queue `parking_queue`, replaying to `work_queue`.
    pub fn with_queues(
        transport: T,
        work_queue: impl Into<String>,
        parking_queue: impl Into<String>,
    ) -> Self {
        ParkingLot {
            transport,
            work_queue: work_queue.into(),
            parking_queue: parking_queue.into(),
        }
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The work queue replays go to.
    pub fn work_queue(&self) -> &str {
        &self.work_queue
    }

    /// The parking queue.
    pub fn parking_queue(&self) -> &str {
        &self.parking_queue
    }

    /// Hands each parked message that `filter` matches to `visit`, in queue order, and
    /// leaves every message where it was. `visit` returns [`ControlFlow::Break`] to stop
    /// early.
    pub async fn browse<F>(
        &self,
        filter: &ParkedFilter,
        mut visit: F,
    ) -> Result<ParkingReport, ParkingError>
    where
        F: FnMut(ParkedMessage) -> ControlFlow<()> + Send,
    {
        self.walk(filter, Take::Browse(&mut visit), &mut |_| {})
            .await
    }

    /// Replays each parked message that `filter` matches to the work queue (never to the
    /// exchange it was first published to, which may fan out): a copy with the headers of
    /// [`replay_headers`], the body and properties unchanged, is published with a confirm,
    /// and only then is the parked original acknowledged. A message is replayed at most
    /// once per call: a copy parked again while the call runs is left. `progress` sees the
    /// report after each message. A rate that is not a finite number of at least
    /// [`MIN_REPLAY_RATE`] is refused with [`ParkingError::InvalidRate`] before anything is
    /// read.
    pub async fn replay(
        &self,
        filter: &ParkedFilter,
        options: ReplayOptions,
        progress: impl FnMut(&ParkingReport) + Send,
    ) -> Result<ParkingReport, ParkingError> {
        self.replay_picked(filter, options, |_| Pick::Take, progress)
            .await
    }

    /// As [`replay`](Self::replay), but each message `filter` matches is first shown to
    /// `pick`, which takes it, leaves it, or ends the walk ([`Pick`]); only the messages it
    /// takes count as matched. With a rate, `pick` is asked once the message's turn has
    /// come, so a `pick` that stops the walk (an operator cancelling) is heard before the
    /// next replay, not after it.
    ///
    /// ```
    /// # use retry_core::*;
    /// # async fn demo<T: Transport>(lot: ParkingLot<T>) -> Result<(), ParkingError> {
    /// // Replay at most 10 of the messages parked for good, then stop.
    /// let mut left = 10;
    /// let filter = ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent));
    /// let pick = |_: &Message| {
    ///     if left == 0 {
    ///         return Pick::Stop;
    ///     }
    ///     left -= 1;
    ///     Pick::Take
    /// };
    /// lot.replay_picked(&filter, ReplayOptions::default(), pick, |_| {}).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn replay_picked(
        &self,
        filter: &ParkedFilter,
        options: ReplayOptions,
        mut pick: impl FnMut(&Message) -> Pick + Send,
        mut progress: impl FnMut(&ParkingReport) + Send,
    ) -> Result<ParkingReport, ParkingError> {
        if let Some(rate) = options
            .rate
            .filter(|r| !(r.is_finite() && *r >= MIN_REPLAY_RATE))
        {
            return Err(ParkingError::InvalidRate { rate });
        }
        self.walk(filter, Take::Replay(options, &mut pick), &mut progress)
            .await
    }

    /// Acknowledges (removes) each parked message that `filter` matches. `progress` sees the
    /// report after each message.
    pub async fn purge(
        &self,
        filter: &ParkedFilter,
        progress: impl FnMut(&ParkingReport) + Send,
    ) -> Result<ParkingReport, ParkingError> {
        self.purge_picked(filter, |_| Pick::Take, progress).await
    }

    /// As [`purge`](Self::purge), but each message `filter` matches is first shown to
    /// `pick` ([`Pick`]); only the messages it takes count as matched. A console purges
    /// exactly the messages an operator confirmed this way, however many more match by
    /// the time the purge runs.
    pub async fn purge_picked(
        &self,
        filter: &ParkedFilter,
        mut pick: impl FnMut(&Message) -> Pick + Send,
        mut progress: impl FnMut(&ParkingReport) + Send,
    ) -> Result<ParkingReport, ParkingError> {
        self.walk(filter, Take::Purge(&mut pick), &mut progress)
            .await
    }

    async fn walk(
        &self,
        filter: &ParkedFilter,
        mut take: Take<'_>,
        progress: &mut (dyn FnMut(&ParkingReport) + Send),
    ) -> Result<ParkingReport, ParkingError> {
        let queue = &self.parking_queue;
        let walk = self
            .transport
            .walk(queue)
            .await
            .map_err(|e| transport_error(queue, "reading", e))?;
        let mut pass = Pass {
            lot: self,
            walk,
            report: ParkingReport::default(),
            started: self.transport.now(),
        };
        let result = pass.run(filter, &mut take, progress).await;
        let ended = pass
            .walk
            .end()
            .await
            .map_err(|e| transport_error(queue, "putting back unmatched messages", e));
        let report = pass.report;
        match (result, ended) {
            (Ok(()), Ok(())) => Ok(report),
            (Err(e), _) | (Ok(()), Err(e)) if report == ParkingReport::default() => Err(e),
            (Err(e), _) | (Ok(()), Err(e)) => Err(ParkingError::Interrupted {
                report,
                source: Box::new(e),
            }),
        }
    }

    /// Publishes the replayed copy of `parked` to the work queue and waits for its confirm.
    async fn replay_one(&self, parked: Message) -> Result<(), ParkingError> {
        let work = &self.work_queue;
        let now = self.transport.now();
        let id = parked.properties().message_id.clone();
        let parts = parked.parts();
        let copy = Message::new(MessageParts {
            queue: work.clone(),
            exchange: String::new(),
            routing_key: work.clone(),
            body: parts.body.clone(),
            properties: parts.properties.clone(),
            headers: replay_headers(&parts.headers, now),
            // The user's headers go out as they came, whatever types the model reads them as.
            native: parts.native.clone(),
        });
        drop(parked);
        let publish = Publish {
            route: Route {
                exchange: "".into(),
                routing_key: work.as_str().into(),
            },
            expiration: None,
            headers: EngineHeaders {
                attempts: 0,
                crashes: 0,
                first_failure: None,
                last_failure: None,
                last_error: None,
                reason: None,
                delay: None,
                suspect: None,
            },
        };
        let result = self.transport.publish(&copy, &publish).await;
        let answer = result.confirm();
        match result {
            PublishResult::Confirmed => Ok(()),
            other => Err(ParkingError::CopyRefused {
                message: id.unwrap_or_else(|| "(no message-id)".into()),
                queue: work.clone(),
                answer,
                source: match other {
                    PublishResult::Failed(e) => Some(e),
                    _ => None,
                },
            }),
        }
    }
}

/// A transport's error on the parking queue, as the parking lot reports it: a queue that is
/// not there is [`ParkingError::UnknownQueue`].
fn transport_error(queue: &str, operation: &'static str, source: TransportError) -> ParkingError {
    match source {
        TransportError::MissingAddress { .. } => ParkingError::UnknownQueue {
            queue: queue.to_owned(),
        },
        source => ParkingError::Transport {
            operation,
            queue: queue.to_owned(),
            source,
        },
    }
}

/// One walk of the parking queue, and its counts.
struct Pass<'a, T: Transport> {
    lot: &'a ParkingLot<T>,
    walk: Box<dyn QueueWalk<T::Tag> + 'a>,
    report: ParkingReport,
    started: Timestamp,
}

impl<T: Transport> Pass<'_, T> {
    async fn run(
        &mut self,
        filter: &ParkedFilter,
        take: &mut Take<'_>,
        progress: &mut (dyn FnMut(&ParkingReport) + Send),
    ) -> Result<(), ParkingError> {
        let queue = &self.lot.parking_queue;
        let mut paced = 0u32;
        loop {
            let Some(delivery) = self
                .walk
                .next()
                .await
                .map_err(|e| transport_error(queue, "reading", e))?
            else {
                return Ok(());
            };
            let Delivery { tag, message, .. } = delivery;
            self.report.seen += 1;
            let replayed_in_this_walk = matches!(take, Take::Replay(..))
                && message
                    .headers()
                    .get(headers::REPLAYED_AT)
                    .and_then(HeaderValue::as_u64)
                    .is_some_and(|at| at >= self.started.as_millis());
            if replayed_in_this_walk || !filter.matches(&message) {
                self.leave(tag);
                progress(&self.report);
                continue;
            }
            match take {
                Take::Browse(visit) => {
                    self.report.matched += 1;
                    self.leave(tag);
                    if visit(ParkedMessage { message }).is_break() {
                        return Ok(());
                    }
                }
                Take::Purge(pick) => match pick(&message) {
                    Pick::Take => {
                        self.report.matched += 1;
                        self.ack(tag, "purging").await?;
                        self.report.purged += 1;
                    }
                    Pick::Leave => self.leave(tag),
                    Pick::Stop => {
                        self.leave(tag);
                        return Ok(());
                    }
                },
                Take::Replay(options, pick) => {
                    if let Some(rate) = options.rate.filter(|_| !options.dry_run) {
                        // Paced from the walk's start, so a slow confirm is caught up on. A
                        // message left by `pick` takes no turn: the next one goes at once.
                        let wait = Duration::try_from_secs_f64(f64::from(paced) / rate)
                            .unwrap_or(Duration::MAX);
                        let due = self.started.saturating_add(wait);
                        let now = self.lot.transport.now();
                        if due > now {
                            self.lot
                                .transport
                                .sleep(due.saturating_duration_since(now))
                                .await;
                        }
                    }
                    match pick(&message) {
                        Pick::Take => {}
                        Pick::Leave => {
                            self.leave(tag);
                            progress(&self.report);
                            continue;
                        }
                        Pick::Stop => {
                            self.leave(tag);
                            return Ok(());
                        }
                    }
                    self.report.matched += 1;
                    if options.dry_run {
                        self.leave(tag);
                    } else {
                        paced += 1;
                        match self.lot.replay_one(message).await {
                            Ok(()) => {}
                            // A message no copy can be made of stops nothing: it stays.
                            Err(ParkingError::CopyRefused {
                                source: Some(TransportError::Unsupported { .. }),
                                ..
                            }) => {
                                self.leave(tag);
                                self.report.uncopyable += 1;
                                progress(&self.report);
                                continue;
                            }
                            Err(e) => {
                                // Not confirmed: the original stays, put back with the others.
                                self.leave(tag);
                                return Err(e);
                            }
                        }
                        self.ack(tag, "acknowledging a replayed message").await?;
                        self.report.replayed += 1;
                    }
                }
            }
            progress(&self.report);
        }
    }

    fn leave(&mut self, tag: T::Tag) {
        self.walk.leave(tag);
        self.report.left += 1;
    }

    async fn ack(&mut self, tag: T::Tag, operation: &'static str) -> Result<(), ParkingError> {
        self.walk
            .ack(tag)
            .await
            .map_err(|e| transport_error(&self.lot.parking_queue, operation, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(error: &str) -> String {
        error_fingerprint(Some(error))
    }

    #[test]
    fn a_fingerprint_folds_what_varies_between_failures_of_one_kind() {
        assert_eq!(fp("order 1234 not found"), fp("order 7 not found"));
        assert_eq!(fp("order o-1234 not found"), "order o-<n> not found");
        assert_eq!(fp("took 1.25 s"), "took <n> s");
        assert_eq!(
            fp("connect to 192.168.1.20:5432 refused"),
            "connect to <ip> refused"
        );
        assert_eq!(
            fp("mail to bob@example.org bounced"),
            "mail to <email> bounced"
        );
        assert_eq!(
            fp("row 0b4d9c1e-0b4d-4c55-9e0a-1b2c3d4e5f60 locked"),
            "row <uuid> locked"
        );
        assert_eq!(fp("blob deadbeef00 missing"), "blob <hex> missing");
        // Eight digits with no letter are a number, not hex.
        assert_eq!(fp("waited 30000000 ms"), "waited <n> ms");
        // Words are not numbers, and quoted text folds whole.
        assert_eq!(
            fp("decode failed: 'x' is not a field"),
            "decode failed: '…' is not a field"
        );
        assert_eq!(fp("v2 schema"), "v<n> schema");
        assert_eq!(fp("an unmatched \" stays"), "an unmatched \" stays");
    }

    #[test]
    fn a_fingerprint_keeps_the_first_line_and_is_cut() {
        assert_eq!(fp("\n  timeout\n at src/db.rs:12"), "timeout");
        assert_eq!(fp("tab\there"), "tab here");
        let long = "x".repeat(FINGERPRINT_MAX_CHARS * 2);
        assert_eq!(fp(&long).chars().count(), FINGERPRINT_MAX_CHARS);
        assert_eq!(fp(""), "");
        assert_eq!(error_fingerprint(None), "");
        // Not a panic on text that is not ASCII, around what looks like tokens.
        assert_eq!(fp("échec 12 à 10.0.0.1"), "échec <n> à <ip>");
    }

    #[test]
    fn a_filter_by_group_or_error_text_reads_the_last_error() {
        let parked = |error: Option<&str>| {
            let headers: Headers = error
                .map(|e| (headers::LAST_ERROR, HeaderValue::from(e)))
                .into_iter()
                .collect();
            Message::new(MessageParts {
                headers,
                ..MessageParts::default()
            })
        };
        let timeout = parked(Some("DB Timeout after 30 s"));
        let none = parked(None);
        let group = ParkedFilter::all().with_error_group(fp("db timeout after 5 s"));
        assert!(
            !group.matches(&timeout),
            "the group folds numbers, not case"
        );
        let group = ParkedFilter::all().with_error_group(fp("DB Timeout after 5 s"));
        assert!(group.matches(&timeout));
        assert!(!group.matches(&none));
        assert!(ParkedFilter::all().with_error_group("").matches(&none));
        let text = ParkedFilter::all().with_error_containing("TIMEOUT");
        assert!(text.matches(&timeout));
        assert!(!text.matches(&none));
        assert!(
            !ParkedFilter::all()
                .with_error_containing("refused")
                .matches(&timeout)
        );
        assert!(!text.is_all());
    }
}
