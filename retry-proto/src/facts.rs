//! `DeliveryFacts`: what the engine knows about a delivery, decoded from its headers and the
//! broker's signals without allocating and without ever panicking.

use std::fmt;
use std::time::Duration;

use crate::headers::DeadLetterReason;
use crate::headers::{self, HeaderValue, Headers};
use crate::time::Timestamp;

/// Counters above this are treated as garbage: no real message is retried a million times.
pub const MAX_COUNTER: u64 = 1_000_000;

/// Timestamps after 9999-12-31 are treated as garbage.
const MAX_MILLIS: u64 = 253_402_300_799_999;

/// What the broker says about a delivery, outside its headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BrokerSignals {
    /// AMQP 0-9-1 `redelivered`, or the negation of AMQP 1.0 `first-acquirer`.
    pub redelivered: bool,
    /// AMQP 1.0 `header.delivery-count`: earlier unsuccessful deliveries. (Quorum queues'
    /// `x-delivery-count` is a header and is read from the header map.)
    pub delivery_count: Option<u32>,
}

/// Headers whose values were present but unusable, as a small set.
///
/// ```
/// use retry_proto::{BrokerSignals, DeliveryFacts, Headers};
///
/// let headers: Headers = [("x-retry-attempts", "many")].into_iter().collect();
/// let facts = DeliveryFacts::decode(&headers, BrokerSignals::default(), 0);
/// assert_eq!(facts.attempts, 0); // read as absent
/// assert_eq!(facts.malformed.names().collect::<Vec<_>>(), ["x-retry-attempts"]);
/// ```
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Malformed(u32);

const KNOWN: [&str; 17] = [
    headers::ATTEMPTS,
    headers::CRASHES,
    headers::FIRST_FAILURE,
    headers::LAST_FAILURE,
    headers::LAST_ERROR,
    headers::ORIGIN_QUEUE,
    headers::ORIGIN_EXCHANGE,
    headers::ORIGIN_ROUTING_KEY,
    headers::REASON,
    headers::DELAY,
    "x-death",
    "x-delivery-count",
    headers::REPLAYS,
    headers::REPLAYED_AT,
    headers::PREVIOUS_REASON,
    headers::PREVIOUS_ERROR,
    headers::SUSPECT,
];

impl Malformed {
    /// Whether every header was usable.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether `name` was malformed.
    pub fn contains(self, name: &str) -> bool {
        KNOWN
            .iter()
            .position(|k| *k == name)
            .is_some_and(|i| self.0 & (1 << i) != 0)
    }

    /// The names of the malformed headers.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        KNOWN
            .iter()
            .enumerate()
            .filter(move |(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, k)| *k)
    }

    fn mark(&mut self, name: &str) {
        if let Some(i) = KNOWN.iter().position(|k| *k == name) {
            self.0 |= 1 << i;
        }
    }
}

impl fmt::Debug for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.names()).finish()
    }
}

/// Everything the engine needs to decide about a delivery. `Copy`, and decoded without
/// allocating.
///
/// ```
/// use retry_proto::{BrokerSignals, DeliveryFacts, Headers, Timestamp};
///
/// let headers: Headers = [
///     ("x-retry-attempts", 2i64),
///     ("x-retry-first-failure", 1_700_000_000_000i64),
/// ].into_iter().collect();
/// let facts = DeliveryFacts::decode(&headers, BrokerSignals { redelivered: true, ..Default::default() }, 9);
/// assert_eq!(facts.attempts, 2);
/// assert_eq!(facts.first_failure, Some(Timestamp::from_millis(1_700_000_000_000)));
/// assert_eq!(facts.crash_evidence(), 1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeliveryFacts {
    /// Failed runs recorded by the engine's headers.
    pub attempts: u32,
    /// Crashes recorded by the engine's headers.
    pub crashes: u32,
    /// First failure recorded by the engine's headers.
    pub first_failure: Option<Timestamp>,
    /// Latest failure recorded by the engine's headers.
    pub last_failure: Option<Timestamp>,
    /// The broker's redelivered flag.
    pub redelivered: bool,
    /// AMQP 1.0 `delivery-count`: the broker's count of earlier deliveries of this copy; 0
    /// when the broker keeps none.
    pub delivery_count: u32,
    /// The `x-delivery-count` header, which a quorum queue sets on each redelivery. On a
    /// classic queue only a publisher can have set it (a shovel or a forwarding application
    /// copies headers), so the [`Engine`](crate::Engine) reads it only when its plan's queues
    /// are quorum queues.
    pub x_delivery_count: u32,
    /// The sum of `x-death` counts: how often this message was dead-lettered by the broker.
    pub deaths: u32,
    /// Seed of this message's jitter: see [`message_identity`](crate::message_identity).
    pub identity: u64,
    /// The token of a suspect's copy ([`headers::SUSPECT`]), written when the engine put
    /// it in the isolation queue.
    pub suspect: Option<u64>,
    /// Headers that were present but unusable, read as absent.
    pub malformed: Malformed,
}

