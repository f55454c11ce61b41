//! The checks the connection's tap makes before lapin parses a message
//! (`transport_amqp091::inspect`), against lapin's own parser: what lapin reads passes, what
//! it refuses is refused and named, and nothing panics or recurses.

use lapin::protocol::basic::parse_properties;
use lapin::types::parsing::parse_long_long_uint;
use proptest::prelude::*;
use test_brokers::rabbitmq::{RawProperties, RawTable};
use transport_amqp091::inspect::*;

/// A content header payload: class 60, weight 0, a body of 5 bytes, `properties`.
fn header(properties: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 60, 0, 0];
    out.extend_from_slice(&5u64.to_be_bytes());
    out.extend_from_slice(properties);
    out
}

/// Whether lapin parses `payload` as a content header, all of it.
fn lapin_parses(payload: &[u8]) -> bool {
    let Some(rest) = payload.get(4..) else {
        return false;
    };
    let Ok((rest, _)) = parse_long_long_uint(rest) else {
        return false;
    };
    matches!(parse_properties(rest), Ok((rest, _)) if rest.is_empty())
}

fn refusal(properties: RawProperties) -> Refusal {
    check_content_header(&header(&properties.encode())).unwrap_err()
}

#[test]
fn what_lapin_parses_passes() {
    let table = RawTable::new()
        .entry(b"s", &RawTable::long_string(b"caf\xe9"))
        .entry(b"deep", &RawTable::nested_tables(10))
        .entry(b"list", &RawTable::nested_arrays(10))
        .entry(b"n", b"l\x00\x00\x00\x00\x00\x00\x00\x07")
        .entry(b"d", b"D\x02\x00\x00\x04\xd2")
        .entry(b"t", b"t\x01")
        .entry(b"v", b"V");
    let properties = RawProperties::new()
        .content_type(b"text/plain")
        .message_id(b"id-1")
        .headers(&table)
        .delivery_mode(2)
        .short_string("cluster-id", b"c");
    let payload = header(&properties.encode());
    assert!(lapin_parses(&payload));
    assert_eq!(check_content_header(&payload), Ok(()));
    assert_eq!(check_content_header(&header(&[0, 0])), Ok(()));
}

#[test]
fn a_short_string_that_is_not_utf8_is_named() {
    let r = refusal(RawProperties::new().message_id(b"bad-\xff"));
    assert_eq!(r.field, "message-id");
    assert_eq!(r.problem, Problem::NotUtf8(b"bad-\xff".to_vec()));
    assert_eq!(r.to_string(), "message-id is not UTF-8 (62 61 64 2d ff)");
    let r = refusal(RawProperties::new().short_string("reply-to", b"\xc3"));
    assert_eq!(r.field, "reply-to");
}

#[test]
fn a_header_name_that_is_not_utf8_is_named_with_its_path() {
    let inner = RawTable::new().entry(b"k\xff", b"V");
    let mut nested = vec![b'F'];
    nested.extend_from_slice(&(inner.0.len() as u32).to_be_bytes());
    nested.extend_from_slice(&inner.0);
    let r = refusal(RawProperties::new().headers(&RawTable::new().entry(b"outer", &nested)));
    assert_eq!(r.field, "a header name in headers[\"outer\"]");
    assert_eq!(r.problem, Problem::NotUtf8(b"k\xff".to_vec()));
}

#[test]
fn nesting_is_accepted_up_to_the_limit_and_refused_past_it() {
    // The header table is the first level: MAX_NESTING - 1 more fit.
    let fits = RawProperties::new()
        .headers(&RawTable::new().entry(b"d", &RawTable::nested_tables(MAX_NESTING - 1)));
    assert_eq!(check_content_header(&header(&fits.encode())), Ok(()));
    for deep in [
        RawTable::nested_tables(MAX_NESTING),
        RawTable::nested_arrays(MAX_NESTING),
        RawTable::nested_tables(20_000),
    ] {
        let r = refusal(RawProperties::new().headers(&RawTable::new().entry(b"d", &deep)));
        assert_eq!(r.problem, Problem::TooDeep(MAX_NESTING));
        assert!(r.field.starts_with("headers[\"d\"]["), "{}", r.field);
        assert!(
            r.field.ends_with(&format!("({MAX_NESTING} levels)")),
            "{}",
            r.field
        );
    }
}

