//! Headers ↔ AMQP 1.0 application properties.
//!
//! The engine keeps its headers in `application-properties` on this transport: RabbitMQ 3.x
//! does not show AMQP 0-9-1 headers to 1.0 clients, and shows 1.0 application properties to
//! 0-9-1 clients only as opaque bytes, so the 1.0 section is the only place both ends of a
//! 1.0 retry loop can read.
//!
//! Application properties hold AMQP *simple* values, a wider set of types than
//! [`HeaderValue`]. Each value converts to the closest header value; where that loses the
//! AMQP type (a `symbol` read as a string, an `int` read as a 64-bit integer, a `decimal`
//! read as its bytes), [`read_application_properties`] also returns the original, and
//! [`write_application_properties`] puts the original back on a clone as long as the header
//! still holds the value read from it. Nothing here panics, whatever the peer sent.
//!
//! | AMQP 1.0 | header value | exact round trip |
//! |---|---|---|
//! | `null`, `boolean`, `long`, `ulong`, `double`, `string`, `binary` | same | yes |
//! | `timestamp` (not before 1970) | [`HeaderValue::Timestamp`] | yes |
//! | `byte`, `short`, `int` | [`HeaderValue::Int`] | kept aside |
//! | `ubyte`, `ushort`, `uint` | [`HeaderValue::UInt`] | kept aside |
//! | `float` | [`HeaderValue::Float`] | kept aside |
//! | `symbol`, `char`, `uuid` (hyphenated) | [`HeaderValue::Str`] | kept aside |
//! | `decimal32/64/128` | [`HeaderValue::Bytes`] (IEEE 754 bytes) | kept aside |
//! | `timestamp` before 1970 | [`HeaderValue::Int`] (milliseconds) | kept aside |
//! | described values (not allowed, but read) | [`HeaderValue::Bytes`] (AMQP encoding) | kept aside |
//!
//! Writing goes the other way; arrays and tables, which application properties cannot
//! hold, travel as the AMQP encoding of a list or map in a `binary` value.

use fe2o3_amqp::types::messaging::ApplicationProperties;
use fe2o3_amqp::types::primitives::{OrderedMap, SimpleValue, Timestamp as AmqpTimestamp, Value};
use retry_core::{HeaderValue, Headers, Timestamp};

/// Application properties whose AMQP type a header value cannot carry, by name, as they
/// arrived.
pub type Originals = OrderedMap<String, SimpleValue>;

/// Converts application properties into [`Headers`], returning alongside them the original
/// values that the conversion could not represent exactly.
///
/// ```
/// use fe2o3_amqp::types::messaging::ApplicationProperties;
/// use fe2o3_amqp::types::primitives::{SimpleValue, Symbol};
/// use retry_core::HeaderValue;
/// use transport_amqp10::convert::read_application_properties;
///
/// let props = ApplicationProperties::builder()
///     .insert("x-retry-attempts", 2i64)
///     .insert("region", SimpleValue::Symbol(Symbol::from("eu")))
///     .build();
/// let (headers, originals) = read_application_properties(&props);
/// assert_eq!(headers.get("x-retry-attempts"), Some(&HeaderValue::Int(2)));
/// assert_eq!(headers.get("region"), Some(&HeaderValue::Str("eu".into())));
/// assert!(originals.contains_key("region")); // a symbol, not a string: kept for clones
/// ```
pub fn read_application_properties(props: &ApplicationProperties) -> (Headers, Originals) {
    let mut headers = Headers::new();
    let mut originals = Originals::new();
    for (name, value) in props.0.iter() {
        let converted = header_from_simple(value);
        if &simple_from_header(&converted) != value {
            originals.insert(name.clone(), value.clone());
        }
        headers.insert(name.clone(), converted);
    }
    (headers, originals)
}

