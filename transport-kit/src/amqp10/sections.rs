//! The AMQP 1.0 message sections RabbitMQ 3.x hands AMQP 0-9-1 clients, decoded and
//! encoded.
//!
//! A message published over AMQP 1.0 reaches an AMQP 0-9-1 consumer of RabbitMQ 3.x with
//! its `application-properties` section in one header, [`APP_PROPERTIES_HEADER`], and its
//! `properties` section in another, [`PROPERTIES_HEADER`]: each holds the section's AMQP 1.0
//! encoding (a described value) as a long string. The application properties are where the
//! AMQP 1.0 transport keeps the engine's headers, so this module decodes that section into
//! [`Headers`], and reads the message id from the properties section.
//!
//! The bytes come from the network. Each value in a section is stepped over by the walk
//! under its lenient rules, which follow described values no deeper than
//! [`MAX_DESCRIBED`](super::MAX_DESCRIBED) and never look inside a list, map or array, then
//! decoded from the bytes it measured. A value of a type application properties should not
//! hold (a list, a map, an array, a described value, a decimal) or that does not decode (a
//! string that is not UTF-8, a negative timestamp, ...) is kept as its raw encoding in
//! [`HeaderValue::Bytes`], which the engine reads as a malformed header; the other entries
//! still decode. Only input whose structure cannot be followed is an error.

use std::fmt::Write as _;

use retry_core::{HeaderValue, Headers, Timestamp};

use super::codes::{APPLICATION_PROPERTIES, PROPERTIES};
use super::walk::{Reader, Refusal, Why};

/// The header in which RabbitMQ 3.x hands AMQP 0-9-1 consumers an AMQP 1.0 message's
/// encoded `application-properties` section, and from which it reads one for AMQP 1.0
/// consumers of an AMQP 0-9-1 message.
pub const APP_PROPERTIES_HEADER: &str = "x-amqp-1.0-app-properties";

/// The header in which RabbitMQ 3.x hands AMQP 0-9-1 consumers an AMQP 1.0 message's
/// encoded `properties` section.
pub const PROPERTIES_HEADER: &str = "x-amqp-1.0-properties";

/// Why a section does not decode. Positions are byte offsets into the section.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SectionError {
    /// The header holding the section is not a string of bytes.
    #[error("the header is not a string of bytes")]
    NotBytes,
    /// The bytes end inside a value, or a size points past them.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// The descriptor is not the expected section's.
    #[error("not the expected section: descriptor at byte {0}")]
    WrongSection(usize),
    /// A format code that is reserved, or not allowed where it is.
    #[error("unexpected format code {code:#04x} at byte {at}")]
    Unexpected {
        /// The format code.
        code: u8,
        /// Where it is.
        at: usize,
    },
    /// A compound's count does not fit its size, or its elements do not fill it exactly.
    #[error("size and count disagree in the compound at byte {0}")]
    BadSize(usize),
    /// Described values nested more than [`MAX_DESCRIBED`](super::MAX_DESCRIBED) deep.
    #[error("described values nested too deeply at byte {0}")]
    TooDeep(usize),
    /// Bytes after the section.
    #[error("{0} bytes after the section")]
    Trailing(usize),
}

/// The error for a refusal of the reader, or of the walk under its lenient rules: they
/// refuse only bytes that end early, described values nested too deep and bytes below
/// `0x40` where a format code should be.
fn stepping(refusal: Refusal) -> SectionError {
    match refusal.why {
        Why::TooDeep => SectionError::TooDeep(refusal.at),
        Why::UnknownFormatCode(code) => SectionError::Unexpected {
            code,
            at: refusal.at,
        },
        _ => SectionError::Truncated(refusal.at),
    }
}

/// Decoded application properties.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AppProperties {
    /// The entries, by name.
    pub headers: Headers,
    /// Entries left out because their key is not a UTF-8 string or symbol.
    pub dropped: usize,
}

/// An AMQP 1.0 `message-id` as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageId {
    /// A string id as it is; a `ulong` in decimal, a `uuid` hyphenated, `binary` in
    /// lowercase hex.
    pub text: String,
    /// Whether the id is a string. RabbitMQ 3.x copies a string id into the AMQP 0-9-1
    /// `message-id` property, and a `uuid` or `binary` one as its raw bytes.
    pub is_string: bool,
}

