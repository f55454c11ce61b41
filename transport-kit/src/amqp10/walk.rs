//! The one walk of the AMQP 1.0 encoding that both uses of this module are built on: a
//! cursor over the bytes ([`Reader`]) and a walk over whole values ([`Walk`]) with an
//! explicit stack of open containers and a depth limit, so that nesting costs heap, not
//! call stack, and is refused past the limit.
//!
//! Two sets of rules ([`Rules`]) run on it. The check reads every value as AMQP 1.0
//! defines it, into every list, map and array, as a decoder would. The section decoder
//! only steps over a value to find where it ends: any format code by its subcategory, a
//! list, map or array by its size without reading inside, so that a value of a type
//! application properties should not hold, or that is invalid inside, is kept as its raw
//! bytes rather than failing the whole section.
//!
//! No read goes past the end of the innermost open container, or of the bytes; no size or
//! count is trusted further than that; nothing here panics.

use std::fmt;

use super::codes::{self, Layout};

/// The deepest nesting [`check_message`](super::check_message) and
/// [`check_values`](super::check_values) accept, counting each list, map, array and
/// described value (each message section is one). Legitimate messages stay far below it;
/// fe2o3-amqp's decoder, which recurses once per level, survives it with room to spare on a
/// 2 MiB thread, even in a debug build.
pub const MAX_DEPTH: usize = 64;

/// The deepest nesting of described values (a descriptor or a value that is itself
/// described, ...) the section decoders follow inside one value; deeper is
/// [`SectionError::TooDeep`](super::SectionError::TooDeep). Lists, maps and arrays inside
/// a value are stepped over by their size, so they do not count.
pub const MAX_DESCRIBED: usize = 8;

/// Why bytes were refused by [`check_message`](super::check_message) or
/// [`check_values`](super::check_values), and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The offset of the byte where the check stopped.
    pub at: usize,
    /// What was wrong there.
    pub why: Why,
}

/// What was wrong with refused bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Why {
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

fn refuse(at: usize, why: Why) -> Refusal {
    Refusal { at, why }
}

/// A cursor over `bytes[pos..end]`. Offsets, in refusals too, are into the whole of `bytes`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// No read goes past this.
    end: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader {
            bytes,
            pos: 0,
            end: bytes.len(),
        }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.end.saturating_sub(self.pos)
    }

    /// The bytes from `start` to where the reader is.
    pub(crate) fn since(&self, start: usize) -> &'a [u8] {
        self.bytes.get(start..self.pos).unwrap_or_default()
    }

    /// The next `n` bytes; [`Why::Truncated`] where they start if they are not all there.
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], Refusal> {
        let start = self.pos;
        match start.checked_add(n) {
            Some(end) if end <= self.end => {
                self.pos = end;
                Ok(&self.bytes[start..end])
            }
            _ => Err(refuse(start, Why::Truncated)),
        }
    }

    pub(crate) fn byte(&mut self) -> Result<u8, Refusal> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, Refusal> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(b))
    }

    /// A size or a count: one byte, or four when `wide`.
    pub(crate) fn size(&mut self, wide: bool) -> Result<usize, Refusal> {
        let n = if wide {
            let mut b = [0; 4];
            b.copy_from_slice(self.take(4)?);
            u32::from_be_bytes(b)
        } else {
            u32::from(self.byte()?)
        };
        // A size past the bytes left is refused where it is used; saturate rather than wrap
        // on targets where it would not fit.
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// A reader over the next `n` bytes, which this one steps past; [`Why::Truncated`]
    /// where they start if they are not all there.
    pub(crate) fn split(&mut self, n: usize) -> Result<Reader<'a>, Refusal> {
        let start = self.pos;
        self.take(n)?;
        Ok(Reader {
            bytes: self.bytes,
            pos: start,
            end: self.pos,
        })
    }

    /// A section descriptor, after its `0x00`: the descriptor code of the section it names
    /// (by code or by symbolic name), or `None` when it names none.
    pub(crate) fn section(&mut self) -> Result<Option<u64>, Refusal> {
        Ok(match self.byte()? {
            0x53 => codes::section_by_code(u64::from(self.byte()?)),
            0x80 => codes::section_by_code(self.u64()?),
            code @ (0xa3 | 0xb3) => {
                let n = self.size(code == 0xb3)?;
                codes::section_by_name(self.take(n)?)
            }
            _ => None,
        })
    }

    /// Steps over one whole value under [`Rules::Lenient`], and returns its bytes.
    pub(crate) fn step(&mut self) -> Result<&'a [u8], Refusal> {
        let start = self.pos;
        let next = if start < self.end {
            self.bytes.get(start)
        } else {
            None
        };
        match next {
            // Anything but a described value is one constructor and its data; a described
            // value, which may nest, is walked.
            Some(&code) if code != 0x00 => {
                self.pos += 1;
                self.step_data(code, start)?;
            }
            _ => {
                let mut walk = Walk::new(*self, Rules::Lenient);
                walk.value()?;
                *self = walk.r;
            }
        }
        Ok(self.since(start))
    }

    /// The data of a value of format code `code` (at `at`) under [`Rules::Lenient`].
    fn step_data(&mut self, code: u8, at: usize) -> Result<(), Refusal> {
        let Some(layout) = codes::layout(code) else {
            return Err(refuse(at, Why::UnknownFormatCode(code)));
        };
        if code & 0x0f == 0x0f {
            // An extended type: one more byte of format code.
            self.byte()?;
        }
        let n = match layout {
            Layout::Fixed(n) => n,
            Layout::Variable { wide } | Layout::Compound { wide } | Layout::Array { wide } => {
                self.size(wide)?
            }
        };
        self.take(n).map(drop)
    }
}

