//! What the fuzz targets in `fuzz/` run, and what the corpus replay tests run on stable:
//! not an API. Each function takes arbitrary bytes and panics only on a broken invariant.

use crate::headers::{self, EngineHeaders, HeaderValue, Headers, MAX_DEPTH};
use crate::{
    BrokerSignals, DeliveryFacts, Message, MessageParts, ParkedFilter, ParkedReason, ParkedRecord,
    Timestamp, error_fingerprint, parked_at, replay_headers,
};

/// Reads bytes as a program that builds headers: what a transport could hand the engine.
struct Builder<'a> {
    data: &'a [u8],
}

/// Header names the builder draws from: the engine's own, the broker's, and one of the
/// user's; any other name is taken from the bytes.
const NAMES: [&str; 14] = [
    headers::ATTEMPTS,
    headers::CRASHES,
    headers::FIRST_FAILURE,
    headers::LAST_FAILURE,
    headers::LAST_ERROR,
    headers::REASON,
    headers::DELAY,
    headers::SUSPECT,
    headers::REPLAYS,
    headers::REPLAYED_AT,
    "x-death",
    "x-delivery-count",
    "count",
    "time",
];

impl Builder<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.data.split_first()?;
        self.data = rest;
        Some(b)
    }

    fn bytes(&mut self) -> &[u8] {
        let n = usize::from(self.byte().unwrap_or(0) % 32).min(self.data.len());
        let (taken, rest) = self.data.split_at(n);
        self.data = rest;
        taken
    }

    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |n, _| (n << 8) | u64::from(self.byte().unwrap_or(0)))
    }

    fn text(&mut self) -> String {
        String::from_utf8_lossy(self.bytes()).into_owned()
    }

    fn name(&mut self) -> String {
        match self.byte() {
            Some(b) if usize::from(b) < NAMES.len() * 12 => {
                NAMES[usize::from(b) % NAMES.len()].into()
            }
            _ => self.text(),
        }
    }

    fn value(&mut self, depth: usize) -> HeaderValue {
        let kind = self.byte().unwrap_or(0) % 11;
        match kind {
            0 => HeaderValue::Null,
            1 => HeaderValue::Bool(self.byte().unwrap_or(0) & 1 == 1),
            2 => HeaderValue::Int(self.u64() as i64),
            3 => HeaderValue::UInt(self.u64()),
            4 => HeaderValue::Float(f64::from_bits(self.u64())),
            5 => HeaderValue::Str(self.text()),
            6 => HeaderValue::Bytes(self.bytes().to_vec()),
            7 => HeaderValue::Timestamp(Timestamp::from_millis(self.u64())),
            8 if depth < MAX_DEPTH => {
                let n = self.byte().unwrap_or(0) % 4;
                HeaderValue::Array((0..n).map(|_| self.value(depth + 1)).collect())
            }
            9 if depth < MAX_DEPTH => HeaderValue::Table(self.table(depth + 1)),
            _ => HeaderValue::Str(self.u64().to_string()),
        }
    }

    fn table(&mut self, depth: usize) -> Headers {
        let n = self.byte().unwrap_or(0) % 8;
        let mut table = Headers::new();
        for _ in 0..n {
            let name = self.name();
            let value = self.value(depth);
            table.insert(name, value);
        }
        table
    }
}

/// Headers built from `data`, nested at most [`MAX_DEPTH`] deep, as a transport hands
/// them over.
pub fn headers(data: &[u8]) -> Headers {
    Builder { data }.table(0)
}

/// The engine's header codec: whatever headers a delivery carries, the facts and the
/// parked record are read without a panic, and what the engine writes back from them
/// reads back the same.
pub fn engine_headers(data: &[u8]) {
    let mut original = headers(data);
    let facts = DeliveryFacts::decode(&original, BrokerSignals::default(), 0);
    let record = ParkedRecord::decode(&original);
    let _ = (ParkedReason::of(&original), parked_at(&original));
    let _ = replay_headers(&original, Timestamp::from_millis(1));
    for (_, value) in original.iter() {
        if let Some(text) = value.as_str() {
            let _ = error_fingerprint(Some(text));
        }
    }
    let message = Message::new(MessageParts {
        headers: original.clone(),
        ..MessageParts::default()
    });
    let filter = ParkedFilter::all()
        .with_error_group("order <n> not found")
        .with_error_containing("x")
        .parked_after(Timestamp::from_millis(1));
    let _ = filter.matches(&message);
    let update = EngineHeaders {
        attempts: facts.attempts,
        crashes: facts.crashes,
        first_failure: facts.first_failure,
        last_failure: facts.last_failure,
        last_error: record.last_error.map(str::to_owned),
        reason: record.reason,
        delay: None,
        suspect: facts.suspect,
    };
    update.write_into(&mut original);
    let again = DeliveryFacts::decode(&original, BrokerSignals::default(), 0);
    assert_eq!(
        (again.attempts, again.crashes, again.suspect),
        (facts.attempts, facts.crashes, facts.suspect),
        "counters written back read back"
    );
    if facts.first_failure.is_some() {
        assert_eq!(again.first_failure, facts.first_failure);
        assert_eq!(again.last_failure, facts.last_failure);
    }
    let written = ParkedRecord::decode(&original);
    assert_eq!(written.reason, update.reason);
    assert_eq!(written.last_error, update.last_error.as_deref());
}
