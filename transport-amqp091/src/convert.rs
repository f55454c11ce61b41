//! Conversions between lapin's AMQP 0-9-1 types and retry-core's neutral ones.
//!
//! Integers of every width read as 64-bit, floats as doubles; decimals are read as their
//! text, and long strings that are not UTF-8 as bytes. Written afresh, they go out as
//! 64-bit integers (`l`), doubles, long strings and byte arrays. A received message whose
//! headers would change type that way keeps its field table ([`NativeParts`]), and a copy
//! of it (a retry's clone, a replay) writes every header it did not change with its
//! original encoding. Nothing here panics on what the broker sends.

use crate::tap::Refusals;
use crate::undecodable::{self, Reading};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use retry_core::headers::{BROKER_OWNED, MAX_DEPTH};
use retry_core::{HeaderValue, Headers, NativeParts, Properties, Timestamp};
use std::time::Duration;
use tracing::warn;
use transport_kit::amqp10::{
    APP_PROPERTIES_HEADER, PROPERTIES_HEADER, SectionError, decode_application_properties,
    decode_message_id, encode_application_properties,
};

/// Set (to `true`) on a message whose headers were read from an AMQP 1.0
/// `application-properties` section: one published over AMQP 1.0, read over AMQP 0-9-1 on
/// RabbitMQ 3.x. A clone or a replayed copy of it is written with its headers in that
/// section too, beside the AMQP 0-9-1 headers, so that an AMQP 1.0 consumer of the queue it
/// goes to sees them: RabbitMQ 3.x does not show AMQP 0-9-1 headers to AMQP 1.0 clients.
pub const FROM_AMQP10: &str = "x-retry-from-amqp10";

/// Reads an AMQP field table. Tables and arrays nested deeper than
/// [`MAX_DEPTH`](retry_core::headers::MAX_DEPTH) are read as [`HeaderValue::Null`], with a
/// warning.
pub fn headers_from_table(table: &FieldTable) -> Headers {
    let mut too_deep = false;
    let headers = table_at(table, 0, &mut too_deep);
    if too_deep {
        warn!(
            max_depth = MAX_DEPTH,
            "header values nested too deeply were read as null"
        );
    }
    headers
}

fn table_at(table: &FieldTable, depth: usize, too_deep: &mut bool) -> Headers {
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), value_at(v, depth, too_deep)))
        .collect()
}

/// Writes an AMQP field table. Keys longer than a short string allows are left out with a
/// warning: the broker could not carry them.
pub fn table_from_headers(headers: &Headers) -> FieldTable {
    table_keeping(headers.iter(), None)
}

/// Writes these headers as a field table, each one that still has the value it was read
/// with from `native` in its encoding there.
fn table_keeping<'h>(
    headers: impl Iterator<Item = (&'h str, &'h HeaderValue)>,
    native: Option<&FieldTable>,
) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        match ShortString::try_new(k) {
            Ok(key) => {
                let kept = native
                    .and_then(|t| t.inner().get(k))
                    .filter(|raw| value_at(raw, 0, &mut false) == *v);
                table.insert(key, kept.cloned().unwrap_or_else(|| value_to_amqp(v)));
            }
            Err(_) => {
                warn!(header = %&k[..k.floor_char_boundary(64)], "header name longer than 255 bytes left out")
            }
        }
    }
    table
}

/// Whether `v` is written back with the type it came with when it is read into a
/// [`HeaderValue`] and written afresh.
fn keeps_its_type(v: &AMQPValue) -> bool {
    match v {
        AMQPValue::Boolean(_)
        | AMQPValue::LongLongInt(_)
        | AMQPValue::Double(_)
        | AMQPValue::ByteArray(_)
        | AMQPValue::Void => true,
        // Read as milliseconds, which saturate past this.
        AMQPValue::Timestamp(secs) => secs.checked_mul(1000).is_some(),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).is_ok(),
        AMQPValue::FieldArray(a) => a.as_slice().iter().all(keeps_its_type),
        AMQPValue::FieldTable(t) => t.inner().values().all(keeps_its_type),
        _ => false,
    }
}

/// What a received message keeps of its field table: the table itself when a header in it
/// would be written back with another type, nothing otherwise.
fn native_of(table: Option<&FieldTable>) -> NativeParts {
    match table {
        Some(t) if !t.inner().values().all(keeps_its_type) => NativeParts::new(t.clone()),
        _ => NativeParts::default(),
    }
}

fn long_string(s: &LongString) -> HeaderValue {
    match std::str::from_utf8(s.as_bytes()) {
        Ok(text) => HeaderValue::Str(text.to_owned()),
        Err(_) => HeaderValue::Bytes(s.as_bytes().to_vec()),
    }
}