/// How a [`Walk`] reads values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rules {
    /// As AMQP 1.0 defines them, as a decoder would: only defined format codes, strings and
    /// symbols in UTF-8, descriptors that are symbols or unsigned longs, every value of a
    /// list, map or array read in turn, and each of them, each described value and each
    /// section a level of nesting, up to [`MAX_DEPTH`].
    Strict,
    /// Stepped over: any format code by its subcategory (a code `0xXF` takes one byte more),
    /// a list, map or array by its size, unread; a descriptor may be any value. Only
    /// described values are followed, each a level of nesting, up to [`MAX_DESCRIBED`].
    Lenient,
}

impl Rules {
    fn max_depth(self) -> usize {
        match self {
            Rules::Strict => MAX_DEPTH,
            Rules::Lenient => MAX_DESCRIBED,
        }
    }
}

/// What remains to be read of an open container.
#[derive(Clone, Copy, Debug)]
enum Open {
    /// `left` whole values (constructor and data): a list's or map's, or a described
    /// value's (its descriptor too under [`Rules::Lenient`]).
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

/// A walk over whole values from where its reader is, with an explicit stack of the
/// containers open around the value being read.
pub(crate) struct Walk<'a> {
    r: Reader<'a>,
    rules: Rules,
    stack: Vec<Frame>,
    /// The reader's end when nothing is open.
    outer: usize,
}

impl<'a> Walk<'a> {
    pub(crate) fn new(r: Reader<'a>, rules: Rules) -> Self {
        Walk {
            r,
            rules,
            stack: Vec::new(),
            outer: r.end,
        }
    }

    /// Whether the bytes are all read.
    pub(crate) fn at_end(&self) -> bool {
        self.r.remaining() == 0
    }

    /// Reads one whole value, and whatever it holds.
    pub(crate) fn value(&mut self) -> Result<(), Refusal> {
        self.next()?;
        self.run()
    }

    /// Reads `count` whole values as one level of nesting below where the walk is: the
    /// value of a message section, or the top level of a run of values.
    pub(crate) fn values(&mut self, count: u64) -> Result<(), Refusal> {
        self.open(self.r.pos, Open::Values { left: count }, None, 0)?;
        self.run()
    }

    /// Reads one message section: `0x00`, a descriptor that names a section (`header` to
    /// `footer`), and its value.
    pub(crate) fn section(&mut self) -> Result<(), Refusal> {
        let at = self.r.pos;
        if self.r.byte()? != 0x00 {
            return Err(refuse(at, Why::NotASection));
        }
        let descriptor = self.r.pos;
        if self.r.section()?.is_none() {
            return Err(refuse(descriptor, Why::NotASection));
        }
        self.values(1)
    }

