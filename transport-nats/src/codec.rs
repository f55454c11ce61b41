//! Messages to and from NATS: typed header values as header text, and the AMQP-style
//! properties as headers of their own.
//!
//! NATS headers are text (no CR or LF), the engine's are typed. A string that needs no
//! escaping travels as it is, so other NATS clients read a user's headers unchanged;
//! everything else is written with a type tag after a `~`: `~i:3` (integer), `~u:` (unsigned),
//! `~f:` (float), `~b:` (boolean), `~n` (null), `~t:` (timestamp, ms since the epoch), `~x:`
//! (bytes, hex), `~s:` (a string as a JSON string: one with control characters, surrounding
//! spaces or a leading `~`) and `~j:` (arrays and tables, as tagged JSON). Reading never
//! fails: a value that does not decode is kept as the string it is.

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue as NatsValue};
use retry_core::{HeaderValue, Headers, Properties, Timestamp, TransportError};
use serde_json::{Value, json};

/// The header the server deduplicates on.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// How every `Nats-Msg-Id` the transport writes (on a clone, on a moved clone) begins: such
/// an id names a copy, not the message, and is never read as its message id.
pub const COPY_ID_PREFIX: &str = "retry-engine:";

/// The `Nats-Msg-Id` of a copy of the message stored at `stream`#`sequence` (at `stored_ns`)
/// going to `to`: the same for every attempt to publish that copy.
pub fn copy_id(stream: &str, sequence: u64, stored_ns: i128, to: &str) -> String {
    format!("{COPY_ID_PREFIX}{stream}:{sequence}:{stored_ns}:{to}")
}
/// On a message the transport parked because async-nats cannot read its header block: why,
/// naming the line, byte and header at fault (a string).
///
/// ```
/// use retry_core::Headers;
/// use transport_nats::UNDECODABLE_HEADER;
///
/// fn why_parked(headers: &Headers) -> Option<&str> {
///     headers.get(UNDECODABLE_HEADER).and_then(|why| why.as_str())
/// }
/// assert_eq!(why_parked(&Headers::new()), None);
/// ```
pub const UNDECODABLE_HEADER: &str = "x-nats-undecodable";
/// On a message parked with [`UNDECODABLE_HEADER`]: its header block as it was stored, byte
/// for byte (bytes: `~x:` and hex on the wire, [`HeaderValue::Bytes`] once read).
///
/// ```
/// use retry_core::{HeaderValue, Headers};
/// use transport_nats::HEADER_BLOCK_HEADER;
///
/// fn original_block(headers: &Headers) -> Option<&[u8]> {
///     match headers.get(HEADER_BLOCK_HEADER) {
///         Some(HeaderValue::Bytes(bytes)) => Some(bytes),
///         _ => None,
///     }
/// }
/// assert_eq!(original_block(&Headers::new()), None);
/// ```
pub const HEADER_BLOCK_HEADER: &str = "x-nats-header-block";
/// On a message parked with [`UNDECODABLE_HEADER`] whose header block was too long to keep
/// whole beside its payload in one message (the block kept as hex takes twice its length):
/// the block's length in bytes (unsigned); [`HEADER_BLOCK_HEADER`] then holds its beginning.
///
/// ```
/// use retry_core::Headers;
/// use transport_nats::HEADER_BLOCK_LENGTH_HEADER;
///
/// fn cut(headers: &Headers) -> bool {
///     headers.get(HEADER_BLOCK_LENGTH_HEADER).is_some()
/// }
/// assert!(!cut(&Headers::new()));
/// ```
pub const HEADER_BLOCK_LENGTH_HEADER: &str = "x-nats-header-block-length";
/// When a clone in a delay stream is due, in ms since the epoch.
pub const DUE: &str = "x-retry-nats-due";

/// Property headers: (header name, what it holds).
const CONTENT_TYPE: &str = "content-type";
const CONTENT_ENCODING: &str = "content-encoding";
const MESSAGE_ID: &str = "message-id";
const CORRELATION_ID: &str = "correlation-id";
const REPLY_TO: &str = "reply-to";
const TIMESTAMP: &str = "timestamp";
const PRIORITY: &str = "priority";
const TYPE: &str = "type";
const APP_ID: &str = "app-id";