/// Decodes an encoded `application-properties` section: its descriptor (`0x74` or
/// `amqp:application-properties:map`), then `null` or a map of string keys to values.
///
/// A later duplicate key replaces an earlier one. An entry whose key is not a UTF-8 string
/// or symbol is left out and counted in [`AppProperties::dropped`].
///
/// # Errors
///
/// A [`SectionError`] when the section's structure cannot be followed: a wrong descriptor,
/// a size or count the bytes do not bear out, bytes after it.
pub fn decode_application_properties(bytes: &[u8]) -> Result<AppProperties, SectionError> {
    let mut r = Reader::new(bytes);
    expect_section(&mut r, APPLICATION_PROPERTIES)?;
    let at = r.pos();
    let mut decoded = AppProperties::default();
    match r.byte().map_err(stepping)? {
        0x40 => {}
        code @ (0xc1 | 0xd1) => {
            let (mut map, count) = compound(&mut r, code == 0xd1, at)?;
            if count % 2 != 0 {
                return Err(SectionError::BadSize(at));
            }
            for _ in 0..count / 2 {
                let key = key(&mut map)?;
                let value = value(&mut map)?;
                match key {
                    // A later duplicate replaces an earlier one, as in a field table.
                    Some(key) => {
                        decoded.headers.insert(key, value);
                    }
                    None => decoded.dropped += 1,
                }
            }
            if map.remaining() != 0 {
                return Err(SectionError::BadSize(at));
            }
        }
        code => return Err(SectionError::Unexpected { code, at }),
    }
    finish_section(&r)?;
    Ok(decoded)
}

/// Reads the `message-id` of an encoded `properties` section: its descriptor (`0x73` or
/// `amqp:properties:list`), then a list whose first element is the id.
///
/// `Ok(None)` when the list is empty, the id is null, or it is of a type a message id
/// cannot have. The fields after the id are not read, only stepped over by the list's size.
///
/// # Errors
///
/// A [`SectionError`] when the section's structure cannot be followed.
pub fn decode_message_id(bytes: &[u8]) -> Result<Option<MessageId>, SectionError> {
    let mut r = Reader::new(bytes);
    expect_section(&mut r, PROPERTIES)?;
    let at = r.pos();
    let id = match r.byte().map_err(stepping)? {
        0x45 => None,
        code @ (0xc0 | 0xd0) => {
            let (mut list, count) = compound(&mut r, code == 0xd0, at)?;
            if count == 0 {
                None
            } else {
                message_id(list.step().map_err(stepping)?)
            }
        }
        code => return Err(SectionError::Unexpected { code, at }),
    };
    finish_section(&r)?;
    Ok(id)
}

