//! Header values as JSON, for `--json` output.

use retry_core::HeaderValue;
use serde_json::{Value, json};

/// A header value as JSON. Bytes that are not text are written in hex, as
/// `{"bytes": "00ff"}`; an AMQP timestamp as its milliseconds since the Unix epoch.
pub fn header_json(value: &HeaderValue) -> Value {
    match value {
        HeaderValue::Null => Value::Null,
        HeaderValue::Bool(b) => json!(b),
        HeaderValue::Int(n) => json!(n),
        HeaderValue::UInt(n) => json!(n),
        HeaderValue::Float(x) => json!(x),
        HeaderValue::Str(s) => json!(s),
        HeaderValue::Bytes(b) => json!({ "bytes": hex(b) }),
        HeaderValue::Timestamp(t) => json!(t.as_millis()),
        HeaderValue::Array(items) => Value::Array(items.iter().map(header_json).collect()),
        HeaderValue::Table(table) => Value::Object(
            table
                .iter()
                .map(|(k, v)| (k.to_owned(), header_json(v)))
                .collect(),
        ),
    }
}

/// Bytes as lowercase hex digits.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}
