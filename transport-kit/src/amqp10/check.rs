//! The check of AMQP 1.0 encoded bytes before a decoder sees them: that they are a valid
//! encoding, and that nothing in them is nested deeper than
//! [`MAX_DEPTH`](super::MAX_DEPTH), without building any value.
//!
//! fe2o3-amqp's decoder (serde_amqp) recurses once per level of nesting (a list in a list, a
//! described value in a described value), with no limit. On a debug build that is about
//! 9 KB of stack a level: a message nested 250 deep already overflows a 2 MiB thread, and
//! the process aborts; a message a few kilobytes long can be nested thousands deep. The
//! check reads the same bytes with an explicit stack instead: bytes it passes are safe to
//! decode, and bytes it refuses need never be.

use super::walk::{Reader, Refusal, Rules, Walk};

/// Checks an AMQP 1.0 message: its sections one after another, each a described value whose
/// descriptor names a section (`header` to `footer`, by code or by name), and each a valid
/// encoding nested no deeper than [`MAX_DEPTH`](super::MAX_DEPTH), the section counting one
/// level. Empty bytes are an empty message.
///
/// # Errors
///
/// The first thing wrong, and where: a [`Refusal`].
pub fn check_message(bytes: &[u8]) -> Result<(), Refusal> {
    let mut walk = Walk::new(Reader::new(bytes), Rules::Strict);
    while !walk.at_end() {
        walk.section()?;
    }
    Ok(())
}