/// Reads `v`, found inside `depth` tables and arrays.
fn value_at(v: &AMQPValue, depth: usize, too_deep: &mut bool) -> HeaderValue {
    let nested = matches!(v, AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_));
    if nested && depth >= MAX_DEPTH {
        *too_deep = true;
        return HeaderValue::Null;
    }
    match v {
        AMQPValue::Boolean(b) => HeaderValue::Bool(*b),
        AMQPValue::ShortShortInt(n) => HeaderValue::Int(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => HeaderValue::Int(i64::from(*n)),
        AMQPValue::ShortInt(n) => HeaderValue::Int(i64::from(*n)),
        AMQPValue::ShortUInt(n) => HeaderValue::Int(i64::from(*n)),
        AMQPValue::LongInt(n) => HeaderValue::Int(i64::from(*n)),
        AMQPValue::LongUInt(n) => HeaderValue::Int(i64::from(*n)),
        AMQPValue::LongLongInt(n) => HeaderValue::Int(*n),
        AMQPValue::Float(f) => HeaderValue::Float(f64::from(*f)),
        AMQPValue::Double(f) => HeaderValue::Float(*f),
        AMQPValue::DecimalValue(d) => HeaderValue::Str(format!("{}e-{}", d.value, d.scale)),
        AMQPValue::ShortString(s) => HeaderValue::Str(s.as_str().to_owned()),
        AMQPValue::LongString(s) => long_string(s),
        AMQPValue::FieldArray(a) => HeaderValue::Array(
            a.as_slice()
                .iter()
                .map(|v| value_at(v, depth + 1, too_deep))
                .collect(),
        ),
        // AMQP 0-9-1 timestamps are seconds.
        AMQPValue::Timestamp(secs) => {
            HeaderValue::Timestamp(Timestamp::from_millis(secs.saturating_mul(1000)))
        }
        AMQPValue::FieldTable(t) => HeaderValue::Table(table_at(t, depth + 1, too_deep)),
        AMQPValue::ByteArray(b) => HeaderValue::Bytes(b.as_slice().to_vec()),
        AMQPValue::Void => HeaderValue::Null,
    }
}

/// Writes one field value.
pub fn value_to_amqp(v: &HeaderValue) -> AMQPValue {
    match v {
        HeaderValue::Null => AMQPValue::Void,
        HeaderValue::Bool(b) => AMQPValue::Boolean(*b),
        HeaderValue::Int(n) => AMQPValue::LongLongInt(*n),
        // 0-9-1 has no unsigned 64-bit type; out-of-range values keep their digits.
        HeaderValue::UInt(n) => match i64::try_from(*n) {
            Ok(n) => AMQPValue::LongLongInt(n),
            Err(_) => AMQPValue::LongString(n.to_string().into()),
        },
        HeaderValue::Float(f) => AMQPValue::Double(*f),
        HeaderValue::Str(s) => AMQPValue::LongString(s.as_str().into()),
        HeaderValue::Bytes(b) => AMQPValue::ByteArray(b.clone().into()),
        HeaderValue::Timestamp(t) => AMQPValue::Timestamp(t.as_millis() / 1000),
        HeaderValue::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(value_to_amqp).collect::<Vec<_>>(),
        )),
        HeaderValue::Table(t) => AMQPValue::FieldTable(table_from_headers(t)),
    }
}

fn text(s: &Option<ShortString>) -> Option<String> {
    s.as_ref().map(|s| s.as_str().to_owned())
}

/// Reads the basic properties a clone carries over.
pub fn properties_from_amqp(p: &BasicProperties) -> Properties {
    Properties {
        content_type: text(p.content_type()),
        content_encoding: text(p.content_encoding()),
        message_id: text(p.message_id()),
        correlation_id: text(p.correlation_id()),
        reply_to: text(p.reply_to()),
        timestamp: p
            .timestamp()
            .map(|secs| Timestamp::from_millis(secs.saturating_mul(1000))),
        priority: *p.priority(),
        kind: text(p.kind()),
        app_id: text(p.app_id()),
        persistent: *p.delivery_mode() == Some(2),
    }
}

fn short(s: &Option<String>) -> Option<ShortString> {
    s.as_ref()
        .and_then(|s| ShortString::try_new(s.as_str()).ok())
}

/// Writes basic properties for a clone: the original's, these headers (those the original
/// came with in their original encoding, from `native`), and a per-message TTL if one is
/// given. Clones are always persistent when the original was.
pub fn properties_to_amqp(
    p: &Properties,
    headers: &Headers,
    native: &NativeParts,
    expiration: Option<Duration>,
) -> BasicProperties {
    let native = native.get::<FieldTable>();
    let mut out = BasicProperties::default().with_headers(headers_to_table(headers, native));
    if let Some(v) = short(&p.content_type) {
        out = out.with_content_type(v);
    }
    if let Some(v) = short(&p.content_encoding) {
        out = out.with_content_encoding(v);
    }
    if let Some(v) = short(&p.message_id) {
        out = out.with_message_id(v);
    }
    if let Some(v) = short(&p.correlation_id) {
        out = out.with_correlation_id(v);
    }
    if let Some(v) = short(&p.reply_to) {
        out = out.with_reply_to(v);
    }
    if let Some(v) = short(&p.kind) {
        out = out.with_type(v);
    }
    if let Some(v) = short(&p.app_id) {
        out = out.with_app_id(v);
    }
    if let Some(t) = p.timestamp {
        out = out.with_timestamp(t.as_millis() / 1000);
    }
    if let Some(n) = p.priority {
        out = out.with_priority(n);
    }
    if p.persistent {
        out = out.with_delivery_mode(2);
    }
    if let Some(ttl) = expiration {
        out = out.with_expiration(ttl.as_millis().to_string().into());
    }
    out
}

