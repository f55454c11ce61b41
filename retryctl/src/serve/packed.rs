//! A parked message's properties and headers packed into one allocation for the index: the
//! engine's header names as one byte each, numbers as varints, strings as their bytes.
//! Unpacked only for the message page and the API's message answer.
//!
//! Held as `Headers` and `Properties` (a header's name and value are 56 bytes before their
//! text, the properties 170 before theirs), an engine-parked message with a 22-byte body took
//! about 690 bytes of the index; packed, about 280.

use retry_core::headers::{
    ATTEMPTS, CRASHES, DELAY, FIRST_FAILURE, LAST_ERROR, LAST_FAILURE, ORIGIN_EXCHANGE,
    ORIGIN_QUEUE, ORIGIN_ROUTING_KEY, PREVIOUS_ERROR, PREVIOUS_REASON, REASON, REPLAYED_AT,
    REPLAYS, SUSPECT,
};
use retry_core::{HeaderValue, Headers, Properties, Timestamp};

/// Header names written as one byte: their index here, plus one (0 is a name spelled out).
const NAMES: [&str; 23] = [
    REASON,
    ATTEMPTS,
    CRASHES,
    FIRST_FAILURE,
    LAST_FAILURE,
    LAST_ERROR,
    ORIGIN_QUEUE,
    ORIGIN_EXCHANGE,
    ORIGIN_ROUTING_KEY,
    REPLAYS,
    REPLAYED_AT,
    PREVIOUS_REASON,
    PREVIOUS_ERROR,
    DELAY,
    SUSPECT,
    "x-death",
    "count",
    "exchange",
    "queue",
    "reason",
    "routing-keys",
    "time",
    "x-delivery-count",
];

/// Packs `properties` and `headers`.
pub fn pack(properties: &Properties, headers: &Headers) -> Box<[u8]> {
    let mut out = Vec::with_capacity(64);
    let p = properties;
    for text in [
        &p.content_type,
        &p.content_encoding,
        &p.message_id,
        &p.correlation_id,
        &p.reply_to,
        &p.kind,
        &p.app_id,
    ] {
        match text {
            Some(s) => {
                out.push(1);
                bytes(&mut out, s.as_bytes());
            }
            None => out.push(0),
        }
    }
    match p.timestamp {
        Some(t) => {
            out.push(1);
            varint(&mut out, t.as_millis());
        }
        None => out.push(0),
    }
    match p.priority {
        Some(n) => out.extend([1, n]),
        None => out.push(0),
    }
    out.push(u8::from(p.persistent));
    table(&mut out, headers);
    out.into_boxed_slice()
}

fn varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn table(out: &mut Vec<u8>, headers: &Headers) {
    varint(out, headers.len() as u64);
    for (name, value) in headers.iter() {
        match NAMES.iter().position(|n| *n == name) {
            Some(i) => out.push(i as u8 + 1),
            None => {
                out.push(0);
                bytes(out, name.as_bytes());
            }
        }
        self::value(out, value);
    }
}

fn value(out: &mut Vec<u8>, v: &HeaderValue) {
    match v {
        HeaderValue::Null => out.push(0),
        HeaderValue::Bool(b) => out.push(1 + u8::from(*b)),
        HeaderValue::Int(n) => {
            out.push(3);
            // Zigzag: small negative numbers stay short.
            varint(out, ((n << 1) ^ (n >> 63)) as u64);
        }
        HeaderValue::UInt(n) => {
            out.push(4);
            varint(out, *n);
        }
        HeaderValue::Float(x) => {
            out.push(5);
            out.extend(x.to_le_bytes());
        }
        HeaderValue::Str(s) => {
            out.push(6);
            bytes(out, s.as_bytes());
        }
        HeaderValue::Bytes(b) => {
            out.push(7);
            bytes(out, b);
        }
        HeaderValue::Timestamp(t) => {
            out.push(8);
            varint(out, t.as_millis());
        }
        HeaderValue::Array(items) => {
            out.push(9);
            varint(out, items.len() as u64);
            for item in items {
                value(out, item);
            }
        }
        HeaderValue::Table(t) => {
            out.push(10);
            table(out, t);
        }
    }
}