const PROPERTY_HEADERS: [&str; 9] = [
    CONTENT_TYPE,
    CONTENT_ENCODING,
    MESSAGE_ID,
    CORRELATION_ID,
    REPLY_TO,
    TIMESTAMP,
    PRIORITY,
    TYPE,
    APP_ID,
];

/// Whether a header is the server's or the transport's, not a user's.
fn reserved(name: &str) -> bool {
    name.starts_with("Nats-") || name == DUE || PROPERTY_HEADERS.contains(&name)
}

/// `value` as header text.
pub fn encode_value(value: &HeaderValue) -> String {
    match value {
        HeaderValue::Str(s) if plain(s) => s.clone(),
        HeaderValue::Str(s) => format!("~s:{}", Value::String(s.clone())),
        HeaderValue::Int(n) => format!("~i:{n}"),
        HeaderValue::UInt(n) => format!("~u:{n}"),
        HeaderValue::Float(x) => format!("~f:{x:?}"),
        HeaderValue::Bool(b) => format!("~b:{b}"),
        HeaderValue::Null => "~n".to_owned(),
        HeaderValue::Timestamp(t) => format!("~t:{}", t.as_millis()),
        HeaderValue::Bytes(b) => format!("~x:{}", hex(b)),
        other => format!("~j:{}", to_json(other)),
    }
}

/// Header text as a value; text that does not decode is the string it is.
pub fn decode_value(text: &str) -> HeaderValue {
    let Some(tagged) = text.strip_prefix('~') else {
        return HeaderValue::Str(text.to_owned());
    };
    let decoded = match tagged.split_once(':') {
        None if tagged == "n" => Some(HeaderValue::Null),
        Some(("s", s)) => serde_json::from_str::<String>(s).ok().map(HeaderValue::Str),
        Some(("i", n)) => n.parse().ok().map(HeaderValue::Int),
        Some(("u", n)) => n.parse().ok().map(HeaderValue::UInt),
        Some(("f", x)) => x.parse().ok().map(HeaderValue::Float),
        Some(("b", b)) => b.parse().ok().map(HeaderValue::Bool),
        Some(("t", ms)) => ms
            .parse()
            .ok()
            .map(|ms| HeaderValue::Timestamp(Timestamp::from_millis(ms))),
        Some(("x", h)) => unhex(h).map(HeaderValue::Bytes),
        Some(("j", j)) => serde_json::from_str::<Value>(j)
            .ok()
            .and_then(|v| from_json(&v, 0)),
        _ => None,
    };
    decoded.unwrap_or_else(|| HeaderValue::Str(text.to_owned()))
}