#[test]
fn unknown_types_lying_lengths_and_leftovers_are_refused() {
    let r = refusal(RawProperties::new().headers(&RawTable::new().entry(b"z", b"Z\x00")));
    assert_eq!(r.problem, Problem::UnknownType(b'Z'));
    assert_eq!(r.field, "headers[\"z\"]");
    assert_eq!(
        r.to_string(),
        "headers[\"z\"] has the unknown field type 'Z' (0x5a)"
    );
    let r = refusal(RawProperties::new().headers_field(vec![0, 0, 1, 0, 1, b'a']));
    assert_eq!(
        r.problem,
        Problem::Truncated {
            wanted: 256,
            left: 2
        }
    );
    let r = refusal(
        RawProperties::new().headers(&RawTable::new().entry(b"a", b"S\x00\x00\x10\x00abc")),
    );
    assert_eq!(
        r.problem,
        Problem::Truncated {
            wanted: 4096,
            left: 3
        }
    );
    let r = refusal(RawProperties::new().message_id(b"ok").trailing(b"junk"));
    assert_eq!(r.problem, Problem::Trailing(4));
    let r = check_content_header(&[0, 60, 0]).unwrap_err();
    assert_eq!(r.field, "content header");
}

/// A `basic.deliver` payload with these strings.
fn deliver(consumer_tag: &[u8], exchange: &[u8], routing_key: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 60, 0, 60];
    out.push(consumer_tag.len() as u8);
    out.extend_from_slice(consumer_tag);
    out.extend_from_slice(&7u64.to_be_bytes());
    out.push(1);
    out.push(exchange.len() as u8);
    out.extend_from_slice(exchange);
    out.push(routing_key.len() as u8);
    out.extend_from_slice(routing_key);
    out
}

#[test]
fn a_delivery_whose_strings_are_utf8_passes() {
    assert_eq!(check_delivery_method(&deliver(b"ctag", b"", b"q")), None);
    assert!(announces_content(&deliver(b"ctag", b"", b"q")));
    // basic.ack: not a message's method.
    assert!(!announces_content(&[0, 60, 0, 80]));
    assert_eq!(check_delivery_method(&[0, 60, 0, 80, 0]), None);
}

#[test]
fn a_routing_key_that_is_not_utf8_is_made_readable() {
    let original = deliver(b"ctag", b"ex", b"key-\xff\xfe");
    let rewritten = check_delivery_method(&original).expect("refused");
    assert_eq!(rewritten.refusal.field, "routing-key");
    assert_eq!(
        rewritten.payload,
        deliver(b"ctag", b"ex", "key-\u{fffd}\u{fffd}".as_bytes())
    );
    assert!(lapin::protocol::parse_class(&original[..]).is_err());
    assert!(lapin::protocol::parse_class(&rewritten.payload[..]).is_ok());
    // A string that grows past 255 bytes as text is cut at a character boundary.
    let long = deliver(b"ctag", &[0xff; 200], b"q");
    let rewritten = check_delivery_method(&long).expect("refused");
    assert_eq!(rewritten.refusal.field, "exchange");
    assert!(lapin::protocol::parse_class(&rewritten.payload[..]).is_ok());
}

/// A field value of random shape, as bytes, at most `depth` levels deep.
fn arb_value(depth: u32) -> impl Strategy<Value = Vec<u8>> {
    let leaf = prop_oneof![
        Just(b"V".to_vec()),
        any::<bool>().prop_map(|b| vec![b't', u8::from(b)]),
        any::<i32>().prop_map(|n| [&[b'I'][..], &n.to_be_bytes()].concat()),
        any::<u64>().prop_map(|n| [&[b'T'][..], &n.to_be_bytes()].concat()),
        proptest::collection::vec(any::<u8>(), 0..8).prop_map(|b| RawTable::long_string(&b)),
    ];
    leaf.prop_recursive(depth, 32, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(|items| {
                let body: Vec<u8> = items.concat();
                [&[b'A'][..], &(body.len() as u32).to_be_bytes(), &body].concat()
            }),
            proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..4), inner), 0..4)
                .prop_map(|entries| {
                    let table = entries
                        .iter()
                        .fold(RawTable::new(), |t, (k, v)| t.entry(k, v));
                    [&[b'F'][..], &(table.0.len() as u32).to_be_bytes(), &table.0].concat()
                }),
        ]
    })
}

proptest! {
    /// The differential: every payload lapin parses, with headers no deeper than the
    /// limit, passes; every one lapin refuses is refused; and nothing panics. Payloads are
    /// well-formed headers with one byte changed, inserted or cut.
    #[test]
    fn the_check_agrees_with_lapin(
        value in arb_value(4),
        key in proptest::collection::vec(any::<u8>(), 0..4),
        id in proptest::collection::vec(any::<u8>(), 0..6),
        edit in 0usize..3,
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let properties = RawProperties::new()
            .message_id(&id)
            .headers(&RawTable::new().entry(&key, &value));
        let mut payload = header(&properties.encode());
        let i = at.index(payload.len());
        match edit {
            0 => payload[i] = byte,
            1 => payload.insert(i, byte),
            _ => payload.truncate(i),
        }
        let ours = check_content_header(&payload);
        if lapin_parses(&payload) {
            // Only the nesting limit refuses more than lapin, and these are shallow.
            prop_assert_eq!(ours, Ok(()));
        } else {
            prop_assert!(ours.is_err());
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = check_content_header(&bytes);
        let _ = check_delivery_method(&bytes);
    }
}