/// The text of one encoded `message-id` value.
fn message_id(raw: &[u8]) -> Option<MessageId> {
    let &code = raw.first()?;
    let text = match decode_value(raw)? {
        HeaderValue::Str(s) if matches!(code, 0xa1 | 0xb1) => {
            return Some(MessageId {
                text: s,
                is_string: true,
            });
        }
        HeaderValue::Int(n) if matches!(code, 0x80 | 0x53 | 0x44) => n.to_string(),
        HeaderValue::UInt(n) if code == 0x80 => n.to_string(),
        // A uuid is 16 bytes wide: the reader hands no other width under its code.
        HeaderValue::Bytes(b) if code == 0x98 => hyphenated(b.as_slice().try_into().ok()?),
        HeaderValue::Bytes(b) if matches!(code, 0xa0 | 0xb0) => hex(&b),
        _ => return None,
    };
    Some(MessageId {
        text,
        is_string: false,
    })
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// An AMQP 1.0 uuid's 16 bytes as text, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as the
/// engine shows a uuid message id or header value.
///
/// ```
/// let text = transport_kit::amqp10::hyphenated(&[0xab; 16]);
/// assert_eq!(text, "abababab-abab-abab-abab-abababababab");
/// ```
pub fn hyphenated(bytes: &[u8; 16]) -> String {
    let mut out = String::with_capacity(36);
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Reads a section's descriptor, which must name `section` (by code or by name).
fn expect_section(r: &mut Reader<'_>, section: u64) -> Result<(), SectionError> {
    let at = r.pos();
    if r.byte().map_err(stepping)? != 0x00 {
        return Err(SectionError::WrongSection(at));
    }
    match r.section().map_err(stepping)? {
        Some(code) if code == section => Ok(()),
        _ => Err(SectionError::WrongSection(at)),
    }
}

/// The body of a list or map whose constructor (at `at`) was just read: a reader over its
/// elements, and their count, checked against the bytes that hold them.
fn compound<'a>(
    r: &mut Reader<'a>,
    wide: bool,
    at: usize,
) -> Result<(Reader<'a>, usize), SectionError> {
    let size = r.size(wide).map_err(stepping)?;
    let mut inner = r.split(size).map_err(stepping)?;
    let count = inner.size(wide).map_err(stepping)?;
    // Every element takes at least one byte.
    if count > inner.remaining() {
        return Err(SectionError::BadSize(at));
    }
    Ok((inner, count))
}

/// Checks that nothing follows the section.
fn finish_section(r: &Reader<'_>) -> Result<(), SectionError> {
    match r.remaining() {
        0 => Ok(()),
        n => Err(SectionError::Trailing(n)),
    }
}

/// One map key: a string or symbol, `None` for any other value (stepped over).
fn key(map: &mut Reader<'_>) -> Result<Option<String>, SectionError> {
    let content = match map.step().map_err(stepping)? {
        [0xa1 | 0xa3, _, content @ ..] => content,
        [0xb1 | 0xb3, _, _, _, _, content @ ..] => content,
        _ => return Ok(None),
    };
    Ok(std::str::from_utf8(content).ok().map(str::to_owned))
}

/// One value: decoded, or its raw encoding when it is of another type or does not
/// decode.
fn value(map: &mut Reader<'_>) -> Result<HeaderValue, SectionError> {
    let raw = map.step().map_err(stepping)?;
    Ok(decode_value(raw).unwrap_or_else(|| HeaderValue::Bytes(raw.to_vec())))
}

fn fixed<const N: usize>(body: &[u8]) -> Option<[u8; N]> {
    body.try_into().ok()
}

/// Decodes one encoded primitive value, `raw` being exactly its bytes (as [`Reader::step`]
/// measured them); `None` for a type this module does not decode or a value that is not
/// valid.
fn decode_value(raw: &[u8]) -> Option<HeaderValue> {
    let (&code, body) = raw.split_first()?;
    let int = |n: i64| Some(HeaderValue::Int(n));
    match code {
        0x40 => Some(HeaderValue::Null),
        0x41 => Some(HeaderValue::Bool(true)),
        0x42 => Some(HeaderValue::Bool(false)),
        0x56 => match body {
            [0] => Some(HeaderValue::Bool(false)),
            [1] => Some(HeaderValue::Bool(true)),
            _ => None,
        },
        // Unsigned.
        0x43 | 0x44 => int(0),
        0x50 | 0x52 | 0x53 => int(i64::from(fixed::<1>(body)?[0])),
        0x60 => int(i64::from(u16::from_be_bytes(fixed(body)?))),
        0x70 => int(i64::from(u32::from_be_bytes(fixed(body)?))),
        0x80 => {
            let n = u64::from_be_bytes(fixed(body)?);
            Some(match i64::try_from(n) {
                Ok(n) => HeaderValue::Int(n),
                Err(_) => HeaderValue::UInt(n),
            })
        }
        // Signed.
        0x51 | 0x54 | 0x55 => int(i64::from(i8::from_be_bytes(fixed(body)?))),
        0x61 => int(i64::from(i16::from_be_bytes(fixed(body)?))),
        0x71 => int(i64::from(i32::from_be_bytes(fixed(body)?))),
        0x81 => int(i64::from_be_bytes(fixed(body)?)),
        0x72 => Some(HeaderValue::Float(f64::from(f32::from_be_bytes(fixed(
            body,
        )?)))),
        0x82 => Some(HeaderValue::Float(f64::from_be_bytes(fixed(body)?))),
        // Milliseconds since the epoch; the engine's timestamps start there.
        0x83 => {
            let ms = i64::from_be_bytes(fixed(body)?);
            u64::try_from(ms)
                .ok()
                .map(|ms| HeaderValue::Timestamp(Timestamp::from_millis(ms)))
        }
        // A UTF-32 code point.
        0x73 => char::from_u32(u32::from_be_bytes(fixed(body)?))
            .map(|c| HeaderValue::Str(c.to_string())),
        0x98 => Some(HeaderValue::Bytes(fixed::<16>(body)?.to_vec())),
        0xa0 | 0xb0 => Some(HeaderValue::Bytes(variable(code, body)?.to_vec())),
        0xa1 | 0xb1 | 0xa3 | 0xb3 => std::str::from_utf8(variable(code, body)?)
            .ok()
            .map(|s| HeaderValue::Str(s.to_owned())),
        _ => None,
    }
}

/// The content of a variable-width value after its size (one byte for 0xaX, four for
/// 0xbX), checked against that size.
fn variable(code: u8, body: &[u8]) -> Option<&[u8]> {
    let (size, content) = if code >> 4 == 0xa {
        let (&n, rest) = body.split_first()?;
        (usize::from(n), rest)
    } else {
        let (n, rest) = body.split_first_chunk::<4>()?;
        (usize::try_from(u32::from_be_bytes(*n)).ok()?, rest)
    };
    (content.len() == size).then_some(content)
}

/// Encodes `entries` as an `application-properties` section, as RabbitMQ 3.x reads one from
/// [`APP_PROPERTIES_HEADER`] when it hands an AMQP 0-9-1 message to an AMQP 1.0 consumer.
/// Application properties hold only simple values: arrays and tables are left out, and
/// their names returned.
pub fn encode_application_properties<'h>(
    entries: impl IntoIterator<Item = (&'h str, &'h HeaderValue)>,
) -> (Vec<u8>, Vec<&'h str>) {
    let mut body = Vec::new();
    let mut count = 0usize;
    let mut left_out = Vec::new();
    for (name, value) in entries {
        let start = body.len();
        variable_width(&mut body, 0xa1, name.as_bytes());
        if encode_value(&mut body, value) {
            count += 2;
        } else {
            body.truncate(start);
            left_out.push(name);
        }
    }
    let mut out = vec![0x00, 0x53, APPLICATION_PROPERTIES as u8];
    match (u8::try_from(body.len() + 1), u8::try_from(count)) {
        (Ok(size), Ok(count)) => out.extend([0xc1, size, count]),
        _ => {
            // A map32's size counts its four count bytes; a section over 4 GiB cannot reach
            // here through a broker's frame size.
            let size = u32::try_from(body.len() + 4).unwrap_or(u32::MAX);
            out.push(0xd1);
            out.extend(size.to_be_bytes());
            out.extend(u32::try_from(count).unwrap_or(u32::MAX).to_be_bytes());
        }
    }
    out.extend(body);
    (out, left_out)
}

