//! What lapin would fail a connection on, or overflow its stack on: the checks the
//! connection's tap (see the `tap` module) makes on every frame that carries a message,
//! before lapin parses it.
//!
//! lapin 4.12 (amq-protocol 10.6) parses a frame as a whole and fails the whole connection
//! on any frame it cannot parse: a short string that is not UTF-8 (a message id, a content
//! type, a header name, a routing key), a field type it does not know, a length that says
//! more than there is, bytes left over after the last property. It parses field tables and
//! arrays by recursing once per level, on its IO thread: about 7 KiB of stack a level in a
//! debug build, 1.3 KiB in release, so a header nested some 250 levels deep (debug) or 1,500
//! (release) overflows the thread's 2 MiB and aborts the process. RabbitMQ 3.10 accepts,
//! stores and delivers invalid UTF-8 anywhere and nesting as deep as its frame allows
//! (about 18,000 tables in 128 KiB); it refuses unknown field types, lengths that lie and
//! left-over bytes at publish, which other brokers may not.
//!
//! [`check_content_header`] says whether lapin would parse a content header frame, and
//! refuses one nested deeper than [`MAX_NESTING`]; [`check_delivery_method`] says whether
//! the short strings of a `basic.deliver`, `basic.get-ok` or `basic.return` are UTF-8 and
//! gives the frame with them made readable when they are not. Both read iteratively, never
//! panic, and allocate only to describe a refusal.

use std::fmt;

/// How many tables and arrays, the header table itself included, a message's headers may
/// nest: well within what lapin's recursion survives on its IO thread in a debug build (about
/// 250), and the depth the AMQP 1.0 transport allows too.
pub const MAX_NESTING: usize = 64;

/// Why lapin would not, or must not, parse a frame: where, and what is wrong there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Where: a property (`message-id`), a header (`headers["x-trace"][2]`), a method field
    /// (`routing-key`).
    pub field: String,
    /// What is wrong there.
    pub problem: Problem,
}

/// What is wrong with a field.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// A short string (or a header name) that is not UTF-8; its bytes, at most 64.
    NotUtf8(Vec<u8>),
    /// Tables and arrays nested deeper than the limit.
    TooDeep(usize),
    /// A field type tag lapin does not know.
    UnknownType(u8),
    /// A length that says more bytes than its container holds.
    Truncated {
        /// Bytes the length, or the fixed-size value, needs.
        wanted: usize,
        /// Bytes left in its container.
        left: usize,
    },
    /// Bytes after the last property.
    Trailing(usize),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let field = &self.field;
        match &self.problem {
            Problem::NotUtf8(bytes) => {
                write!(f, "{field} is not UTF-8 (")?;
                for (i, b) in bytes.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{b:02x}")?;
                }
                f.write_str(")")
            }
            Problem::TooDeep(limit) => {
                write!(
                    f,
                    "{field} nests tables and arrays deeper than {limit} levels"
                )
            }
            Problem::UnknownType(tag) if tag.is_ascii_graphic() => {
                write!(
                    f,
                    "{field} has the unknown field type {:?} (0x{tag:02x})",
                    *tag as char
                )
            }
            Problem::UnknownType(tag) => {
                write!(f, "{field} has the unknown field type 0x{tag:02x}")
            }
            Problem::Truncated { wanted, left } => {
                write!(f, "{field} needs {wanted} bytes where {left} are left")
            }
            Problem::Trailing(n) => write!(f, "{n} bytes follow the {field}"),
        }
    }
}

impl std::error::Error for Refusal {}

/// The properties of a `basic` content header, in the order their flags say.
pub(crate) const PROPERTIES: [&str; 14] = [
    "content-type",
    "content-encoding",
    "headers",
    "delivery-mode",
    "priority",
    "correlation-id",
    "reply-to",
    "expiration",
    "message-id",
    "timestamp",
    "type",
    "user-id",
    "app-id",
    "cluster-id",
];

/// The fixed part of a content header: class, weight, body size, property flags.
pub(crate) const FIXED: usize = 14;

/// Checks a content header frame's payload (class id, weight, body size, property flags,
/// properties) as lapin parses it, and its headers against [`MAX_NESTING`].
pub fn check_content_header(payload: &[u8]) -> Result<(), Refusal> {
    let mut r = Reader::new(payload);
    let fixed = r.take(FIXED, || "content header".into())?;
    let flags = u16::from_be_bytes([fixed[12], fixed[13]]);
    for (i, name) in PROPERTIES.iter().enumerate() {
        if flags & (1 << (15 - i)) == 0 {
            continue;
        }
        match i {
            2 => r.table(name)?,
            3 | 4 => {
                r.take(1, || (*name).into())?;
            }
            9 => {
                r.take(8, || (*name).into())?;
            }
            _ => {
                r.short_string(|| (*name).into())?;
            }
        }
    }
    match payload.len() - r.pos {
        0 => Ok(()),
        n => Err(Refusal {
            field: "properties".into(),
            problem: Problem::Trailing(n),
        }),
    }
}