/// Converts [`Headers`] into application properties. A header whose value is still the one
/// read from an entry of `originals` is written back as that original.
///
/// ```
/// use retry_core::Headers;
/// use fe2o3_amqp::types::primitives::SimpleValue;
/// use transport_amqp10::convert::{write_application_properties, Originals};
///
/// let headers: Headers = [("x-retry-attempts", 3i64)].into_iter().collect();
/// let props = write_application_properties(&headers, &Originals::new());
/// assert_eq!(props.get("x-retry-attempts"), Some(&SimpleValue::Long(3)));
/// ```
pub fn write_application_properties(
    headers: &Headers,
    originals: &Originals,
) -> ApplicationProperties {
    let mut out = OrderedMap::new();
    for (name, value) in headers.iter() {
        let simple = match originals.get(name) {
            Some(original) if same(&header_from_simple(original), value) => original.clone(),
            _ => simple_from_header(value),
        };
        out.insert(name.to_owned(), simple);
    }
    ApplicationProperties(out)
}

/// Equality that holds for a NaN read and compared again: the question is "is this still the
/// value that was read", not arithmetic.
fn same(a: &HeaderValue, b: &HeaderValue) -> bool {
    match (a, b) {
        (HeaderValue::Float(x), HeaderValue::Float(y)) => x.to_bits() == y.to_bits(),
        _ => a == b,
    }
}

/// The header value closest to an AMQP simple value.
///
/// ```
/// use fe2o3_amqp::types::primitives::SimpleValue;
/// use retry_core::HeaderValue;
/// use transport_amqp10::convert::header_from_simple;
///
/// assert_eq!(header_from_simple(&SimpleValue::Int(-7)), HeaderValue::Int(-7));
/// assert_eq!(header_from_simple(&SimpleValue::Char('é')), HeaderValue::Str("é".into()));
/// ```
pub fn header_from_simple(value: &SimpleValue) -> HeaderValue {
    match value {
        SimpleValue::Null => HeaderValue::Null,
        SimpleValue::Bool(b) => HeaderValue::Bool(*b),
        SimpleValue::Ubyte(n) => HeaderValue::UInt(u64::from(*n)),
        SimpleValue::Ushort(n) => HeaderValue::UInt(u64::from(*n)),
        SimpleValue::Uint(n) => HeaderValue::UInt(u64::from(*n)),
        SimpleValue::Ulong(n) => HeaderValue::UInt(*n),
        SimpleValue::Byte(n) => HeaderValue::Int(i64::from(*n)),
        SimpleValue::Short(n) => HeaderValue::Int(i64::from(*n)),
        SimpleValue::Int(n) => HeaderValue::Int(i64::from(*n)),
        SimpleValue::Long(n) => HeaderValue::Int(*n),
        SimpleValue::Float(f) => HeaderValue::Float(f64::from(f.into_inner())),
        SimpleValue::Double(f) => HeaderValue::Float(f.into_inner()),
        SimpleValue::Decimal32(d) => HeaderValue::Bytes(d.as_inner().to_vec()),
        SimpleValue::Decimal64(d) => HeaderValue::Bytes(d.as_inner().to_vec()),
        SimpleValue::Decimal128(d) => HeaderValue::Bytes(d.as_inner().to_vec()),
        SimpleValue::Char(c) => HeaderValue::Str(c.to_string()),
        SimpleValue::Timestamp(t) => match u64::try_from(t.milliseconds()) {
            Ok(ms) => HeaderValue::Timestamp(Timestamp::from_millis(ms)),
            Err(_) => HeaderValue::Int(t.milliseconds()),
        },
        SimpleValue::Uuid(u) => HeaderValue::Str(transport_kit::amqp10::hyphenated(u.as_inner())),
        SimpleValue::Binary(b) => HeaderValue::Bytes(b.to_vec()),
        SimpleValue::String(s) => HeaderValue::Str(s.clone()),
        SimpleValue::Symbol(s) => HeaderValue::Str(s.as_str().to_owned()),
        SimpleValue::Described(_) => {
            HeaderValue::Bytes(serde_amqp::to_vec(value).unwrap_or_default())
        }
    }
}