/// Checks a run of AMQP 1.0 encoded values, one after another, each a valid encoding nested
/// no deeper than [`MAX_DEPTH`](super::MAX_DEPTH), the run counting one level. Empty bytes
/// are an empty run.
///
/// # Errors
///
/// The first thing wrong, and where: a [`Refusal`].
pub fn check_values(bytes: &[u8]) -> Result<(), Refusal> {
    let mut walk = Walk::new(Reader::new(bytes), Rules::Strict);
    while !walk.at_end() {
        walk.values(1)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp10::{MAX_DEPTH, Why};
    use fe2o3_amqp::types::messaging::message::__private::{Deserializable, Serializable};
    use fe2o3_amqp::types::messaging::{
        AmqpSequence, AmqpValue, ApplicationProperties, Body, Data, Header, Message,
        MessageAnnotations, Properties,
    };
    use fe2o3_amqp::types::primitives::{
        Array, Binary, OrderedMap, Symbol, Timestamp, Uuid, Value,
    };
    use serde_amqp::described::Described;
    use serde_amqp::descriptor::Descriptor;

    /// Lists (list32, one element each) nested `depth` deep around an empty one.
    fn nested_lists(depth: usize) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(9 * depth + 1);
        for level in 0..depth {
            // The count, then the levels inside this one, then the empty list.
            let size = 4 + 9 * (depth - level - 1) + 1;
            bytes.push(0xd0);
            bytes.extend_from_slice(&u32::try_from(size).unwrap().to_be_bytes());
            bytes.extend_from_slice(&1u32.to_be_bytes());
        }
        bytes.push(0x45);
        bytes
    }

    fn value_section(value: &[u8]) -> Vec<u8> {
        let mut s = vec![0x00, 0x53, 0x77];
        s.extend_from_slice(value);
        s
    }

    fn decodes(bytes: &[u8]) -> bool {
        serde_amqp::from_slice::<Deserializable<Message<Body<Value>>>>(bytes).is_ok()
    }

    fn every_kind_of_value() -> Value {
        let mut map = OrderedMap::new();
        map.insert(Value::Symbol(Symbol::from("k")), Value::Long(-5));
        map.insert(Value::String("s".into()), Value::List(vec![Value::Null]));
        Value::List(vec![
            Value::Null,
            Value::Bool(true),
            Value::Bool(false),
            Value::Ubyte(7),
            Value::Ushort(700),
            Value::Uint(0),
            Value::Uint(70_000),
            Value::Ulong(0),
            Value::Ulong(u64::MAX),
            Value::Byte(-1),
            Value::Short(-300),
            Value::Int(-70_000),
            Value::Long(i64::MIN),
            Value::from(1.5f32),
            Value::from(2.5f64),
            Value::Char('é'),
            Value::Timestamp(Timestamp::from_milliseconds(1_700_000_000_000)),
            Value::Uuid(Uuid::from([7u8; 16])),
            Value::Binary(Binary::from(vec![0u8; 300])),
            Value::String("ü".repeat(200)),
            Value::Symbol(Symbol::from("sym")),
            Value::List(vec![]),
            Value::Map(map),
            Value::Array(Array::from(vec![Value::Int(1), Value::Int(2)])),
            Value::Array(Array::from(vec![Value::String("a".into()); 3])),
            Value::Described(Box::new(Described {
                descriptor: Descriptor::Name(Symbol::from("x:y")),
                value: Value::Ulong(3),
            })),
            Value::Described(Box::new(Described {
                descriptor: Descriptor::Code(0x1234),
                value: Value::List(vec![Value::Int(9)]),
            })),
        ])
    }

    #[test]
    fn every_section_and_value_serde_amqp_writes_is_accepted() {
        let message = Message {
            header: Some(Header {
                durable: true,
                ..Header::default()
            }),
            delivery_annotations: None,
            message_annotations: Some(MessageAnnotations::default()),
            properties: Some(Properties {
                message_id: Some("id".to_string().into()),
                ..Properties::default()
            }),
            application_properties: Some(ApplicationProperties::default()),
            body: Body::Value(AmqpValue(every_kind_of_value())),
            footer: None,
        };
        let bytes = serde_amqp::to_vec(&Serializable(message)).expect("encodes");
        assert_eq!(check_message(&bytes), Ok(()));
        assert!(decodes(&bytes));

        for body in [
            Body::<Value>::Data(vec![Data(Binary::from(b"x".to_vec()))].into()),
            Body::Sequence(vec![AmqpSequence(vec![every_kind_of_value()])].into()),
            Body::Empty,
        ] {
            let message = Message {
                header: None,
                delivery_annotations: None,
                message_annotations: None,
                properties: None,
                application_properties: None,
                body,
                footer: None,
            };
            let bytes = serde_amqp::to_vec(&Serializable(message)).expect("encodes");
            assert_eq!(check_message(&bytes), Ok(()), "{bytes:02x?}");
        }
        let value = serde_amqp::to_vec(&every_kind_of_value()).expect("encodes");
        assert_eq!(check_values(&value), Ok(()));
    }

    #[test]
    fn nesting_is_accepted_up_to_the_limit_and_refused_past_it() {
        // The section is one level.
        let deepest = value_section(&nested_lists(MAX_DEPTH - 2));
        assert_eq!(check_message(&deepest), Ok(()));
        assert!(
            decodes(&deepest),
            "the deepest accepted message still decodes"
        );

        let too_deep = value_section(&nested_lists(MAX_DEPTH));
        let refused = check_message(&too_deep).expect_err("too deep");
        assert_eq!(refused.why, Why::TooDeep);

        let far_too_deep = value_section(&nested_lists(100_000));
        assert_eq!(
            check_message(&far_too_deep).map_err(|r| r.why),
            Err(Why::TooDeep)
        );
    }

    #[test]
    fn described_chains_and_arrays_count_as_nesting() {
        // 0x00 0x53 0x01 repeated: a described value whose value is described, and so on.
        let mut chain = Vec::new();
        for _ in 0..MAX_DEPTH * 2 {
            chain.extend_from_slice(&[0x00, 0x53, 0x01]);
        }
        chain.push(0x40);
        assert_eq!(check_values(&chain).map_err(|r| r.why), Err(Why::TooDeep));

        // Arrays of arrays of arrays...
        let mut inner = vec![0xe0, 2, 1, 0x40];
        for _ in 0..MAX_DEPTH {
            let mut outer = vec![0xf0];
            // Its count, its element constructor, and the element's data.
            let size = u32::try_from(4 + 1 + (inner.len() - 1)).unwrap();
            outer.extend_from_slice(&size.to_be_bytes());
            outer.extend_from_slice(&1u32.to_be_bytes());
            outer.push(inner[0]);
            outer.extend_from_slice(&inner[1..]);
            inner = outer;
        }
        assert_eq!(check_values(&inner).map_err(|r| r.why), Err(Why::TooDeep));
    }

    #[test]
    fn broken_encodings_are_refused_where_they_break() {
        let refused = |bytes: &[u8]| check_values(bytes).map_err(|r| r.why);
        assert_eq!(refused(&[0xff]), Err(Why::UnknownFormatCode(0xff)));
        assert_eq!(refused(&[0xa1, 5, b'a']), Err(Why::Truncated));
        assert_eq!(
            refused(&[0xb0, 0xff, 0xff, 0xff, 0xff]),
            Err(Why::Truncated)
        );
        assert_eq!(refused(&[0x70, 1, 2]), Err(Why::Truncated));
        // A list8 whose size leaves room for one value but claims two.
        assert_eq!(refused(&[0xc0, 2, 2, 0x40]), Err(Why::SizeMismatch));
        // A list8 whose one value is shorter than its size.
        assert_eq!(refused(&[0xc0, 3, 1, 0x40, 0x40]), Err(Why::SizeMismatch));
        assert_eq!(refused(&[0xc1, 2, 1, 0x40]), Err(Why::OddMap));
        assert_eq!(refused(&[0xa1, 2, 0xc3, 0x28]), Err(Why::NotUtf8));
        assert_eq!(refused(&[0x00, 0x41, 0x40]), Err(Why::BadDescriptor));
        // An array whose elements overrun it, and one of a billion nulls in three bytes.
        assert_eq!(refused(&[0xe0, 2, 3, 0x50, 1]), Err(Why::Truncated));
        assert_eq!(
            check_values(&[0xf0, 0, 0, 0, 5, 0x7f, 0xff, 0xff, 0xff, 0x40]),
            Ok(())
        );
        // Sections: only the nine section descriptors.
        assert_eq!(
            check_message(&[0x40]).map_err(|r| r.why),
            Err(Why::NotASection)
        );
        assert_eq!(
            check_message(&[0x00, 0x53, 0x10, 0x45]).map_err(|r| r.why),
            Err(Why::NotASection)
        );
        assert_eq!(check_message(&[]), Ok(()));
    }

    #[test]
    fn a_refused_payload_replaced_by_one_invalid_byte_fails_to_decode() {
        assert!(!decodes(&[0xff]));
    }

    #[test]
    fn random_bytes_never_panic_and_what_passes_is_shallow() {
        // A cheap deterministic generator: every refusal or acceptance must come back
        // without a panic, and anything accepted must decode without deep recursion.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let len = (next() % 64) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    let r = next();
                    // Bias towards format codes that open containers.
                    match r % 4 {
                        0 => {
                            [0x00, 0x45, 0xc0, 0xd0, 0xe0, 0x53, 0x77, 0x40][(r >> 8) as usize % 8]
                        }
                        _ => (r >> 16) as u8,
                    }
                })
                .collect();
            if check_message(&bytes).is_ok() {
                let _ = decodes(&bytes);
            }
            let _ = check_values(&bytes);
        }
    }
}