    /// Opens a container one level below the current one (`extra` more for an array of
    /// described elements), refused at `at` if that is too deep. `end` is where its size
    /// says it ends.
    fn open(
        &mut self,
        at: usize,
        open: Open,
        end: Option<usize>,
        extra: usize,
    ) -> Result<(), Refusal> {
        let depth = self.stack.last().map_or(0, |f| f.depth) + 1 + extra;
        if depth > self.rules.max_depth() {
            return Err(refuse(at, Why::TooDeep));
        }
        let limit = end.unwrap_or(self.r.end);
        self.stack.push(Frame {
            open,
            end,
            limit,
            depth,
        });
        self.r.end = limit;
        Ok(())
    }

    /// Reads values until every open container is complete.
    fn run(&mut self) -> Result<(), Refusal> {
        while let Some(&frame) = self.stack.last() {
            let top = self.stack.len() - 1;
            match frame.open {
                Open::Values { left: 0 } | Open::Elements { left: 0, .. } => {
                    if frame.end.is_some_and(|end| end != self.r.pos) {
                        return Err(refuse(self.r.pos, Why::SizeMismatch));
                    }
                    self.stack.pop();
                    self.r.end = self.stack.last().map_or(self.outer, |f| f.limit);
                }
                Open::Values { left } => {
                    self.stack[top].open = Open::Values { left: left - 1 };
                    self.next()?;
                }
                Open::Elements { left, code } => match codes::fixed_width(code) {
                    Some(width) => {
                        // Every element at once: zero-width ones may be counted in billions.
                        let n = usize::try_from(left)
                            .ok()
                            .and_then(|n| n.checked_mul(width))
                            .ok_or_else(|| refuse(self.r.pos, Why::Truncated))?;
                        self.stack[top].open = Open::Elements { left: 0, code };
                        self.r.take(n)?;
                    }
                    None => {
                        self.stack[top].open = Open::Elements {
                            left: left - 1,
                            code,
                        };
                        self.data(code, self.r.pos)?;
                    }
                },
            }
        }
        Ok(())
    }

    /// One value's constructor, then its data; a container it opens is read by [`run`].
    ///
    /// [`run`]: Walk::run
    fn next(&mut self) -> Result<(), Refusal> {
        let at = self.r.pos;
        let code = self.r.byte()?;
        if code != 0x00 {
            return self.data(code, at);
        }
        match self.rules {
            Rules::Strict => {
                self.descriptor()?;
                self.open(self.r.pos, Open::Values { left: 1 }, None, 0)
            }
            // The descriptor may be any value, described too: it is read as one.
            Rules::Lenient => self.open(at, Open::Values { left: 2 }, None, 0),
        }
    }

    /// The data of a value of format code `code`, whose constructor was at `at`.
    fn data(&mut self, code: u8, at: usize) -> Result<(), Refusal> {
        match self.rules {
            Rules::Strict => self.strict_data(code, at),
            Rules::Lenient => self.r.step_data(code, at),
        }
    }

    fn strict_data(&mut self, code: u8, at: usize) -> Result<(), Refusal> {
        match codes::defined_layout(code) {
            Some(Layout::Fixed(n)) => self.r.take(n).map(drop),
            Some(Layout::Variable { wide }) => {
                let n = self.r.size(wide)?;
                let data = self.r.take(n)?;
                if codes::is_text(code) && std::str::from_utf8(data).is_err() {
                    return Err(refuse(at, Why::NotUtf8));
                }
                Ok(())
            }
            Some(Layout::Compound { wide }) => self.compound(code, wide, false, at),
            Some(Layout::Array { wide }) => self.compound(code, wide, true, at),
            None => Err(refuse(at, Why::UnknownFormatCode(code))),
        }
    }

    /// A list, map or array after its constructor (at `at`): its size and count, checked
    /// against each other and the bytes, then its contents opened.
    fn compound(&mut self, code: u8, wide: bool, array: bool, at: usize) -> Result<(), Refusal> {
        let size = self.r.size(wide)?;
        let end = self
            .r
            .pos
            .checked_add(size)
            .filter(|end| *end <= self.r.end)
            .ok_or_else(|| refuse(at, Why::Truncated))?;
        let count_at = self.r.pos;
        let count = self.r.size(wide)?;
        if self.r.pos > end {
            return Err(refuse(count_at, Why::SizeMismatch));
        }
        let count_u64 = u64::try_from(count).unwrap_or(u64::MAX);
        if array {
            return self.array(count, count_u64, end);
        }
        // Every value takes a byte at least.
        if count > end - self.r.pos {
            return Err(refuse(count_at, Why::SizeMismatch));
        }
        if codes::is_map(code) && count % 2 != 0 {
            return Err(refuse(at, Why::OddMap));
        }
        self.open(self.r.pos, Open::Values { left: count_u64 }, Some(end), 0)
    }