/// A message-carrying method frame whose short strings are not all UTF-8: why, and the
/// frame's payload with each such string replaced by a readable one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rewritten {
    /// The first string that is not UTF-8.
    pub refusal: Refusal,
    /// The method frame's payload with every such string made UTF-8 (invalid sequences as
    /// U+FFFD, cut to 255 bytes at a character boundary).
    pub payload: Vec<u8>,
}

/// `basic.deliver`, `basic.get-ok` and `basic.return`: the methods a message comes with.
const DELIVER: (u16, u16) = (60, 60);
const GET_OK: (u16, u16) = (60, 71);
const RETURN: (u16, u16) = (60, 50);

/// Whether a method frame's payload announces a message (its content header follows).
pub fn announces_content(payload: &[u8]) -> bool {
    matches!(class_method(payload), Some(DELIVER | GET_OK | RETURN))
}

fn class_method(payload: &[u8]) -> Option<(u16, u16)> {
    let ids = payload.get(..4)?;
    Some((
        u16::from_be_bytes([ids[0], ids[1]]),
        u16::from_be_bytes([ids[2], ids[3]]),
    ))
}

/// Checks the short strings of a method frame that announces a message: the consumer tag,
/// exchange and routing key of a `basic.deliver`, the exchange and routing key of a
/// `basic.get-ok`, the reply text, exchange and routing key of a `basic.return`. `Ok(None)`
/// when they are UTF-8, or for any other method; a frame cut short is left to lapin (the
/// broker writes these frames itself: only the strings come from a publisher).
pub fn check_delivery_method(payload: &[u8]) -> Option<Rewritten> {
    // (bytes to skip, field name) in order: a skip of 0 with a name is a short string.
    let layout: &[(usize, &str)] = match class_method(payload)? {
        DELIVER => &[
            (0, "consumer-tag"),
            (9, ""),
            (0, "exchange"),
            (0, "routing-key"),
        ],
        GET_OK => &[(9, ""), (0, "exchange"), (0, "routing-key")],
        RETURN => &[
            (2, ""),
            (0, "reply-text"),
            (0, "exchange"),
            (0, "routing-key"),
        ],
        _ => return None,
    };
    let mut pos: usize = 4;
    let mut first: Option<Refusal> = None;
    let mut out: Option<Vec<u8>> = None;
    for &(skip, name) in layout {
        if skip > 0 {
            pos = pos.checked_add(skip).filter(|&p| p <= payload.len())?;
            continue;
        }
        let len = usize::from(*payload.get(pos)?);
        let text = payload.get(pos + 1..pos + 1 + len)?;
        if std::str::from_utf8(text).is_err() {
            let out = out.get_or_insert_with(|| payload[..pos].to_vec());
            let lossy = String::from_utf8_lossy(text);
            let fitting = &lossy[..lossy.floor_char_boundary(255)];
            out.push(fitting.len() as u8);
            out.extend_from_slice(fitting.as_bytes());
            first.get_or_insert_with(|| Refusal {
                field: name.into(),
                problem: Problem::NotUtf8(text[..len.min(64)].to_vec()),
            });
        } else if let Some(out) = &mut out {
            out.extend_from_slice(&payload[pos..pos + 1 + len]);
        }
        pos += 1 + len;
    }
    let mut out = out?;
    out.extend_from_slice(&payload[pos..]);
    Some(Rewritten {
        refusal: first?,
        payload: out,
    })
}

/// A table or array being read: where it ends, and what it is called.
struct Level {
    end: usize,
    table: bool,
    /// The entry being read: a table's key (where it is in the payload) or an array's index.
    entry: Entry,
    count: usize,
}

#[derive(Clone, Copy)]
enum Entry {
    None,
    Key(usize, usize),
    Index(usize),
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    /// `n` bytes, within `end`.
    fn take_within(
        &mut self,
        n: usize,
        end: usize,
        field: impl FnOnce() -> String,
    ) -> Result<&'a [u8], Refusal> {
        let left = end - self.pos;
        if n > left {
            return Err(Refusal {
                field: field(),
                problem: Problem::Truncated { wanted: n, left },
            });
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn take(&mut self, n: usize, field: impl FnOnce() -> String) -> Result<&'a [u8], Refusal> {
        self.take_within(n, self.bytes.len(), field)
    }