/// Appends a string, symbol or binary value: `short_code` (0xa1, 0xa3, 0xa0) with a one-byte
/// size, or its four-byte-size form (0xbX) when longer than 255 bytes.
fn variable_width(out: &mut Vec<u8>, short_code: u8, content: &[u8]) {
    match u8::try_from(content.len()) {
        Ok(n) => out.extend([short_code, n]),
        Err(_) => {
            out.push(short_code + 0x10);
            out.extend(
                u32::try_from(content.len())
                    .unwrap_or(u32::MAX)
                    .to_be_bytes(),
            );
        }
    }
    out.extend_from_slice(content);
}

/// Appends one simple value; `false` for an array or a table, which application properties
/// cannot hold.
fn encode_value(out: &mut Vec<u8>, value: &HeaderValue) -> bool {
    match value {
        HeaderValue::Null => out.push(0x40),
        HeaderValue::Bool(true) => out.push(0x41),
        HeaderValue::Bool(false) => out.push(0x42),
        HeaderValue::Int(n) => match i8::try_from(*n) {
            Ok(small) => out.extend([0x55, small.to_be_bytes()[0]]),
            Err(_) => {
                out.push(0x81);
                out.extend(n.to_be_bytes());
            }
        },
        HeaderValue::UInt(n) => {
            out.push(0x80);
            out.extend(n.to_be_bytes());
        }
        HeaderValue::Float(x) => {
            out.push(0x82);
            out.extend(x.to_be_bytes());
        }
        HeaderValue::Str(s) => variable_width(out, 0xa1, s.as_bytes()),
        HeaderValue::Bytes(b) => variable_width(out, 0xa0, b),
        HeaderValue::Timestamp(t) => {
            out.push(0x83);
            out.extend(
                i64::try_from(t.as_millis())
                    .unwrap_or(i64::MAX)
                    .to_be_bytes(),
            );
        }
        HeaderValue::Array(_) | HeaderValue::Table(_) => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DESCRIPTOR: [u8; 3] = [0x00, 0x53, 0x74];

    fn str8(s: &str) -> Vec<u8> {
        let mut out = vec![0xa1, u8::try_from(s.len()).unwrap()];
        out.extend_from_slice(s.as_bytes());
        out
    }

    /// An application-properties section, map8, of these encoded keys and values.
    fn section(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![u8::try_from(entries.len() * 2).unwrap()];
        for (k, v) in entries {
            body.extend_from_slice(k);
            body.extend_from_slice(v);
        }
        let mut out = DESCRIPTOR.to_vec();
        out.push(0xc1);
        out.push(u8::try_from(body.len()).unwrap());
        out.extend(body);
        out
    }

    /// The header value one encoded value decodes to, as the only entry of a section.
    fn one(value: &[u8]) -> HeaderValue {
        let decoded = decode_application_properties(&section(&[(str8("k"), value.to_vec())]))
            .expect("decodes");
        assert_eq!(decoded.headers.len(), 1);
        decoded.headers.get("k").cloned().expect("k")
    }

    #[test]
    fn every_simple_type_decodes() {
        use HeaderValue::*;
        let ts = 1_700_000_000_123_i64.to_be_bytes();
        let cases: Vec<(Vec<u8>, HeaderValue)> = vec![
            (vec![0x40], Null),
            (vec![0x41], Bool(true)),
            (vec![0x42], Bool(false)),
            (vec![0x56, 0x01], Bool(true)),
            (vec![0x56, 0x00], Bool(false)),
            (vec![0x50, 0xff], Int(255)),
            (vec![0x60, 0xff, 0xfe], Int(65_534)),
            (vec![0x70, 0xff, 0xff, 0xff, 0xff], Int(u32::MAX.into())),
            (vec![0x52, 0x07], Int(7)),
            (vec![0x43], Int(0)),
            ([&[0x80][..], &42u64.to_be_bytes()].concat(), Int(42)),
            (
                [&[0x80][..], &u64::MAX.to_be_bytes()].concat(),
                UInt(u64::MAX),
            ),
            (vec![0x53, 0x09], Int(9)),
            (vec![0x44], Int(0)),
            (vec![0x51, 0xfe], Int(-2)),
            (vec![0x61, 0xff, 0xfd], Int(-3)),
            (vec![0x71, 0xff, 0xff, 0xff, 0xfc], Int(-4)),
            (vec![0x54, 0x80], Int(-128)),
            (
                [&[0x81][..], &i64::MIN.to_be_bytes()].concat(),
                Int(i64::MIN),
            ),
            (vec![0x55, 0x01], Int(1)),
            ([&[0x72][..], &1.5f32.to_be_bytes()].concat(), Float(1.5)),
            (
                [&[0x82][..], &(-0.25f64).to_be_bytes()].concat(),
                Float(-0.25),
            ),
            (
                [&[0x83][..], &ts].concat(),
                Timestamp(retry_core::Timestamp::from_millis(1_700_000_000_123)),
            ),
            (vec![0x73, 0x00, 0x00, 0x00, 0xe9], Str("é".into())),
            ([&[0x98][..], &[0xab; 16]].concat(), Bytes(vec![0xab; 16])),
            (vec![0xa0, 0x02, 0x00, 0xff], Bytes(vec![0, 0xff])),
            (vec![0xb0, 0, 0, 0, 1, 0x07], Bytes(vec![7])),
            (str8("permanent"), Str("permanent".into())),
            (vec![0xb1, 0, 0, 0, 2, b'o', b'k'], Str("ok".into())),
            (vec![0xa3, 0x02, b'e', b'u'], Str("eu".into())),
            (vec![0xb3, 0, 0, 0, 2, b'e', b'u'], Str("eu".into())),
        ];
        for (encoded, expected) in cases {
            assert_eq!(one(&encoded), expected, "{encoded:02x?}");
        }
    }

    #[test]
    fn values_of_other_types_or_invalid_ones_are_kept_as_their_encoding() {
        let cases: Vec<Vec<u8>> = vec![
            // A negative timestamp, a bool byte that is neither 0 nor 1, a string that is
            // not UTF-8, a char that is not a code point.
            [&[0x83][..], &(-1i64).to_be_bytes()].concat(),
            vec![0x56, 0x02],
            vec![0xa1, 0x02, 0xff, 0xfe],
            vec![0x73, 0x00, 0x11, 0x00, 0x00],
            // list0, list8, map8, array8, decimal32, a described value.
            vec![0x45],
            vec![0xc0, 0x03, 0x02, 0x41, 0x42],
            vec![0xc1, 0x01, 0x00],
            vec![0xe0, 0x03, 0x02, 0x56, 0x01],
            vec![0x74, 1, 2, 3, 4],
            vec![0x00, 0x53, 0x01, 0xa1, 0x01, b'x'],
        ];
        for encoded in cases {
            assert_eq!(one(&encoded), HeaderValue::Bytes(encoded.clone()));
        }
    }

    #[test]
    fn an_odd_value_does_not_stop_the_keys_after_it() {
        let bytes = section(&[
            (str8("a"), vec![0xc0, 0x02, 0x01, 0x40]),
            (str8("x-retry-attempts"), vec![0x55, 0x02]),
            (vec![0x53, 0x05], vec![0x41]),
            (str8("x-retry-reason"), str8("permanent")),
        ]);
        let decoded = decode_application_properties(&bytes).expect("decodes");
        assert_eq!(decoded.dropped, 1, "the ulong key is left out");
        assert_eq!(
            decoded.headers.get("a"),
            Some(&HeaderValue::Bytes(vec![0xc0, 0x02, 0x01, 0x40]))
        );
        assert_eq!(
            decoded.headers.get("x-retry-attempts"),
            Some(&HeaderValue::Int(2))
        );
        assert_eq!(
            decoded.headers.get("x-retry-reason"),
            Some(&HeaderValue::from("permanent"))
        );
    }

    #[test]
    fn descriptors_null_and_map32_are_read() {
        let long = [&[0x00, 0x80][..], &0x74u64.to_be_bytes()].concat();
        let symbolic = [&[0x00, 0xa3, 31][..], b"amqp:application-properties:map"].concat();
        for descriptor in [DESCRIPTOR.to_vec(), long, symbolic] {
            let null = [&descriptor[..], &[0x40]].concat();
            assert_eq!(
                decode_application_properties(&null),
                Ok(AppProperties::default())
            );
            let mut entries = str8("k");
            entries.extend([0x52, 0x03]);
            let mut map32 = descriptor.clone();
            map32.push(0xd1);
            map32.extend(u32::try_from(entries.len() + 4).unwrap().to_be_bytes());
            map32.extend(2u32.to_be_bytes());
            map32.extend(entries);
            let decoded = decode_application_properties(&map32).expect("map32");
            assert_eq!(decoded.headers.get("k"), Some(&HeaderValue::Int(3)));
        }
    }

    #[test]
    fn broken_structure_is_an_error() {
        let good = section(&[(str8("k"), vec![0x52, 0x03])]);
        assert!(decode_application_properties(&good).is_ok());
        // Every proper prefix is truncated somewhere.
        for n in 0..good.len() {
            assert!(decode_application_properties(&good[..n]).is_err(), "{n}");
        }
        let cases: Vec<(Vec<u8>, SectionError)> = vec![
            // The properties section's descriptor, a different one, a non-described value.
            (vec![0x00, 0x53, 0x73, 0x40], SectionError::WrongSection(0)),
            (
                [&[0x00, 0x80][..], &0x75u64.to_be_bytes(), &[0x40]].concat(),
                SectionError::WrongSection(0),
            ),
            (vec![0x40], SectionError::WrongSection(0)),
            // A list where the map should be.
            (
                vec![0x00, 0x53, 0x74, 0x45],
                SectionError::Unexpected { code: 0x45, at: 3 },
            ),
            // Bytes after the section.
            ([&good[..], &[0x40]].concat(), SectionError::Trailing(1)),
            // An odd count, a count larger than the map, elements that do not fill it.
            (
                vec![0x00, 0x53, 0x74, 0xc1, 0x02, 0x01, 0x40],
                SectionError::BadSize(3),
            ),
            (
                vec![0x00, 0x53, 0x74, 0xc1, 0x02, 0xfe, 0x40],
                SectionError::BadSize(3),
            ),
            (
                vec![
                    0x00, 0x53, 0x74, 0xc1, 0x06, 0x02, 0xa1, 0x01, b'k', 0x40, 0x40,
                ],
                SectionError::BadSize(3),
            ),
            // A map32 that claims 4 GiB.
            (
                vec![0x00, 0x53, 0x74, 0xd1, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 2],
                SectionError::Truncated(8),
            ),
            // A reserved format code as a value.
            (
                vec![0x00, 0x53, 0x74, 0xc1, 0x05, 0x02, 0xa1, 0x01, b'k', 0x20],
                SectionError::Unexpected { code: 0x20, at: 9 },
            ),
        ];
        for (bytes, error) in cases {
            assert_eq!(
                decode_application_properties(&bytes),
                Err(error),
                "{bytes:02x?}"
            );
        }
    }

    #[test]
    fn described_values_nested_without_end_are_refused() {
        let mut value = vec![0x00; 100_000];
        value.push(0x40);
        let mut bytes = DESCRIPTOR.to_vec();
        bytes.push(0xd1);
        bytes.extend(u32::try_from(value.len() + 7).unwrap().to_be_bytes());
        bytes.extend(2u32.to_be_bytes());
        bytes.extend(str8("k"));
        bytes.extend(value);
        assert!(matches!(
            decode_application_properties(&bytes),
            Err(SectionError::TooDeep(_))
        ));
    }

    /// What RabbitMQ 3.10 put in the header for a message fe2o3-amqp published with these
    /// application properties: `x-retry-attempts` = 1 (long), `tenant` = "acme", `sym` =
    /// symbol "eu", `u` = uint 7, `ts` = timestamp, `bin` = binary 00 ff.
    #[test]
    fn a_section_as_rabbitmq_stored_it() {
        let bytes = [
            0, 83, 116, 193, 71, 12, 161, 16, 120, 45, 114, 101, 116, 114, 121, 45, 97, 116, 116,
            101, 109, 112, 116, 115, 85, 1, 161, 6, 116, 101, 110, 97, 110, 116, 161, 4, 97, 99,
            109, 101, 161, 3, 115, 121, 109, 163, 2, 101, 117, 161, 1, 117, 82, 7, 161, 2, 116,
            115, 131, 0, 0, 1, 139, 207, 229, 104, 123, 161, 3, 98, 105, 110, 160, 2, 0, 255,
        ];
        let decoded = decode_application_properties(&bytes).expect("decodes");
        let expected: Headers = [
            ("x-retry-attempts", HeaderValue::Int(1)),
            ("tenant", HeaderValue::from("acme")),
            ("sym", HeaderValue::from("eu")),
            ("u", HeaderValue::Int(7)),
            (
                "ts",
                HeaderValue::Timestamp(Timestamp::from_millis(1_700_000_000_123)),
            ),
            ("bin", HeaderValue::Bytes(vec![0, 255])),
        ]
        .into_iter()
        .collect();
        assert_eq!(decoded.headers, expected);
        assert_eq!(decoded.dropped, 0);
    }

    #[test]
    fn message_ids_of_every_type_read_as_text() {
        // As RabbitMQ 3.10 stored them: a string id (with correlation-id and content-type
        // after it), a uuid, and a binary id.
        let string = [
            0, 83, 115, 192, 27, 7, 161, 3, 109, 45, 49, 64, 64, 64, 64, 161, 3, 99, 45, 49, 163,
            10, 116, 101, 120, 116, 47, 112, 108, 97, 105, 110,
        ];
        let uuid = [
            0, 83, 115, 192, 18, 1, 152, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
        ];
        let binary = [0, 83, 115, 192, 6, 1, 160, 3, 1, 2, 0xab];
        let id = |text: &str, is_string| {
            Ok(Some(MessageId {
                text: text.into(),
                is_string,
            }))
        };
        assert_eq!(decode_message_id(&string), id("m-1", true));
        assert_eq!(
            decode_message_id(&uuid),
            id("01020304-0506-0708-090a-0b0c0d0e0f10", false)
        );
        assert_eq!(decode_message_id(&binary), id("0102ab", false));
        let ulong = [0, 83, 115, 192, 10, 1, 0x80, 0, 0, 0, 0, 0, 0, 0, 42];
        assert_eq!(decode_message_id(&ulong), id("42", false));
        let small = [0, 83, 115, 192, 3, 1, 0x53, 7];
        assert_eq!(decode_message_id(&small), id("7", false));
        let max = [&[0, 83, 115, 192, 10, 1, 0x80][..], &u64::MAX.to_be_bytes()].concat();
        assert_eq!(decode_message_id(&max), id(&u64::MAX.to_string(), false));
        let long32 = [
            &[0, 0x80][..],
            &0x73u64.to_be_bytes(),
            &[0xd0, 0, 0, 0, 9, 0, 0, 0, 1, 0xa1, 3, b'a', b'b', b'c'],
        ]
        .concat();
        assert_eq!(decode_message_id(&long32), id("abc", true));
    }

    #[test]
    fn absent_or_unusable_message_ids_are_none() {
        for bytes in [
            vec![0, 83, 115, 0x45],
            vec![0, 83, 115, 192, 1, 0],
            vec![0, 83, 115, 192, 2, 1, 0x40],
            // An int is not a message-id type; a string that is not UTF-8.
            vec![0, 83, 115, 192, 3, 1, 0x54, 1],
            vec![0, 83, 115, 192, 4, 1, 0xa1, 1, 0xff],
        ] {
            assert_eq!(decode_message_id(&bytes), Ok(None), "{bytes:02x?}");
        }
        assert_eq!(
            decode_message_id(&[0, 83, 116, 0x40]),
            Err(SectionError::WrongSection(0))
        );
        assert_eq!(
            decode_message_id(&[0, 83, 115, 192, 9, 1, 0xa1, 3]),
            Err(SectionError::Truncated(5))
        );
    }

    /// A header value that application properties can hold, as the decoder gives it back:
    /// integers that fit an `i64` as `Int`, every string as `Str`.
    fn simple_value() -> impl Strategy<Value = HeaderValue> {
        prop_oneof![
            Just(HeaderValue::Null),
            any::<bool>().prop_map(HeaderValue::Bool),
            any::<i64>().prop_map(HeaderValue::Int),
            ((i64::MAX as u64 + 1)..=u64::MAX).prop_map(HeaderValue::UInt),
            any::<f64>()
                .prop_filter("NaN is not equal to itself", |x| !x.is_nan())
                .prop_map(HeaderValue::Float),
            ".{0,300}".prop_map(HeaderValue::Str),
            prop::collection::vec(any::<u8>(), 0..300).prop_map(HeaderValue::Bytes),
            (0..=i64::MAX as u64).prop_map(|ms| HeaderValue::Timestamp(Timestamp::from_millis(ms))),
        ]
    }

    #[test]
    fn an_encoded_section_is_the_one_rabbitmq_writes() {
        let headers: Headers = [
            ("x-retry-replays", HeaderValue::Int(1)),
            ("tenant", HeaderValue::from("acme")),
        ]
        .into_iter()
        .collect();
        let (bytes, left_out) = encode_application_properties(headers.iter());
        assert!(left_out.is_empty());
        // The bytes RabbitMQ 3.10 turned into {"tenant": "acme", "x-retry-replays": 1} for an
        // AMQP 1.0 consumer (headers iterate in name order).
        let mut body = vec![4u8];
        body.extend(str8("tenant"));
        body.extend(str8("acme"));
        body.extend(str8("x-retry-replays"));
        body.extend([0x55, 1]);
        let mut want = DESCRIPTOR.to_vec();
        want.extend([0xc1, u8::try_from(body.len()).unwrap()]);
        want.extend(body);
        assert_eq!(bytes, want);
    }

    #[test]
    fn arrays_and_tables_are_left_out_of_a_section() {
        let headers: Headers = [
            ("list", HeaderValue::Array(vec![HeaderValue::Int(1)])),
            ("kept", HeaderValue::Bool(true)),
            ("table", HeaderValue::Table(Headers::new())),
        ]
        .into_iter()
        .collect();
        let (bytes, left_out) = encode_application_properties(headers.iter());
        assert_eq!(left_out, ["list", "table"]);
        let decoded = decode_application_properties(&bytes).unwrap();
        assert_eq!(
            decoded.headers,
            [("kept", HeaderValue::Bool(true))].into_iter().collect()
        );
    }

    proptest! {
        /// Whatever simple values a section holds, and however long (a map32 past 255
        /// bytes), it decodes to what was encoded.
        #[test]
        fn encoded_sections_decode_to_what_was_encoded(
            entries in prop::collection::btree_map("[a-z-]{1,300}", simple_value(), 0..12),
        ) {
            let headers: Headers = entries.into_iter().collect();
            let (bytes, left_out) = encode_application_properties(headers.iter());
            prop_assert!(left_out.is_empty());
            let decoded = decode_application_properties(&bytes).unwrap();
            prop_assert_eq!(decoded.dropped, 0);
            prop_assert_eq!(decoded.headers, headers);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_application_properties(&bytes);
            let _ = decode_message_id(&bytes);
        }

        /// Bytes after a valid prefix, so that decoding gets past the descriptor and into
        /// the map more often than arbitrary bytes do.
        #[test]
        fn arbitrary_maps_never_panic(
            wide in any::<bool>(),
            size in any::<u32>(),
            count in any::<u32>(),
            rest in prop::collection::vec(any::<u8>(), 0..512),
        ) {
            let mut bytes = DESCRIPTOR.to_vec();
            if wide {
                bytes.push(0xd1);
                bytes.extend(size.to_be_bytes());
                bytes.extend(count.to_be_bytes());
            } else {
                bytes.extend([0xc1, size as u8, count as u8]);
            }
            bytes.extend(rest);
            if let Ok(decoded) = decode_application_properties(&bytes) {
                prop_assert!(decoded.headers.len() + decoded.dropped <= bytes.len() / 2);
            }
            bytes[2] = 0x73;
            bytes[3] &= 0xfe;
            let _ = decode_message_id(&bytes);
        }

        /// Sections of valid entries with well-formed values of any type decode, and every
        /// entry comes back.
        #[test]
        fn well_formed_sections_decode_every_entry(
            values in prop::collection::vec(
                (any::<u8>(), prop::collection::vec(any::<u8>(), 0..20)),
                0..20,
            ),
        ) {
            // Build each value with a valid constructor for its code, sized correctly.
            let mut entries = Vec::new();
            for (i, (code, payload)) in values.iter().enumerate() {
                let code = (*code).max(0x40);
                let code = if code & 0x0f == 0x0f { code - 1 } else { code };
                let width = match code >> 4 {
                    0x4 => Some(0),
                    0x5 => Some(1),
                    0x6 => Some(2),
                    0x7 => Some(4),
                    0x8 => Some(8),
                    0x9 => Some(16),
                    _ => None,
                };
                let mut value = vec![code];
                match width {
                    Some(w) => value.extend((0..w).map(|j| payload.get(j).copied().unwrap_or(0))),
                    None if matches!(code >> 4, 0xa | 0xc | 0xe) => {
                        value.push(payload.len() as u8);
                        value.extend(payload);
                    }
                    None => {
                        value.extend((payload.len() as u32).to_be_bytes());
                        value.extend(payload);
                    }
                }
                entries.push((str8(&format!("k{i}")), value));
            }
            let mut body = Vec::new();
            for (k, v) in &entries {
                body.extend_from_slice(k);
                body.extend_from_slice(v);
            }
            let mut bytes = DESCRIPTOR.to_vec();
            bytes.push(0xd1);
            bytes.extend(((body.len() + 4) as u32).to_be_bytes());
            bytes.extend(((entries.len() * 2) as u32).to_be_bytes());
            bytes.extend(body);
            let decoded = decode_application_properties(&bytes);
            prop_assert!(decoded.is_ok(), "{:?}", decoded);
            let decoded = decoded.unwrap();
            prop_assert_eq!(decoded.headers.len(), entries.len());
            prop_assert_eq!(decoded.dropped, 0);
        }
    }
}