/// A message's headers as a field table; for a message read from AMQP 1.0 ([`FROM_AMQP10`]),
/// with its headers also encoded in the `application-properties` section, which RabbitMQ
/// 3.x gives to AMQP 1.0 consumers. The broker's own headers and the AMQP 1.0 sections stay
/// out of it.
fn headers_to_table(headers: &Headers, native: Option<&FieldTable>) -> FieldTable {
    if headers.get(FROM_AMQP10).is_none() {
        return table_keeping(headers.iter(), native);
    }
    let plain = headers.iter().filter(|(name, _)| *name != FROM_AMQP10);
    let mut table = table_keeping(plain, native);
    let entries = headers.iter().filter(|(name, _)| {
        *name != FROM_AMQP10 && !BROKER_OWNED.contains(name) && !name.starts_with("x-amqp-1.0-")
    });
    let (section, left_out) = encode_application_properties(entries);
    if !left_out.is_empty() {
        warn!(
            headers = %left_out.join(", "),
            "arrays and tables cannot be AMQP 1.0 application properties; AMQP 1.0 consumers will not see these headers"
        );
    }
    table.insert(
        APP_PROPERTIES_HEADER.into(),
        AMQPValue::LongString(section.into()),
    );
    table
}

/// The bytes of a header that holds an encoded AMQP 1.0 section. RabbitMQ writes it as a
/// long string, read as bytes, or as text when the encoding happens to be valid UTF-8.
fn section_bytes(value: &HeaderValue) -> Result<&[u8], SectionError> {
    match value {
        HeaderValue::Bytes(b) => Ok(b),
        HeaderValue::Str(s) => Ok(s.as_bytes()),
        _ => Err(SectionError::NotBytes),
    }
}

/// Reads what RabbitMQ 3.x passes on of a message published over AMQP 1.0.
///
/// * Its application properties, where the AMQP 1.0 transport keeps the engine's headers,
///   arrive encoded in one header, `x-amqp-1.0-app-properties`: they are decoded into
///   headers of their own and that header is removed. A header already present wins over an
///   application property of the same name, since the broker writes its own (`x-death`, ...)
///   in AMQP 0-9-1. [`FROM_AMQP10`] marks the message, so that a clone of it is written
///   back with its headers in that section ([`properties_to_amqp`]).
/// * Its `properties` section arrives encoded in `x-amqp-1.0-properties`, which is kept (the
///   broker gives it back to AMQP 1.0 readers of a copy). Its message id fills
///   [`Properties::message_id`] when that is empty, and replaces it when the id is not a
///   string: the broker copies a uuid or binary id as its raw bytes, where the id is read as
///   text (a uuid hyphenated, binary in hex, a ulong in decimal).
///
/// A section that does not decode is left where it is, with one warning naming the queue.
pub(crate) fn lift_amqp10_sections(
    headers: &mut Headers,
    properties: &mut Properties,
    queue: &str,
) {
    let mut problems = Vec::new();
    if let Some(encoded) = headers.remove(APP_PROPERTIES_HEADER) {
        match section_bytes(&encoded).and_then(decode_application_properties) {
            Ok(decoded) => {
                for (name, value) in decoded.headers {
                    if name != APP_PROPERTIES_HEADER && headers.get(&name).is_none() {
                        headers.insert(name, value);
                    }
                }
                headers.insert(FROM_AMQP10, HeaderValue::Bool(true));
                if decoded.dropped > 0 {
                    problems.push(format!(
                        "{APP_PROPERTIES_HEADER}: {} entries without a string key left out",
                        decoded.dropped
                    ));
                }
            }
            Err(e) => {
                problems.push(format!("{APP_PROPERTIES_HEADER}: {e}"));
                headers.insert(APP_PROPERTIES_HEADER, encoded);
            }
        }
    }
    if let Some(encoded) = headers.get(PROPERTIES_HEADER) {
        match section_bytes(encoded).and_then(decode_message_id) {
            Ok(Some(id)) if properties.message_id.is_none() || !id.is_string => {
                properties.message_id = Some(id.text);
            }
            Ok(_) => {}
            Err(e) => problems.push(format!("{PROPERTIES_HEADER}: {e}")),
        }
    }
    if !problems.is_empty() {
        warn!(
            queue,
            problems = %problems.join("; "),
            "AMQP 1.0 sections in a delivery's headers do not decode; kept as they are"
        );
    }
}