/// Reads back what [`pack`] wrote; `None` only if the bytes are not its.
pub fn unpack(packed: &[u8]) -> Option<(Properties, Headers)> {
    let mut r = Reader(packed);
    let mut texts: [Option<String>; 7] = Default::default();
    for slot in &mut texts {
        if r.byte()? == 1 {
            *slot = Some(r.string()?);
        }
    }
    let [
        content_type,
        content_encoding,
        message_id,
        correlation_id,
        reply_to,
        kind,
        app_id,
    ] = texts;
    let timestamp = match r.byte()? {
        1 => Some(Timestamp::from_millis(r.varint()?)),
        _ => None,
    };
    let priority = match r.byte()? {
        1 => Some(r.byte()?),
        _ => None,
    };
    let persistent = r.byte()? == 1;
    let headers = r.table()?;
    r.0.is_empty().then_some((
        Properties {
            content_type,
            content_encoding,
            message_id,
            correlation_id,
            reply_to,
            timestamp,
            priority,
            kind,
            app_id,
            persistent,
        },
        headers,
    ))
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut n = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            n |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Some(n);
            }
        }
        None
    }

    fn take(&mut self) -> Option<&[u8]> {
        let len = usize::try_from(self.varint()?).ok()?;
        if len > self.0.len() {
            return None;
        }
        let (b, rest) = self.0.split_at(len);
        self.0 = rest;
        Some(b)
    }

    fn string(&mut self) -> Option<String> {
        String::from_utf8(self.take()?.to_vec()).ok()
    }

    fn table(&mut self) -> Option<Headers> {
        let n = self.varint()?;
        let mut entries = Vec::new();
        for _ in 0..n {
            let name = match self.byte()? {
                0 => self.string()?,
                i => (*NAMES.get(usize::from(i) - 1)?).to_owned(),
            };
            entries.push((name, self.value()?));
        }
        Some(entries.into_iter().collect())
    }

    fn value(&mut self) -> Option<HeaderValue> {
        Some(match self.byte()? {
            0 => HeaderValue::Null,
            1 => HeaderValue::Bool(false),
            2 => HeaderValue::Bool(true),
            3 => {
                let z = self.varint()?;
                HeaderValue::Int(((z >> 1) as i64) ^ -((z & 1) as i64))
            }
            4 => HeaderValue::UInt(self.varint()?),
            5 => {
                let (b, rest) = self.0.split_first_chunk::<8>()?;
                self.0 = rest;
                HeaderValue::Float(f64::from_le_bytes(*b))
            }
            6 => HeaderValue::Str(self.string()?),
            7 => HeaderValue::Bytes(self.take()?.to_vec()),
            8 => HeaderValue::Timestamp(Timestamp::from_millis(self.varint()?)),
            9 => {
                let n = self.varint()?;
                let mut items = Vec::new();
                for _ in 0..n {
                    items.push(self.value()?);
                }
                HeaderValue::Array(items)
            }
            10 => HeaderValue::Table(self.table()?),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_packed_unpacks_the_same() {
        let death: Headers = [
            ("count", HeaderValue::Int(2)),
            ("queue", HeaderValue::from("comments")),
            (
                "time",
                HeaderValue::Timestamp(Timestamp::from_millis(1_700_000_000_000)),
            ),
            (
                "routing-keys",
                HeaderValue::Array(vec![HeaderValue::from("comments")]),
            ),
        ]
        .into_iter()
        .collect();
        let headers: Headers = [
            (REASON, HeaderValue::from("permanent")),
            (ATTEMPTS, HeaderValue::Int(3)),
            ("negative", HeaderValue::Int(i64::MIN)),
            ("big", HeaderValue::UInt(u64::MAX)),
            ("ratio", HeaderValue::Float(-0.25)),
            ("flag", HeaderValue::Bool(true)),
            ("nothing", HeaderValue::Null),
            ("raw", HeaderValue::Bytes(vec![0, 255, 7])),
            ("é-name", HeaderValue::from("<script>")),
            (
                "x-death",
                HeaderValue::Array(vec![HeaderValue::Table(death)]),
            ),
        ]
        .into_iter()
        .collect();
        let properties = Properties {
            content_type: Some("application/json".into()),
            message_id: Some("m-1".into()),
            reply_to: Some(String::new()),
            timestamp: Some(Timestamp::from_millis(42)),
            priority: Some(9),
            persistent: true,
            ..Properties::default()
        };
        let packed = pack(&properties, &headers);
        assert_eq!(unpack(&packed), Some((properties.clone(), headers.clone())));
        let empty = pack(&Properties::default(), &Headers::new());
        assert_eq!(
            unpack(&empty),
            Some((Properties::default(), Headers::new()))
        );
        // Bytes that are not a packing are refused, not a panic.
        for cut in 0..packed.len() {
            assert_eq!(unpack(&packed[..cut]), None, "{cut}");
        }
        assert_eq!(unpack(&[0xff; 40]), None);
    }
}
