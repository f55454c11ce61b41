//! Checks AMQP 1.0 encoded bytes without building any value: that they are a valid encoding,
//! and that nothing in them is nested deeper than [`MAX_DEPTH`].
//!
//! serde_amqp decodes a value by recursing once per level of nesting (a list in a list, a
//! described value in a described value), with no limit. On a debug build that is about
//! 9 KB of stack a level: a message nested 250 deep already overflows a 2 MiB thread, and
//! the process aborts; a message a few kilobytes long can be nested thousands deep. So every
//! message is scanned here first, with an explicit stack, and one that fails is never handed
//! to the decoder (see [`crate::tap`]).

use std::fmt;

/// The deepest nesting a message may have, counting each list, map, array and described
/// value (each message section is one). Legitimate messages stay far below it; the decoder
/// survives it with room to spare on a 2 MiB thread, even in a debug build.
pub(crate) const MAX_DEPTH: usize = 64;

/// Why bytes were refused, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// The offset of the byte where the scan stopped.
    pub(crate) at: usize,
    pub(crate) why: Why,
}

/// What was wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// Nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// The bytes end inside a value, or a size runs past its container.
    Truncated,
    /// A byte where a format code was expected is none.
    UnknownFormatCode(u8),
    /// A compound's size is too small for its count, or its values do not fill it exactly.
    SizeMismatch,
    /// A map with an odd number of entries.
    OddMap,
    /// A descriptor that is neither a symbol nor an unsigned long, or an array element
    /// constructor described twice.
    BadDescriptor,
    /// A top-level value that is not a message section.
    NotASection,
    /// A string or symbol that is not UTF-8.
    NotUtf8,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = self.at;
        match self.why {
            Why::TooDeep => write!(f, "nested deeper than {MAX_DEPTH} levels at byte {at}"),
            Why::Truncated => write!(
                f,
                "the encoding ends early or overruns its container at byte {at}"
            ),
            Why::UnknownFormatCode(code) => {
                write!(f, "0x{code:02x} at byte {at} is no AMQP 1.0 format code")
            }
            Why::SizeMismatch => write!(
                f,
                "a compound's size does not match its contents at byte {at}"
            ),
            Why::OddMap => write!(f, "a map with an odd number of entries at byte {at}"),
            Why::BadDescriptor => {
                write!(f, "a descriptor that is not a symbol or ulong at byte {at}")
            }
            Why::NotASection => write!(f, "the value at byte {at} is not a message section"),
            Why::NotUtf8 => write!(f, "a string that is not UTF-8 at byte {at}"),
        }
    }
}

impl std::error::Error for Refusal {}

/// Checks a message: its sections one after another, each a described value whose
/// descriptor names a section (header to footer). Empty bytes are an empty message.
pub(crate) fn check_message(bytes: &[u8]) -> Result<(), Refusal> {
    check(bytes, true)
}

/// Checks a run of encoded values, one after another.
pub(crate) fn check_values(bytes: &[u8]) -> Result<(), Refusal> {
    check(bytes, false)
}

/// The section descriptors, by code (0x70 to 0x78) and by name.
const SECTION_NAMES: [&[u8]; 9] = [
    b"amqp:header:list",
    b"amqp:delivery-annotations:map",
    b"amqp:message-annotations:map",
    b"amqp:properties:list",
    b"amqp:application-properties:map",
    b"amqp:data:binary",
    b"amqp:amqp-sequence:list",
    b"amqp:amqp-value:*",
    b"amqp:footer:map",
];

/// What remains to be read of an open container.
#[derive(Clone, Copy, Debug)]
enum Open {
    /// `left` whole values (constructor and data): a list's or map's, or the one value of a
    /// described value.
    Values { left: u64 },
    /// `left` array elements, each the data of format code `code`.
    Elements { left: u64, code: u8 },
}

#[derive(Clone, Copy, Debug)]
struct Frame {
    open: Open,
    /// Where the container ends, if it says (a described value does not).
    end: Option<usize>,
    /// No read may go past this: the nearest end of this or an enclosing container.
    limit: usize,
    /// Levels of nesting, this one included.
    depth: usize,
}

struct Scan<'a> {
    bytes: &'a [u8],
    pos: usize,
    stack: Vec<Frame>,
}