/// A lapin delivery from `queue` as the engine reads it, settled through the tag `tag`
/// makes of its delivery tag and acker. A delivery the connection's tap kept from lapin
/// (named in `refusals`) comes out marked with
/// [`UNDECODABLE_HEADER`](crate::UNDECODABLE_HEADER); the headers only the transport sets
/// are removed from every other.
pub(crate) fn received<T>(
    delivery: lapin::message::Delivery,
    queue: &str,
    refusals: Option<&Refusals>,
    tag: impl FnOnce(u64, lapin::Acker) -> T,
) -> retry_core::Delivery<T> {
    let signals = retry_core::BrokerSignals {
        redelivered: delivery.redelivered,
        delivery_count: None,
    };
    let delivery_tag = delivery.delivery_tag;
    let acker = delivery.acker.clone();
    let parts = match undecodable::reading(&delivery, refusals) {
        Reading::Undecodable { why, properties } => {
            undecodable::parts(delivery, queue, why, properties)
        }
        Reading::Plain => {
            let table = delivery.properties.headers().as_ref();
            let mut headers = table.map(headers_from_table).unwrap_or_default();
            undecodable::strip(&mut headers);
            let native = native_of(table);
            let mut properties = properties_from_amqp(&delivery.properties);
            lift_amqp10_sections(&mut headers, &mut properties, queue);
            retry_core::MessageParts {
                queue: queue.to_owned(),
                exchange: delivery.exchange.as_str().to_owned(),
                routing_key: delivery.routing_key.as_str().to_owned(),
                properties,
                body: delivery.data,
                headers,
                native,
            }
        }
    };
    retry_core::Delivery::new(tag(delivery_tag, acker), parts, signals)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{ByteArray, DecimalValue};
    use proptest::prelude::*;

    /// Levels of tables and arrays in `v`: 0 for a scalar.
    fn depth(v: &HeaderValue) -> usize {
        match v {
            HeaderValue::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
            HeaderValue::Table(t) => 1 + t.iter().map(|(_, v)| depth(v)).max().unwrap_or(0),
            _ => 0,
        }
    }

    fn amqp_depth(v: &AMQPValue) -> usize {
        match v {
            AMQPValue::FieldArray(a) => 1 + a.as_slice().iter().map(amqp_depth).max().unwrap_or(0),
            AMQPValue::FieldTable(t) => 1 + t.inner().values().map(amqp_depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    /// `levels` tables and arrays, alternating, around an integer.
    fn nested(levels: usize) -> AMQPValue {
        (0..levels).fold(AMQPValue::LongInt(7), |inner, level| {
            if level % 2 == 0 {
                AMQPValue::FieldArray(vec![inner].into())
            } else {
                let mut t = FieldTable::default();
                t.insert("k".into(), inner);
                AMQPValue::FieldTable(t)
            }
        })
    }

    fn arb_amqp() -> impl Strategy<Value = AMQPValue> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            (0..u64::MAX / 1000).prop_map(AMQPValue::Timestamp),
            ".{0,8}".prop_map(|s| AMQPValue::LongString(s.into())),
            prop::collection::vec(any::<u8>(), 0..8).prop_map(|b| AMQPValue::LongString(b.into())),
            Just(AMQPValue::Void),
        ];
        let tree = leaf.prop_recursive(4, 32, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3)
                    .prop_map(|v| AMQPValue::FieldArray(v.into())),
                prop::collection::vec(("[a-z]{1,4}", inner), 0..3).prop_map(|entries| {
                    let mut t = FieldTable::default();
                    for (k, v) in entries {
                        t.insert(k.into(), v);
                    }
                    AMQPValue::FieldTable(t)
                }),
            ]
        });
        // A small tree wrapped in up to 64 tables and arrays, each with a sibling tree: as
        // often deeper than MAX_DEPTH as not.
        let wraps = prop::collection::vec((any::<bool>(), tree.clone()), 0..64);
        (tree, wraps).prop_map(|(core, wraps)| {
            wraps.into_iter().fold(core, |inner, (as_table, sibling)| {
                if as_table {
                    let mut t = FieldTable::default();
                    t.insert("k".into(), inner);
                    t.insert("s".into(), sibling);
                    AMQPValue::FieldTable(t)
                } else {
                    AMQPValue::FieldArray(vec![sibling, inner].into())
                }
            })
        })
    }

    proptest! {
        #[test]
        fn value_trees_read_within_the_depth_limit(value in arb_amqp()) {
            let mut table = FieldTable::default();
            table.insert("h".into(), value.clone());
            let headers = headers_from_table(&table);
            let read = headers.get("h").unwrap();
            prop_assert!(depth(read) <= MAX_DEPTH, "read {} levels deep", depth(read));
            if amqp_depth(&value) <= MAX_DEPTH {
                // Shallow enough: read in full, and written back as read.
                prop_assert_eq!(depth(read), amqp_depth(&value));
                let again = headers_from_table(&table_from_headers(&headers));
                prop_assert_eq!(&again, &headers);
            }
        }
    }

    #[test]
    fn deep_nesting_from_the_network_is_cut_at_the_limit() {
        for levels in [MAX_DEPTH, MAX_DEPTH + 1, 2_000] {
            let mut t = FieldTable::default();
            t.insert("deep".into(), nested(levels));
            let h = headers_from_table(&t);
            let read = h.get("deep").unwrap();
            assert_eq!(depth(read), levels.min(MAX_DEPTH), "{levels} levels");
            // The innermost value survives only within the limit.
            let mut v = read;
            loop {
                v = match v {
                    HeaderValue::Array(a) => &a[0],
                    HeaderValue::Table(t) => t.get("k").unwrap(),
                    _ => break,
                };
            }
            let innermost = if levels <= MAX_DEPTH {
                HeaderValue::Int(7)
            } else {
                HeaderValue::Null
            };
            assert_eq!(*v, innermost, "{levels} levels");
        }
    }

    #[test]
    fn every_field_type_reads_without_panicking() {
        let mut t = FieldTable::default();
        t.insert("b".into(), AMQPValue::Boolean(true));
        t.insert("i8".into(), AMQPValue::ShortShortInt(-3));
        t.insert("u32".into(), AMQPValue::LongUInt(u32::MAX));
        t.insert("i64".into(), AMQPValue::LongLongInt(i64::MIN));
        t.insert("f".into(), AMQPValue::Float(1.5));
        t.insert(
            "dec".into(),
            AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 314,
            }),
        );
        t.insert("ss".into(), AMQPValue::ShortString("short".into()));
        t.insert(
            "bad".into(),
            AMQPValue::LongString(vec![0xff, 0xfe, 0x00].into()),
        );
        t.insert("ts".into(), AMQPValue::Timestamp(u64::MAX));
        t.insert(
            "bytes".into(),
            AMQPValue::ByteArray(ByteArray::from(vec![1u8, 2])),
        );
        t.insert("void".into(), AMQPValue::Void);
        let h = headers_from_table(&t);
        assert_eq!(h.get("b"), Some(&HeaderValue::Bool(true)));
        assert_eq!(h.get("i8"), Some(&HeaderValue::Int(-3)));
        assert_eq!(h.get("u32"), Some(&HeaderValue::Int(u32::MAX as i64)));
        assert_eq!(h.get("i64"), Some(&HeaderValue::Int(i64::MIN)));
        assert_eq!(h.get("f"), Some(&HeaderValue::Float(1.5)));
        assert_eq!(h.get("dec"), Some(&HeaderValue::Str("314e-2".into())));
        assert_eq!(h.get("ss"), Some(&HeaderValue::Str("short".into())));
        assert_eq!(h.get("bad"), Some(&HeaderValue::Bytes(vec![0xff, 0xfe, 0])));
        assert_eq!(
            h.get("ts"),
            Some(&HeaderValue::Timestamp(Timestamp::from_millis(u64::MAX)))
        );
        assert_eq!(h.get("void"), Some(&HeaderValue::Null));
    }

    #[test]
    fn engine_headers_round_trip() {
        let h: Headers = [
            ("x-retry-attempts", HeaderValue::Int(3)),
            ("x-retry-last-error", HeaderValue::from("timeout")),
            ("tenant", HeaderValue::Bytes(vec![1, 2, 3])),
            (
                "nested",
                HeaderValue::Array(vec![HeaderValue::Table(
                    [("count", HeaderValue::Int(2))].into_iter().collect(),
                )]),
            ),
            ("big", HeaderValue::UInt(u64::MAX)),
        ]
        .into_iter()
        .collect();
        let back = headers_from_table(&table_from_headers(&h));
        assert_eq!(back.get("x-retry-attempts"), h.get("x-retry-attempts"));
        assert_eq!(back.get("x-retry-last-error"), h.get("x-retry-last-error"));
        assert_eq!(back.get("tenant"), h.get("tenant"));
        assert_eq!(back.get("nested"), h.get("nested"));
        assert_eq!(
            back.get("big"),
            Some(&HeaderValue::Str(u64::MAX.to_string()))
        );
    }

    /// An application-properties section, encoded as RabbitMQ 3.10 stores one:
    /// `x-retry-attempts` = 1 (long), `x-retry-reason` = "permanent", `x-death` = "from 1.0",
    /// `tenant` = "acme" (a symbol).
    fn app_properties_section() -> Vec<u8> {
        let mut body = vec![8u8];
        for (k, v) in [
            ("x-retry-attempts", &[0x55, 0x01][..]),
            (
                "x-retry-reason",
                &[
                    0xa1, 9, b'p', b'e', b'r', b'm', b'a', b'n', b'e', b'n', b't',
                ],
            ),
            (
                "x-death",
                &[0xa1, 8, b'f', b'r', b'o', b'm', b' ', b'1', b'.', b'0'],
            ),
            ("tenant", &[0xa3, 4, b'a', b'c', b'm', b'e']),
        ] {
            body.extend([0xa1, u8::try_from(k.len()).unwrap()]);
            body.extend(k.as_bytes());
            body.extend(v);
        }
        let mut out = vec![0x00, 0x53, 0x74, 0xc1, u8::try_from(body.len()).unwrap()];
        out.extend(body);
        out
    }

    /// A properties section with this message id (encoded) and a correlation id.
    fn properties_section(id: &[u8]) -> Vec<u8> {
        let mut body = vec![6u8];
        body.extend(id);
        body.extend([0x40, 0x40, 0x40, 0x40, 0xa1, 1, b'c']);
        let mut out = vec![0x00, 0x53, 0x73, 0xc0, u8::try_from(body.len()).unwrap()];
        out.extend(body);
        out
    }

    fn table_with(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(k.into(), v);
        }
        t
    }

    /// The headers of a message from AMQP 1.0 as RabbitMQ 3.10 hands it over AMQP 0-9-1
    /// after one dead-lettering: the section, an `x-death` of its own, and `extra`.
    fn from_amqp10(extra: Vec<(&str, AMQPValue)>) -> FieldTable {
        let mut death = FieldTable::default();
        death.insert("count".into(), AMQPValue::LongLongInt(1));
        let mut entries = vec![
            (
                APP_PROPERTIES_HEADER,
                AMQPValue::LongString(app_properties_section().into()),
            ),
            (
                "x-death",
                AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
            ),
        ];
        entries.extend(extra);
        table_with(entries)
    }

    #[test]
    fn application_properties_from_amqp10_become_headers() {
        let mut headers = headers_from_table(&from_amqp10(vec![]));
        assert!(matches!(
            headers.get(APP_PROPERTIES_HEADER),
            Some(HeaderValue::Bytes(_))
        ));
        let mut properties = Properties::default();
        lift_amqp10_sections(&mut headers, &mut properties, "q");
        assert_eq!(headers.get(APP_PROPERTIES_HEADER), None);
        assert_eq!(headers.get("x-retry-attempts"), Some(&HeaderValue::Int(1)));
        assert_eq!(
            headers.get("x-retry-reason"),
            Some(&HeaderValue::from("permanent"))
        );
        assert_eq!(headers.get("tenant"), Some(&HeaderValue::from("acme")));
        assert!(
            matches!(headers.get("x-death"), Some(HeaderValue::Array(_))),
            "the broker's own header wins: {headers:?}"
        );
        assert_eq!(headers.get(FROM_AMQP10), Some(&HeaderValue::Bool(true)));
        assert_eq!(headers.len(), 5);
        assert_eq!(properties, Properties::default());
    }

    #[test]
    fn a_clone_of_a_message_from_amqp10_carries_its_headers_in_the_section_too() {
        let table = from_amqp10(vec![(
            PROPERTIES_HEADER,
            AMQPValue::LongString(vec![0x00].into()),
        )]);
        let mut headers = headers_from_table(&table);
        lift_amqp10_sections(&mut headers, &mut Properties::default(), "q");
        // The engine resets a counter and adds one of its own.
        headers.insert("x-retry-attempts", HeaderValue::Int(0));
        headers.insert("x-retry-replays", HeaderValue::Int(1));
        let written = properties_to_amqp(
            &Properties::default(),
            &headers,
            &NativeParts::default(),
            None,
        );
        let written = written.headers().as_ref().unwrap();
        let plain = headers_from_table(written);
        assert_eq!(plain.get(FROM_AMQP10), None, "the mark is not sent");
        assert_eq!(plain.get("x-retry-replays"), Some(&HeaderValue::Int(1)));
        let Some(HeaderValue::Bytes(section)) = plain.get(APP_PROPERTIES_HEADER) else {
            panic!("no section: {plain:?}");
        };
        let decoded = decode_application_properties(section).unwrap().headers;
        let want: Headers = [
            ("tenant", HeaderValue::from("acme")),
            ("x-retry-attempts", HeaderValue::Int(0)),
            ("x-retry-reason", HeaderValue::from("permanent")),
            ("x-retry-replays", HeaderValue::Int(1)),
        ]
        .into_iter()
        .collect();
        assert_eq!(decoded, want, "no x-death, no AMQP 1.0 section, no mark");
        // Read back over AMQP 0-9-1, it is the same message again.
        let mut again = plain.clone();
        lift_amqp10_sections(&mut again, &mut Properties::default(), "q");
        let mut expected = headers.clone();
        expected.remove("x-death");
        again.remove("x-death");
        assert_eq!(again, expected);
    }

    #[test]
    fn a_message_not_from_amqp10_gets_no_section() {
        let headers: Headers = [("tenant", "acme")].into_iter().collect();
        let written = properties_to_amqp(
            &Properties::default(),
            &headers,
            &NativeParts::default(),
            None,
        );
        let plain = headers_from_table(written.headers().as_ref().unwrap());
        assert_eq!(plain, headers);
    }

    #[test]
    fn an_empty_section_read_as_text_is_lifted_too() {
        // `00 53 74 40` is valid UTF-8.
        let table = table_with(vec![(
            APP_PROPERTIES_HEADER,
            AMQPValue::LongString(vec![0x00, 0x53, 0x74, 0x40].into()),
        )]);
        let mut headers = headers_from_table(&table);
        assert!(matches!(
            headers.get(APP_PROPERTIES_HEADER),
            Some(HeaderValue::Str(_))
        ));
        lift_amqp10_sections(&mut headers, &mut Properties::default(), "q");
        let marked: Headers = [(FROM_AMQP10, HeaderValue::Bool(true))]
            .into_iter()
            .collect();
        assert_eq!(headers, marked);
    }

    /// Headers of types the model reads as others (the broker tests go through every one).
    fn narrow_types() -> FieldTable {
        let mut nested = FieldTable::default();
        nested.insert("n".into(), AMQPValue::LongInt(-5));
        table_with(vec![
            ("i16", AMQPValue::ShortInt(-300)),
            ("u32", AMQPValue::LongUInt(4_000_000_000)),
            ("f32", AMQPValue::Float(1.5)),
            (
                "decimal",
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 2,
                    value: 1234,
                }),
            ),
            ("table", AMQPValue::FieldTable(nested)),
            ("far", AMQPValue::Timestamp(u64::MAX)),
        ])
    }

    #[test]
    fn a_copy_writes_the_headers_it_did_not_change_with_their_original_types() {
        let mut table = narrow_types();
        table.insert("x-retry-attempts".into(), AMQPValue::LongInt(2));
        let native = native_of(Some(&table));
        let mut headers = headers_from_table(&table);
        headers.insert("x-retry-attempts", 3i64);
        let written = properties_to_amqp(&Properties::default(), &headers, &native, None);
        let written = written.headers().as_ref().unwrap().inner();
        for (name, value) in narrow_types().inner() {
            assert_eq!(written.get(name), Some(value), "{name}");
        }
        assert_eq!(
            written.get("x-retry-attempts"),
            Some(&AMQPValue::LongLongInt(3)),
            "a header the copy changed is written afresh"
        );
        // Without the table, every one of them would change type.
        let plain = properties_to_amqp(
            &Properties::default(),
            &headers,
            &NativeParts::default(),
            None,
        );
        let plain = plain.headers().as_ref().unwrap().inner();
        for (name, value) in narrow_types().inner() {
            assert_ne!(plain.get(name), Some(value), "{name}");
        }
    }

    #[test]
    fn a_table_whose_types_come_back_unchanged_is_not_kept() {
        let table = table_with(vec![
            ("b", AMQPValue::Boolean(true)),
            ("l", AMQPValue::LongLongInt(-1)),
            ("d", AMQPValue::Double(0.25)),
            ("s", AMQPValue::LongString("text".into())),
            ("x", AMQPValue::ByteArray(vec![0xff].into())),
            ("t", AMQPValue::Timestamp(1_700_000_000)),
            ("v", AMQPValue::Void),
            (
                "a",
                AMQPValue::FieldArray(vec![AMQPValue::LongLongInt(1)].into()),
            ),
        ]);
        assert!(native_of(Some(&table)).get::<FieldTable>().is_none());
        assert!(native_of(None).get::<FieldTable>().is_none());
        let back = table_from_headers(&headers_from_table(&table));
        assert_eq!(back, table, "these types round-trip without the table");
        for (name, value) in narrow_types().inner() {
            let one = table_with(vec![(name.as_str(), value.clone())]);
            assert!(
                native_of(Some(&one)).get::<FieldTable>().is_some(),
                "{name} changes type, so its table is kept"
            );
        }
    }

    #[test]
    fn a_section_that_does_not_decode_is_kept_as_it_is() {
        let mut truncated = app_properties_section();
        truncated.pop();
        for value in [
            HeaderValue::Bytes(truncated),
            HeaderValue::Int(3),
            HeaderValue::Bytes(vec![0xff; 40]),
        ] {
            let mut headers: Headers = [
                (APP_PROPERTIES_HEADER, value.clone()),
                (PROPERTIES_HEADER, HeaderValue::Bytes(vec![0x00, 0x53])),
                ("x-retry-attempts", HeaderValue::Int(2)),
            ]
            .into_iter()
            .collect();
            let before = headers.clone();
            let mut properties = Properties::default();
            lift_amqp10_sections(&mut headers, &mut properties, "q");
            assert_eq!(headers, before);
            assert_eq!(properties.message_id, None);
        }
    }

    #[test]
    fn the_message_id_comes_from_the_properties_section_where_needed() {
        let uuid: Vec<u8> = std::iter::once(0x98).chain(1..=16).collect();
        let cases: Vec<(Option<&str>, Vec<u8>, Option<&str>)> = vec![
            // Empty: filled from a string id.
            (None, vec![0xa1, 3, b'm', b'-', b'1'], Some("m-1")),
            // A string id the broker copied: kept.
            (Some("m-1"), vec![0xa1, 3, b'm', b'-', b'1'], Some("m-1")),
            (Some("set"), vec![0xa1, 3, b'm', b'-', b'1'], Some("set")),
            // A uuid or binary id the broker copied as bytes: read as text.
            (
                Some("\u{1}\u{2}"),
                uuid,
                Some("01020304-0506-0708-090a-0b0c0d0e0f10"),
            ),
            (Some("\u{1}\u{2}"), vec![0xa0, 2, 1, 2], Some("0102")),
            (None, vec![0x53, 42], Some("42")),
            // No id in the section.
            (None, vec![0x40], None),
            (Some("kept"), vec![0x40], Some("kept")),
        ];
        for (before, id, after) in cases {
            let section = properties_section(&id);
            let mut headers: Headers = [(PROPERTIES_HEADER, HeaderValue::Bytes(section.clone()))]
                .into_iter()
                .collect();
            let mut properties = Properties {
                message_id: before.map(str::to_owned),
                ..Properties::default()
            };
            lift_amqp10_sections(&mut headers, &mut properties, "q");
            assert_eq!(properties.message_id.as_deref(), after, "{id:02x?}");
            assert_eq!(
                headers.get(PROPERTIES_HEADER),
                Some(&HeaderValue::Bytes(section)),
                "the section stays for AMQP 1.0 readers of a copy"
            );
        }
    }

    #[test]
    fn overlong_names_and_values_are_dropped_not_panicked_on() {
        let long = "k".repeat(300);
        let h: Headers = [
            (long.as_str(), HeaderValue::Int(1)),
            ("ok", HeaderValue::Int(2)),
        ]
        .into_iter()
        .collect();
        let t = table_from_headers(&h);
        assert_eq!(t.inner().len(), 1);
        let p = Properties {
            message_id: Some("m".repeat(300)),
            content_type: Some("text/plain".into()),
            persistent: true,
            ..Properties::default()
        };
        let out = properties_to_amqp(
            &p,
            &Headers::new(),
            &NativeParts::default(),
            Some(Duration::from_millis(1500)),
        );
        assert_eq!(out.message_id(), &None);
        assert_eq!(
            out.content_type().as_ref().map(|s| s.as_str()),
            Some("text/plain")
        );
        assert_eq!(out.delivery_mode(), &Some(2));
        assert_eq!(out.expiration().as_ref().map(|s| s.as_str()), Some("1500"));
    }

    /// Deliveries the connection's tap kept from lapin (see the `undecodable` module).
    mod undecodable {
        use super::super::*;
        use crate::tap::Frames;
        use crate::tap::{MARK, Refusals};
        use crate::undecodable::{RAW_PROPERTIES_HEADER, UNDECODABLE_HEADER};
        use lapin::BasicProperties;
        use lapin::message::Delivery;
        use lapin::types::AMQPValue;
        use lapin::types::FieldTable;
        use retry_core::HeaderValue;
        use test_brokers::rabbitmq::RawProperties;

        fn delivery(headers: FieldTable) -> Delivery {
            let mut d = Delivery::mock(4, "".into(), "q".into(), true, b"body".to_vec());
            d.properties = BasicProperties::default()
                .with_message_id("id".into())
                .with_headers(headers);
            d
        }

        /// The token the tap puts in a message it keeps from lapin, with `properties`.
        fn refused(refusals: &Refusals, properties: &RawProperties) -> String {
            let mut payload = vec![0, 60, 0, 0];
            payload.extend_from_slice(&4u64.to_be_bytes());
            payload.extend_from_slice(&properties.encode());
            let mut frame = vec![2, 0, 1];
            frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            frame.extend_from_slice(&payload);
            frame.push(0xCE);
            let mut frames = Frames::new(None);
            frames.feed(&frame, refusals).unwrap();
            let mut out = vec![0; 512];
            let n = frames.read_into(&mut out);
            let text = String::from_utf8_lossy(&out[..n]).into_owned();
            let at = text.find(MARK).expect("marked") + MARK.len() + 5;
            text[at..at + 32].to_owned()
        }

        #[test]
        fn a_delivery_the_tap_kept_comes_out_marked_with_its_properties() {
            let refusals = Refusals::new();
            let bad = RawProperties::new().message_id(b"bad-\xff");
            let token = refused(&refusals, &bad);
            let mut headers = FieldTable::default();
            headers.insert(MARK.into(), AMQPValue::LongString(token.as_str().into()));
            let d = received(delivery(headers), "q", Some(&refusals), |tag, _| tag);
            let h = d.message.headers();
            assert_eq!(
                h.get(UNDECODABLE_HEADER).and_then(HeaderValue::as_str),
                Some("message-id is not UTF-8 (62 61 64 2d ff)")
            );
            assert_eq!(
                h.get(RAW_PROPERTIES_HEADER),
                Some(&HeaderValue::Bytes(bad.encode()))
            );
            assert_eq!(
                d.message.properties().message_id,
                None,
                "no property of it is trusted"
            );
            assert_eq!(d.message.body(), b"body");
            assert!(d.facts.redelivered);
            assert_eq!(d.tag, 4);
        }

        #[test]
        fn marks_from_a_publisher_are_removed_and_the_message_read_as_it_came() {
            let refusals = Refusals::new();
            let mut headers = FieldTable::default();
            headers.insert(
                MARK.into(),
                AMQPValue::LongString(format!("{:032x}", 7).into()),
            );
            headers.insert(
                UNDECODABLE_HEADER.into(),
                AMQPValue::LongString("forged".into()),
            );
            headers.insert(
                RAW_PROPERTIES_HEADER.into(),
                AMQPValue::LongString("forged".into()),
            );
            headers.insert("user".into(), AMQPValue::LongString("kept".into()));
            for refusals in [Some(&refusals), None] {
                let d = received(delivery(headers.clone()), "q", refusals, |tag, _| tag);
                let h = d.message.headers();
                assert_eq!(h.get(MARK), None);
                assert_eq!(h.get(UNDECODABLE_HEADER), None);
                assert_eq!(h.get(RAW_PROPERTIES_HEADER), None);
                assert_eq!(h.get("user").and_then(HeaderValue::as_str), Some("kept"));
                assert_eq!(d.message.properties().message_id.as_deref(), Some("id"));
            }
        }
    }
}