/// The AMQP simple value for a header value.
///
/// ```
/// use fe2o3_amqp::types::primitives::SimpleValue;
/// use retry_core::HeaderValue;
/// use transport_amqp10::convert::simple_from_header;
///
/// assert_eq!(simple_from_header(&HeaderValue::Int(5)), SimpleValue::Long(5));
/// assert_eq!(simple_from_header(&HeaderValue::Str("a".into())), SimpleValue::String("a".into()));
/// ```
pub fn simple_from_header(value: &HeaderValue) -> SimpleValue {
    match value {
        HeaderValue::Null => SimpleValue::Null,
        HeaderValue::Bool(b) => SimpleValue::Bool(*b),
        HeaderValue::Int(n) => SimpleValue::Long(*n),
        HeaderValue::UInt(n) => SimpleValue::Ulong(*n),
        HeaderValue::Float(f) => SimpleValue::from(*f),
        HeaderValue::Str(s) => SimpleValue::String(s.clone()),
        HeaderValue::Bytes(b) => SimpleValue::Binary(b.clone().into()),
        HeaderValue::Timestamp(t) => SimpleValue::Timestamp(AmqpTimestamp::from_milliseconds(
            i64::try_from(t.as_millis()).unwrap_or(i64::MAX),
        )),
        HeaderValue::Array(_) | HeaderValue::Table(_) => {
            let encoded = serde_amqp::to_vec(&value_from_header(value)).unwrap_or_default();
            SimpleValue::Binary(encoded.into())
        }
    }
}