impl DeliveryFacts {
    /// Decodes the facts from a delivery's headers and the broker's signals.
    pub fn decode(headers: &Headers, signals: BrokerSignals, identity: u64) -> Self {
        let mut malformed = Malformed::default();
        let attempts = counter(headers, headers::ATTEMPTS, &mut malformed).unwrap_or(0);
        let crashes = counter(headers, headers::CRASHES, &mut malformed).unwrap_or(0);
        let first_failure = time(headers, headers::FIRST_FAILURE, &mut malformed);
        // Written only when it differs from the first (`EngineHeaders::write_into`).
        let last_failure = time(headers, headers::LAST_FAILURE, &mut malformed).or(first_failure);
        let x_delivery_count = counter(headers, "x-delivery-count", &mut malformed).unwrap_or(0);
        let deaths = x_death_count(headers, &mut malformed);
        let suspect = headers.get(headers::SUSPECT).and_then(|v| {
            // The engine draws its tokens at most `i64::MAX`, and writes them signed: a
            // larger one is not the engine's (and would not be written back as it came).
            let token = v.as_u64().filter(|t| i64::try_from(*t).is_ok());
            if token.is_none() {
                malformed.mark(headers::SUSPECT);
            }
            token
        });
        let amqp10_count = signals
            .delivery_count
            .filter(|n| u64::from(*n) <= MAX_COUNTER)
            .unwrap_or(0);
        DeliveryFacts {
            attempts,
            crashes,
            first_failure,
            last_failure,
            redelivered: signals.redelivered,
            delivery_count: amqp10_count,
            x_delivery_count,
            deaths,
            identity,
            suspect,
            malformed,
        }
    }

    /// What an excuse for this delivery is keyed by ([`Engine::excuse`](crate::Engine::excuse)):
    /// its suspect token, or for a copy without one, its identity.
    pub fn excuse_key(&self) -> u64 {
        self.suspect.unwrap_or(self.identity)
    }

    /// How many crashes this delivery shows beyond the recorded ones: the larger of the
    /// broker's delivery counts, or 1 for a bare redelivered flag.
    pub fn crash_evidence(&self) -> u32 {
        self.delivery_count
            .max(self.x_delivery_count)
            .max(u32::from(self.redelivered))
    }
}

/// The engine's record on a message, strings included, borrowed from its headers: what a
/// parking-queue listener reads to report why a message was parked.
///
/// ```
/// use retry_proto::{DeadLetterReason, Headers, ParkedRecord};
///
/// let headers: Headers = [
///     ("x-retry-reason", "crash-loop"),
///     ("x-retry-origin-queue", "comments"),
/// ].into_iter().collect();
/// let record = ParkedRecord::decode(&headers);
/// assert_eq!(record.reason, Some(DeadLetterReason::CrashLoop));
/// assert_eq!(record.origin_queue, Some("comments"));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParkedRecord<'a> {
    /// Why it was parked.
    pub reason: Option<DeadLetterReason>,
    /// Handler runs that failed before it was parked (`x-retry-attempts`).
    pub attempts: u32,
    /// Consumers it took down (`x-retry-crashes`).
    pub crashes: u32,
    /// When its first run failed (`x-retry-first-failure`).
    pub first_failure: Option<Timestamp>,
    /// When its latest run failed or it last crashed its consumer (`x-retry-last-failure`).
    pub last_failure: Option<Timestamp>,
    /// The latest cause.
    pub last_error: Option<&'a str>,
    /// The queue it was consumed from.
    pub origin_queue: Option<&'a str>,
    /// The exchange it was first published to.
    pub origin_exchange: Option<&'a str>,
    /// The routing key it was first published with.
    pub origin_routing_key: Option<&'a str>,
    /// The delay of the copy, for delayed copies.
    pub delay: Option<Duration>,
    /// Times it was replayed from a parking queue (`x-retry-replays`).
    pub replays: u32,
    /// When it was last replayed (`x-retry-replayed-at`).
    pub replayed_at: Option<Timestamp>,
    /// Why it had been parked before its latest replay (`x-retry-previous-reason`).
    pub previous_reason: Option<&'a str>,
    /// The last error it had been parked with before its latest replay
    /// (`x-retry-previous-error`).
    pub previous_error: Option<&'a str>,
    /// Headers that were present but unusable.
    pub malformed: Malformed,
}