    /// An array after its size and count: the element constructor, then the elements.
    fn array(&mut self, count: usize, left: u64, end: usize) -> Result<(), Refusal> {
        let at = self.r.pos;
        let mut code = self.element_code(end)?;
        let mut extra = 0;
        if code == 0x00 {
            self.descriptor()?;
            code = self.element_code(end)?;
            if code == 0x00 {
                return Err(refuse(at, Why::BadDescriptor));
            }
            extra = 1;
        }
        if !codes::is_defined(code) {
            return Err(refuse(at, Why::UnknownFormatCode(code)));
        }
        // Every element that is not of a fixed width takes a byte at least.
        if codes::fixed_width(code).is_none() && count > end.saturating_sub(self.r.pos) {
            return Err(refuse(at, Why::SizeMismatch));
        }
        self.open(self.r.pos, Open::Elements { left, code }, Some(end), extra)
    }

    fn element_code(&mut self, end: usize) -> Result<u8, Refusal> {
        if self.r.pos >= end {
            return Err(refuse(self.r.pos, Why::SizeMismatch));
        }
        self.r.byte()
    }

    /// A descriptor under [`Rules::Strict`]: a symbol or an unsigned long, as fe2o3-amqp
    /// reads them.
    fn descriptor(&mut self) -> Result<(), Refusal> {
        let at = self.r.pos;
        match self.r.byte()? {
            0x44 => Ok(()),
            0x53 => self.r.take(1).map(drop),
            0x80 => self.r.take(8).map(drop),
            code @ (0xa3 | 0xb3) => {
                let n = self.r.size(code == 0xb3)?;
                let symbol = self.r.take(n)?;
                if std::str::from_utf8(symbol).is_err() {
                    return Err(refuse(at, Why::NotUtf8));
                }
                Ok(())
            }
            _ => Err(refuse(at, Why::BadDescriptor)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes from a cheap deterministic generator, biased towards format codes that open
    /// containers and described values.
    fn random_inputs(count: usize) -> Vec<Vec<u8>> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..count)
            .map(|_| {
                let len = (next() % 48) as usize;
                (0..len)
                    .map(|_| {
                        let r = next();
                        match r % 3 {
                            0 => [0x00, 0x53, 0xa1, 0xc0, 0xc1, 0xe0, 0x40, 0x45, 0x02]
                                [(r >> 8) as usize % 9],
                            _ => (r >> 16) as u8,
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Both rules agree on where a value ends: whatever the strict walk reads as one value,
    /// the lenient one steps over to the same byte, unless it holds described values nested
    /// deeper than the lenient walk follows.
    #[test]
    fn strict_and_lenient_walks_end_a_value_at_the_same_byte() {
        let mut accepted = 0;
        for bytes in random_inputs(50_000) {
            let mut strict = Walk::new(Reader::new(&bytes), Rules::Strict);
            if strict.value().is_err() {
                continue;
            }
            accepted += 1;
            let mut lenient = Reader::new(&bytes);
            match lenient.step() {
                Ok(raw) => assert_eq!(raw.len(), strict.r.pos, "{bytes:02x?}"),
                Err(refusal) => assert_eq!(refusal.why, Why::TooDeep, "{bytes:02x?}"),
            }
        }
        assert!(accepted > 1_000, "only {accepted} values accepted");
    }

    #[test]
    fn a_step_stops_at_its_reader_end_and_restores_it() {
        // A str8 of five bytes, read whole and within a container of four bytes.
        let bytes = [0xa1, 0x05, b'a', b'b', b'c', b'd', b'e'];
        assert_eq!(Reader::new(&bytes).step(), Ok(&bytes[..]));
        let mut container = Reader::new(&bytes).split(4).unwrap();
        assert_eq!(
            container.step(),
            Err(Refusal {
                at: 2,
                why: Why::Truncated
            })
        );
        // Described values restore the end they were opened under.
        let described = [0x00, 0x53, 0x01, 0x40, 0x41];
        let mut r = Reader::new(&described);
        assert_eq!(r.step(), Ok(&described[..4]));
        assert_eq!(r.remaining(), 1);
        assert_eq!(r.step(), Ok(&[0x41][..]));
    }
}