    fn long_within(
        &mut self,
        end: usize,
        field: impl FnOnce() -> String,
    ) -> Result<usize, Refusal> {
        let b = self.take_within(4, end, field)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn short_string(&mut self, field: impl Fn() -> String) -> Result<(), Refusal> {
        let end = self.bytes.len();
        self.short_string_within(end, field)
    }

    fn short_string_within(
        &mut self,
        end: usize,
        field: impl Fn() -> String,
    ) -> Result<(), Refusal> {
        let len = usize::from(self.take_within(1, end, &field)?[0]);
        let text = self.take_within(len, end, &field)?;
        match std::str::from_utf8(text) {
            Ok(_) => Ok(()),
            Err(_) => Err(Refusal {
                field: field(),
                problem: Problem::NotUtf8(text[..len.min(64)].to_vec()),
            }),
        }
    }

    /// A field table (its length, then its entries), read with a stack of its own rather
    /// than by recursion, however deep it nests.
    fn table(&mut self, name: &str) -> Result<(), Refusal> {
        let len = self.long_within(self.bytes.len(), || name.into())?;
        let end = self.pos.checked_add(len).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(Refusal {
                field: name.into(),
                problem: Problem::Truncated {
                    wanted: len,
                    left: self.bytes.len() - self.pos,
                },
            });
        };
        let bytes = self.bytes;
        let mut stack = vec![Level {
            end,
            table: true,
            entry: Entry::None,
            count: 0,
        }];
        while let Some(top) = stack.last_mut() {
            if self.pos == top.end {
                stack.pop();
                continue;
            }
            let end = top.end;
            if top.table {
                let key_at = self.pos + 1;
                self.short_string_within(end, || path(name, bytes, &stack, true))?;
                let top = stack.last_mut().expect("the level being read");
                top.entry = Entry::Key(key_at, self.pos - key_at);
            } else {
                top.entry = Entry::Index(top.count);
                top.count += 1;
            }
            let here = |stack: &[Level]| path(name, bytes, stack, false);
            let tag = self.take_within(1, end, || here(&stack))?[0];
            let fixed = match tag {
                b'V' => 0,
                b't' | b'b' | b'B' => 1,
                b's' | b'U' | b'u' => 2,
                b'I' | b'i' | b'f' => 4,
                b'D' => 5,
                b'L' | b'l' | b'd' | b'T' => 8,
                b'S' | b'x' => {
                    let n = self.long_within(end, || here(&stack))?;
                    self.take_within(n, end, || here(&stack))?;
                    continue;
                }
                b'A' | b'F' => {
                    let n = self.long_within(end, || here(&stack))?;
                    let inner_end = self.pos + n;
                    if inner_end > end {
                        return Err(Refusal {
                            field: here(&stack),
                            problem: Problem::Truncated {
                                wanted: n,
                                left: end - self.pos,
                            },
                        });
                    }
                    if stack.len() >= MAX_NESTING {
                        return Err(Refusal {
                            field: here(&stack),
                            problem: Problem::TooDeep(MAX_NESTING),
                        });
                    }
                    stack.push(Level {
                        end: inner_end,
                        table: tag == b'F',
                        entry: Entry::None,
                        count: 0,
                    });
                    continue;
                }
                other => {
                    return Err(Refusal {
                        field: here(&stack),
                        problem: Problem::UnknownType(other),
                    });
                }
            };
            self.take_within(fixed, end, || here(&stack))?;
        }
        Ok(())
    }
}

/// How many levels of a path a refusal names before it is cut short.
const PATH_LEVELS: usize = 4;

/// The path of the entry being read in `stack`, under the property `name`; `naming` when the
/// entry's own name is what is wrong (it is left out, and the path says "a name in").
fn path(name: &str, bytes: &[u8], stack: &[Level], naming: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if naming {
        out.push_str("a header name in ");
    }
    out.push_str(name);
    let levels = if naming {
        &stack[..stack.len().saturating_sub(1)]
    } else {
        stack
    };
    for (i, level) in levels.iter().enumerate() {
        if i == PATH_LEVELS {
            let _ = write!(out, "... ({} levels)", levels.len());
            break;
        }
        match level.entry {
            Entry::None => {}
            Entry::Key(at, len) => {
                let key = String::from_utf8_lossy(&bytes[at..at + len]);
                let _ = write!(out, "[{key:?}]");
            }
            Entry::Index(i) => {
                let _ = write!(out, "[{i}]");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{RawProperties, RawTable};
    use lapin::protocol::basic::parse_properties;
    use lapin::types::parsing::parse_long_long_uint;
    use proptest::prelude::*;

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
                proptest::collection::vec(
                    (proptest::collection::vec(any::<u8>(), 0..4), inner),
                    0..4
                )
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
}
