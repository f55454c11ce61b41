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