fn plain(s: &str) -> bool {
    !s.starts_with('~') && s.trim() == s && !s.chars().any(char::is_control)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn to_json(value: &HeaderValue) -> Value {
    match value {
        HeaderValue::Null => json!({ "n": null }),
        HeaderValue::Bool(b) => json!({ "b": b }),
        HeaderValue::Int(n) => json!({ "i": n }),
        HeaderValue::UInt(n) => json!({ "u": n }),
        HeaderValue::Float(x) => json!({ "f": x.to_string() }),
        HeaderValue::Str(s) => json!({ "s": s }),
        HeaderValue::Bytes(b) => json!({ "x": hex(b) }),
        HeaderValue::Timestamp(t) => json!({ "t": t.as_millis() }),
        HeaderValue::Array(items) => json!({ "a": items.iter().map(to_json).collect::<Vec<_>>() }),
        HeaderValue::Table(table) => json!({
            "m": table.iter().map(|(k, v)| json!([k, to_json(v)])).collect::<Vec<_>>()
        }),
    }
}

fn from_json(value: &Value, depth: usize) -> Option<HeaderValue> {
    if depth > retry_core::headers::MAX_DEPTH {
        return None;
    }
    let object = value.as_object()?;
    let (tag, inner) = object.iter().next()?;
    Some(match tag.as_str() {
        "n" => HeaderValue::Null,
        "b" => HeaderValue::Bool(inner.as_bool()?),
        "i" => HeaderValue::Int(inner.as_i64()?),
        "u" => HeaderValue::UInt(inner.as_u64()?),
        "f" => HeaderValue::Float(inner.as_str()?.parse().ok()?),
        "s" => HeaderValue::Str(inner.as_str()?.to_owned()),
        "x" => HeaderValue::Bytes(unhex(inner.as_str()?)?),
        "t" => HeaderValue::Timestamp(Timestamp::from_millis(inner.as_u64()?)),
        "a" => HeaderValue::Array(
            inner
                .as_array()?
                .iter()
                .map(|v| from_json(v, depth + 1))
                .collect::<Option<_>>()?,
        ),
        "m" => {
            let mut table = Headers::new();
            for pair in inner.as_array()? {
                let pair = pair.as_array()?;
                let key = pair.first()?.as_str()?;
                table.insert(key, from_json(pair.get(1)?, depth + 1)?);
            }
            HeaderValue::Table(table)
        }
        _ => return None,
    })
}

/// What a NATS message's headers say: its properties and its (user's and engine's) headers.
pub fn read_headers(map: Option<&HeaderMap>) -> (Properties, Headers) {
    let mut properties = Properties {
        persistent: true,
        ..Properties::default()
    };
    let mut headers = Headers::new();
    let Some(map) = map else {
        return (properties, headers);
    };
    let mut names: Vec<(&HeaderName, &Vec<NatsValue>)> = map.iter().collect();
    // A hash map's order is arbitrary: sort, so a message reads the same every time.
    names.sort_by(|a, b| AsRef::<str>::as_ref(a.0).cmp(b.0.as_ref()));
    let text = |name: &str| {
        map.get(name).map(|v| match decode_value(v.as_str()) {
            HeaderValue::Str(s) => s,
            _ => v.as_str().to_owned(),
        })
    };
    properties.content_type = text(CONTENT_TYPE);
    properties.content_encoding = text(CONTENT_ENCODING);
    // A NATS application's own `Nats-Msg-Id` is the message's id; one of this transport's
    // copies is not.
    properties.message_id =
        text(MESSAGE_ID).or_else(|| text(MSG_ID).filter(|id| !id.starts_with(COPY_ID_PREFIX)));
    properties.correlation_id = text(CORRELATION_ID);
    properties.reply_to = text(REPLY_TO);
    properties.timestamp = text(TIMESTAMP)
        .and_then(|t| t.parse().ok())
        .map(Timestamp::from_millis);
    properties.priority = text(PRIORITY).and_then(|p| p.parse().ok());
    properties.kind = text(TYPE);
    properties.app_id = text(APP_ID);
    for (name, values) in names {
        let name: &str = name.as_ref();
        if reserved(name) {
            continue;
        }
        if let Some(last) = values.last() {
            headers.insert(name, decode_value(last.as_str()));
        }
    }
    (properties, headers)
}

/// `properties` and `headers` as a NATS header map; a header name NATS cannot carry (a
/// `:`, whitespace or a control character in it) is an error that names it.
pub fn write_headers(
    properties: &Properties,
    headers: &Headers,
) -> Result<HeaderMap, TransportError> {
    let mut map = HeaderMap::new();
    let mut put = |name: &str, value: String| -> Result<(), TransportError> {
        let name: HeaderName = name.parse().map_err(|_| TransportError::Unsupported {
            what: format!("the header name {name:?} on NATS"),
            why: "a NATS header name cannot hold `:`, whitespace or control characters".into(),
        })?;
        let value: NatsValue = value.parse().map_err(|_| TransportError::Unsupported {
            what: format!("a value of the header {name}"),
            why: "it could not be written without a line break".into(),
        })?;
        map.insert(name, value);
        Ok(())
    };
    let escaped = |s: &str| encode_value(&HeaderValue::Str(s.to_owned()));
    let p = properties;
    for (name, value) in [
        (CONTENT_TYPE, &p.content_type),
        (CONTENT_ENCODING, &p.content_encoding),
        (MESSAGE_ID, &p.message_id),
        (CORRELATION_ID, &p.correlation_id),
        (REPLY_TO, &p.reply_to),
        (TYPE, &p.kind),
        (APP_ID, &p.app_id),
    ] {
        if let Some(v) = value {
            put(name, escaped(v))?;
        }
    }
    if let Some(t) = p.timestamp {
        put(TIMESTAMP, t.as_millis().to_string())?;
    }
    if let Some(priority) = p.priority {
        put(PRIORITY, priority.to_string())?;
    }
    for (name, value) in headers.iter() {
        if reserved(name) {
            continue;
        }
        put(name, encode_value(value))?;
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(value: HeaderValue) {
        let text = encode_value(&value);
        assert!(!text.contains(['\r', '\n']), "{text}");
        assert_eq!(decode_value(&text), value, "{text}");
    }

    #[test]
    fn every_value_type_round_trips() {
        round_trip(HeaderValue::from("acme"));
        round_trip(HeaderValue::from("~looks tagged"));
        round_trip(HeaderValue::from("two\r\nlines"));
        round_trip(HeaderValue::from(" padded "));
        round_trip(HeaderValue::Int(-3));
        round_trip(HeaderValue::UInt(u64::MAX));
        round_trip(HeaderValue::Float(1.5));
        round_trip(HeaderValue::Bool(true));
        round_trip(HeaderValue::Null);
        round_trip(HeaderValue::Timestamp(Timestamp::from_millis(
            1_700_000_000_000,
        )));
        round_trip(HeaderValue::Bytes(vec![0, 255, 10]));
        let mut table = Headers::new();
        table.insert("queue", "comments");
        table.insert("count", 2i64);
        round_trip(HeaderValue::Array(vec![
            HeaderValue::Table(table),
            HeaderValue::Null,
        ]));
    }

    #[test]
    fn hostile_text_reads_as_a_string_and_never_panics() {
        for text in [
            "~",
            "~i:",
            "~i:x",
            "~x:abc",
            "~x:zz",
            "~j:{",
            "~j:[]",
            "~q:1",
            "~s:\"",
            "~j:{\"a\":[{\"a\":[]}]}",
        ] {
            let _ = decode_value(text);
        }
        assert_eq!(decode_value("~i:x"), HeaderValue::from("~i:x"));
        let deep = format!("~j:{}{}", "{\"a\":[".repeat(100), "]}".repeat(100));
        assert_eq!(decode_value(&deep), HeaderValue::from(deep.as_str()));
    }

    #[test]
    fn properties_and_headers_round_trip_through_a_header_map() {
        let properties = Properties {
            content_type: Some("application/json".into()),
            message_id: Some("order-7".into()),
            correlation_id: Some("c\nr".into()),
            timestamp: Some(Timestamp::from_millis(42)),
            priority: Some(5),
            persistent: true,
            ..Properties::default()
        };
        let mut headers = Headers::new();
        headers.insert("tenant", "acme");
        headers.insert("x-retry-attempts", 2i64);
        let map = write_headers(&properties, &headers).expect("writable");
        let (p, h) = read_headers(Some(&map));
        assert_eq!(h, headers);
        assert_eq!(p.message_id.as_deref(), Some("order-7"));
        assert_eq!(p.correlation_id.as_deref(), Some("c\nr"));
        assert_eq!(p.timestamp, Some(Timestamp::from_millis(42)));
        assert_eq!(p.priority, Some(5));
    }

    #[test]
    fn nats_msg_id_is_the_message_id_when_there_is_no_other() {
        let mut map = HeaderMap::new();
        map.insert(MSG_ID, "from-a-nats-app");
        let (p, h) = read_headers(Some(&map));
        assert_eq!(p.message_id.as_deref(), Some("from-a-nats-app"));
        assert!(h.is_empty());
    }

    #[test]
    fn a_copy_id_is_never_the_message_id() {
        let mut map = HeaderMap::new();
        map.insert(MSG_ID, copy_id("orders", 7, 1, "orders.retry.30s").as_str());
        let (p, _) = read_headers(Some(&map));
        assert_eq!(
            p.message_id, None,
            "identity then comes from the body, as elsewhere"
        );
    }

    #[test]
    fn an_unwritable_header_name_is_named() {
        let mut headers = Headers::new();
        headers.insert("bad name", "x");
        let err = write_headers(&Properties::default(), &headers).unwrap_err();
        assert!(err.to_string().contains("bad name"), "{err}");
    }
}