/// Any header value as an AMQP value; arrays become lists and tables maps with string keys.
fn value_from_header(value: &HeaderValue) -> Value {
    match value {
        HeaderValue::Array(items) => Value::List(items.iter().map(value_from_header).collect()),
        HeaderValue::Table(table) => Value::Map(
            table
                .iter()
                .map(|(k, v)| (Value::String(k.to_owned()), value_from_header(v)))
                .collect(),
        ),
        simple => Value::from(simple_from_header(simple)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp::types::primitives::{Dec32, Dec64, Dec128, Symbol, Uuid};
    use serde_amqp::described::Described;
    use serde_amqp::descriptor::Descriptor;

    fn props(entries: Vec<(&str, SimpleValue)>) -> ApplicationProperties {
        ApplicationProperties(
            entries
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
        )
    }

    /// Headers are kept in name order, so entries come back sorted.
    fn sorted(props: &ApplicationProperties) -> Vec<(String, SimpleValue)> {
        let mut out: Vec<_> = props
            .0
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    #[test]
    fn exact_types_round_trip_without_originals() {
        let input = props(vec![
            ("null", SimpleValue::Null),
            ("bool", SimpleValue::Bool(true)),
            ("long", SimpleValue::Long(i64::MIN)),
            ("ulong", SimpleValue::Ulong(u64::MAX)),
            ("double", SimpleValue::from(1.5f64)),
            ("string", SimpleValue::String("héllo".into())),
            ("binary", SimpleValue::Binary(vec![0u8, 255].into())),
            (
                "ts",
                SimpleValue::Timestamp(AmqpTimestamp::from_milliseconds(1_700_000_000_000)),
            ),
        ]);
        let (headers, originals) = read_application_properties(&input);
        assert!(originals.is_empty(), "{originals:?}");
        assert_eq!(headers.get("ulong"), Some(&HeaderValue::UInt(u64::MAX)));
        assert_eq!(
            headers.get("ts"),
            Some(&HeaderValue::Timestamp(Timestamp::from_millis(
                1_700_000_000_000
            )))
        );
        assert_eq!(
            sorted(&write_application_properties(&headers, &originals)),
            sorted(&input)
        );
    }

    #[test]
    fn lossy_types_are_kept_and_restored_on_clones() {
        let uuid = Uuid::from([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ]);
        let described = SimpleValue::Described(Box::new(Described {
            descriptor: Descriptor::Code(0x77),
            value: Value::Int(1),
        }));
        let input = props(vec![
            ("byte", SimpleValue::Byte(-1)),
            ("short", SimpleValue::Short(300)),
            ("int", SimpleValue::Int(7)),
            ("ubyte", SimpleValue::Ubyte(1)),
            ("ushort", SimpleValue::Ushort(2)),
            ("uint", SimpleValue::Uint(3)),
            ("float", SimpleValue::from(0.25f32)),
            ("d32", SimpleValue::Decimal32(Dec32::from([1, 2, 3, 4]))),
            ("d64", SimpleValue::Decimal64(Dec64::from([0; 8]))),
            ("d128", SimpleValue::Decimal128(Dec128::from([9; 16]))),
            ("char", SimpleValue::Char('€')),
            (
                "old",
                SimpleValue::Timestamp(AmqpTimestamp::from_milliseconds(-5)),
            ),
            ("uuid", SimpleValue::Uuid(uuid)),
            ("symbol", SimpleValue::Symbol(Symbol::from("sym"))),
            ("described", described),
        ]);
        let (headers, originals) = read_application_properties(&input);
        assert_eq!(originals.len(), input.len());
        assert_eq!(headers.get("int"), Some(&HeaderValue::Int(7)));
        assert_eq!(headers.get("uint"), Some(&HeaderValue::UInt(3)));
        assert_eq!(headers.get("float"), Some(&HeaderValue::Float(0.25)));
        assert_eq!(headers.get("char"), Some(&HeaderValue::Str("€".into())));
        assert_eq!(headers.get("old"), Some(&HeaderValue::Int(-5)));
        assert_eq!(
            headers.get("uuid"),
            Some(&HeaderValue::Str(
                "12345678-9abc-def0-0123-456789abcdef".into()
            ))
        );
        assert_eq!(
            headers.get("d32"),
            Some(&HeaderValue::Bytes(vec![1, 2, 3, 4]))
        );
        assert!(matches!(headers.get("described"), Some(HeaderValue::Bytes(b)) if !b.is_empty()));
        // Unchanged headers go back exactly as they came.
        assert_eq!(
            sorted(&write_application_properties(&headers, &originals)),
            sorted(&input)
        );
    }

    #[test]
    fn a_changed_header_wins_over_its_original() {
        let input = props(vec![(
            "x-retry-attempts",
            SimpleValue::Symbol("lots".into()),
        )]);
        let (mut headers, originals) = read_application_properties(&input);
        headers.insert("x-retry-attempts", 2i64);
        let out = write_application_properties(&headers, &originals);
        assert_eq!(out.get("x-retry-attempts"), Some(&SimpleValue::Long(2)));
    }

    #[test]
    fn hostile_values_never_panic_and_decode_as_malformed() {
        let input = props(vec![
            ("x-retry-attempts", SimpleValue::Long(-1)),
            ("x-retry-crashes", SimpleValue::Ulong(u64::MAX)),
            (
                "x-retry-first-failure",
                SimpleValue::String("yesterday".into()),
            ),
            (
                "x-retry-last-failure",
                SimpleValue::Timestamp(AmqpTimestamp::from_milliseconds(i64::MIN)),
            ),
            ("x-retry-delay", SimpleValue::from(f32::NAN)),
            ("", SimpleValue::Binary(vec![0xff; 3].into())),
        ]);
        let (headers, originals) = read_application_properties(&input);
        let facts =
            retry_core::DeliveryFacts::decode(&headers, retry_core::BrokerSignals::default(), 0);
        assert_eq!(facts.attempts, 0);
        assert_eq!(facts.crashes, 0);
        assert_eq!(facts.first_failure, None);
        assert_eq!(facts.last_failure, None);
        for name in [
            "x-retry-attempts",
            "x-retry-crashes",
            "x-retry-first-failure",
            "x-retry-last-failure",
        ] {
            assert!(facts.malformed.contains(name), "{name} not reported");
        }
        // NaN is not equal to itself: the original must still come back, not a fresh NaN
        // that fails the "unchanged" test and loses its type.
        let out = write_application_properties(&headers, &originals);
        assert_eq!(out.len(), input.len());
        assert!(matches!(
            out.get("x-retry-delay"),
            Some(SimpleValue::Float(_))
        ));
    }

    #[test]
    fn arrays_and_tables_travel_as_encoded_binary() {
        let mut table = Headers::new();
        table.insert("count", 2i64);
        let headers: Headers = [
            (
                "list",
                HeaderValue::Array(vec![HeaderValue::Int(1), HeaderValue::Str("a".into())]),
            ),
            ("table", HeaderValue::Table(table)),
        ]
        .into_iter()
        .collect();
        let out = write_application_properties(&headers, &Originals::new());
        let Some(SimpleValue::Binary(list)) = out.get("list") else {
            panic!("{out:?}")
        };
        let decoded: Value = serde_amqp::from_slice(list).expect("valid AMQP");
        assert_eq!(
            decoded,
            Value::List(vec![Value::Long(1), Value::String("a".into())])
        );
        assert!(matches!(out.get("table"), Some(SimpleValue::Binary(_))));
    }
}