fn check(bytes: &[u8], sections: bool) -> Result<(), Refusal> {
    let mut scan = Scan {
        bytes,
        pos: 0,
        stack: Vec::new(),
    };
    while scan.pos < bytes.len() {
        if sections {
            scan.section()?;
        } else {
            scan.open(Open::Values { left: 1 }, None, 0)?;
        }
        scan.run()?;
    }
    Ok(())
}

impl Scan<'_> {
    fn refuse(&self, at: usize, why: Why) -> Refusal {
        Refusal { at, why }
    }

    /// The end no read may pass.
    fn limit(&self) -> usize {
        self.stack.last().map_or(self.bytes.len(), |f| f.limit)
    }

    fn take(&mut self, n: usize) -> Result<&[u8], Refusal> {
        let start = self.pos;
        match start.checked_add(n) {
            Some(end) if end <= self.limit() => {
                self.pos = end;
                Ok(&self.bytes[start..end])
            }
            _ => Err(self.refuse(start, Why::Truncated)),
        }
    }

    fn byte(&mut self) -> Result<u8, Refusal> {
        Ok(self.take(1)?[0])
    }

    fn width(&mut self, wide: bool) -> Result<usize, Refusal> {
        if wide {
            let b = self.take(4)?;
            Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
        } else {
            Ok(usize::from(self.byte()?))
        }
    }

    /// Opens a container one level below the current one (`extra` more for an array of
    /// described elements). `end` is where its size says it ends.
    fn open(&mut self, open: Open, end: Option<usize>, extra: usize) -> Result<(), Refusal> {
        let at = self.pos;
        let depth = self.stack.last().map_or(0, |f| f.depth) + 1 + extra;
        if depth > MAX_DEPTH {
            return Err(self.refuse(at, Why::TooDeep));
        }
        let limit = end.unwrap_or_else(|| self.limit());
        self.stack.push(Frame {
            open,
            end,
            limit,
            depth,
        });
        Ok(())
    }

    /// A section's constructor: `0x00` and a section descriptor. Its value is read next.
    fn section(&mut self) -> Result<(), Refusal> {
        let at = self.pos;
        if self.byte()? != 0x00 {
            return Err(self.refuse(at, Why::NotASection));
        }
        let descriptor = self.pos;
        let code = self.byte()?;
        let known = match code {
            0x53 => (0x70..=0x78).contains(&self.byte()?),
            0x80 => {
                let b = self.take(8)?;
                (0x70..=0x78).contains(&u64::from_be_bytes([
                    b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
                ]))
            }
            0xa3 | 0xb3 => {
                let n = self.width(code == 0xb3)?;
                let name = self.take(n)?;
                SECTION_NAMES.contains(&name)
            }
            _ => false,
        };
        if !known {
            return Err(self.refuse(descriptor, Why::NotASection));
        }
        self.open(Open::Values { left: 1 }, None, 0)
    }

    /// A descriptor: a symbol or an unsigned long, as serde_amqp reads them.
    fn descriptor(&mut self) -> Result<(), Refusal> {
        let at = self.pos;
        match self.byte()? {
            0x44 => Ok(()),
            0x53 => self.take(1).map(drop),
            0x80 => self.take(8).map(drop),
            code @ (0xa3 | 0xb3) => {
                let n = self.width(code == 0xb3)?;
                let symbol = self.take(n)?;
                if std::str::from_utf8(symbol).is_err() {
                    return Err(self.refuse(at, Why::NotUtf8));
                }
                Ok(())
            }
            _ => Err(self.refuse(at, Why::BadDescriptor)),
        }
    }

    /// Reads values until the container opened last (and every one it opens) is complete.
    fn run(&mut self) -> Result<(), Refusal> {
        while let Some(&frame) = self.stack.last() {
            let top = self.stack.len() - 1;
            match frame.open {
                Open::Values { left: 0 } | Open::Elements { left: 0, .. } => {
                    if frame.end.is_some_and(|end| end != self.pos) {
                        return Err(self.refuse(self.pos, Why::SizeMismatch));
                    }
                    self.stack.pop();
                }
                Open::Values { left } => {
                    self.stack[top].open = Open::Values { left: left - 1 };
                    self.value()?;
                }
                Open::Elements { left, code } => match fixed_width(code) {
                    Some(width) => {
                        // Every element at once: zero-width ones may be counted in billions.
                        let n = usize::try_from(left)
                            .ok()
                            .and_then(|n| n.checked_mul(width))
                            .ok_or_else(|| self.refuse(self.pos, Why::Truncated))?;
                        self.stack[top].open = Open::Elements { left: 0, code };
                        self.take(n)?;
                    }
                    None => {
                        self.stack[top].open = Open::Elements {
                            left: left - 1,
                            code,
                        };
                        self.data(code, self.pos)?;
                    }
                },
            }
        }
        Ok(())
    }

    /// One whole value: its constructor, then its data.
    fn value(&mut self) -> Result<(), Refusal> {
        let at = self.pos;
        match self.byte()? {
            0x00 => {
                self.descriptor()?;
                self.open(Open::Values { left: 1 }, None, 0)
            }
            code => self.data(code, at),
        }
    }

    /// The data of a value of format code `code`, whose constructor was at `at`.
    fn data(&mut self, code: u8, at: usize) -> Result<(), Refusal> {
        if let Some(width) = fixed_width(code) {
            return self.take(width).map(drop);
        }
        match code {
            0xa0 | 0xa1 | 0xa3 | 0xb0 | 0xb1 | 0xb3 => {
                let n = self.width(code & 0xf0 == 0xb0)?;
                let data = self.take(n)?;
                if code & 0x0f != 0 && std::str::from_utf8(data).is_err() {
                    return Err(self.refuse(at, Why::NotUtf8));
                }
                Ok(())
            }
            0xc0 | 0xc1 | 0xd0 | 0xd1 | 0xe0 | 0xf0 => {
                let wide = code & 0xf0 != 0xc0 && code != 0xe0;
                let size = self.width(wide)?;
                let end = self
                    .pos
                    .checked_add(size)
                    .filter(|end| *end <= self.limit())
                    .ok_or_else(|| self.refuse(at, Why::Truncated))?;
                let count_at = self.pos;
                let count = self.width(wide)?;
                if self.pos > end {
                    return Err(self.refuse(count_at, Why::SizeMismatch));
                }
                if code == 0xe0 || code == 0xf0 {
                    return self.array(count, end);
                }
                // Every value takes a byte at least.
                if count > end - self.pos {
                    return Err(self.refuse(count_at, Why::SizeMismatch));
                }
                if code & 0x0f == 1 && count % 2 != 0 {
                    return Err(self.refuse(at, Why::OddMap));
                }
                self.open(Open::Values { left: count as u64 }, Some(end), 0)
            }
            other => Err(self.refuse(at, Why::UnknownFormatCode(other))),
        }
    }

    /// An array after its size and count: the element constructor, then the elements.
    fn array(&mut self, count: usize, end: usize) -> Result<(), Refusal> {
        let at = self.pos;
        let mut code = self.take_within(end)?;
        let mut extra = 0;
        if code == 0x00 {
            self.descriptor()?;
            code = self.take_within(end)?;
            if code == 0x00 {
                return Err(self.refuse(at, Why::BadDescriptor));
            }
            extra = 1;
        }
        if !is_format_code(code) {
            return Err(self.refuse(at, Why::UnknownFormatCode(code)));
        }
        if fixed_width(code).is_none() && count > end.saturating_sub(self.pos) {
            return Err(self.refuse(at, Why::SizeMismatch));
        }
        self.open(
            Open::Elements {
                left: count as u64,
                code,
            },
            Some(end),
            extra,
        )
    }

    fn take_within(&mut self, end: usize) -> Result<u8, Refusal> {
        if self.pos >= end {
            return Err(self.refuse(self.pos, Why::SizeMismatch));
        }
        self.byte()
    }
}

/// Whether `code` is one of AMQP 1.0's format codes (`0x00`, the described-type marker,
/// is not).
fn is_format_code(code: u8) -> bool {
    fixed_width(code).is_some()
        || matches!(
            code,
            0xa0 | 0xa1 | 0xa3 | 0xb0 | 0xb1 | 0xb3 | 0xc0 | 0xc1 | 0xd0 | 0xd1 | 0xe0 | 0xf0
        )
}

/// The data width of a fixed-width format code; `None` for variable-width, compound and
/// array codes and for anything that is not a format code.
fn fixed_width(code: u8) -> Option<usize> {
    match code {
        0x40..=0x45 => Some(0),
        0x50..=0x56 => Some(1),
        0x60 | 0x61 => Some(2),
        0x70..=0x74 => Some(4),
        0x80..=0x84 => Some(8),
        0x94 | 0x98 => Some(16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