impl<'a> ParkedRecord<'a> {
    /// Reads the record; malformed values are read as absent and listed in `malformed`.
    pub fn decode(headers: &'a Headers) -> Self {
        let mut malformed = Malformed::default();
        let reason = string(headers, headers::REASON, &mut malformed).and_then(|s| {
            let r = DeadLetterReason::parse(s);
            if r.is_none() {
                malformed.mark(headers::REASON);
            }
            r
        });
        let first_failure = time(headers, headers::FIRST_FAILURE, &mut malformed);
        let origin_queue = string(headers, headers::ORIGIN_QUEUE, &mut malformed);
        // Headers that hold their default are left out of clones (`EngineHeaders::write_into`,
        // `headers::clone_headers`): an absent last failure is the first, an absent origin
        // exchange the default exchange, an absent origin routing key the queue's name.
        ParkedRecord {
            reason,
            attempts: counter(headers, headers::ATTEMPTS, &mut malformed).unwrap_or(0),
            crashes: counter(headers, headers::CRASHES, &mut malformed).unwrap_or(0),
            first_failure,
            last_failure: time(headers, headers::LAST_FAILURE, &mut malformed).or(first_failure),
            last_error: string(headers, headers::LAST_ERROR, &mut malformed),
            origin_queue,
            origin_exchange: string(headers, headers::ORIGIN_EXCHANGE, &mut malformed)
                .or(origin_queue.map(|_| "")),
            origin_routing_key: string(headers, headers::ORIGIN_ROUTING_KEY, &mut malformed)
                .or(origin_queue),
            delay: time(headers, headers::DELAY, &mut malformed)
                .map(|t| Duration::from_millis(t.as_millis())),
            replays: counter(headers, headers::REPLAYS, &mut malformed).unwrap_or(0),
            replayed_at: time(headers, headers::REPLAYED_AT, &mut malformed),
            previous_reason: string(headers, headers::PREVIOUS_REASON, &mut malformed),
            previous_error: string(headers, headers::PREVIOUS_ERROR, &mut malformed),
            malformed,
        }
    }
}

/// A non-negative integer no larger than `max`.
fn integer(value: &HeaderValue, max: u64) -> Option<u64> {
    value.as_u64().filter(|n| *n <= max)
}

fn counter(headers: &Headers, name: &str, malformed: &mut Malformed) -> Option<u32> {
    let value = headers.get(name)?;
    match integer(value, MAX_COUNTER) {
        Some(n) => u32::try_from(n).ok(),
        None => {
            malformed.mark(name);
            None
        }
    }
}

fn time(headers: &Headers, name: &str, malformed: &mut Malformed) -> Option<Timestamp> {
    let value = headers.get(name)?;
    let ms = match value {
        HeaderValue::Timestamp(t) if t.as_millis() <= MAX_MILLIS => Some(t.as_millis()),
        other => integer(other, MAX_MILLIS),
    };
    if ms.is_none() {
        malformed.mark(name);
    }
    ms.map(Timestamp::from_millis)
}

fn string<'a>(headers: &'a Headers, name: &str, malformed: &mut Malformed) -> Option<&'a str> {
    match headers.get(name)? {
        HeaderValue::Str(s) => Some(s),
        _ => {
            malformed.mark(name);
            None
        }
    }
}

/// The sum of the `count` fields of `x-death`, an array of tables. Any malformed part makes
/// the whole header read as absent.
fn x_death_count(headers: &Headers, malformed: &mut Malformed) -> u32 {
    let Some(value) = headers.get("x-death") else {
        return 0;
    };
    let sum = match value {
        HeaderValue::Array(entries) => entries.iter().try_fold(0u64, |sum, entry| {
            let HeaderValue::Table(t) = entry else {
                return None;
            };
            let n = integer(t.get("count")?, MAX_COUNTER)?;
            Some(sum.saturating_add(n))
        }),
        _ => None,
    };
    match sum {
        Some(n) => u32::try_from(n.min(MAX_COUNTER)).unwrap_or(u32::MAX),
        None => {
            malformed.mark("x-death");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suspect_token_the_engine_could_not_have_written_is_malformed() {
        let read = |value: HeaderValue| {
            let headers: Headers = [(headers::SUSPECT, value)].into_iter().collect();
            DeliveryFacts::decode(&headers, BrokerSignals::default(), 9)
        };
        assert_eq!(
            read(HeaderValue::Int(i64::MAX)).suspect,
            Some(i64::MAX as u64)
        );
        // Found by the `engine_headers` fuzz target: read as a token, it was written back
        // as a negative number, which reads as no token at all.
        let too_large = read(HeaderValue::UInt(u64::MAX));
        assert_eq!(too_large.suspect, None);
        assert_eq!(
            too_large.malformed.names().collect::<Vec<_>>(),
            [headers::SUSPECT]
        );
        assert_eq!(
            too_large.excuse_key(),
            9,
            "the copy falls back on its identity"
        );
    }
}
