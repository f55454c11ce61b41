//! Whether async-nats 0.49 can hand a stored message over as a message, judged from its
//! header block alone.
//!
//! async-nats parses the header block of every message it receives itself, on the task that
//! runs the connection (`Connection::try_read_op`, its `HMSG` branch), and nats-server stores
//! whatever bytes a `HPUB` carries. A block that parser refuses fails the whole connection; a
//! value with a bare carriage return makes it panic, which ends that task and leaves a client
//! that never works again; a first line with a status code makes a pull read the message as
//! the server's word about the pull. [`check_header_block`] runs the same steps as that parser,
//! in the same order, on the bytes as they are stored, and says which of these would happen
//! and where.

use std::str::FromStr;

/// The longest text an error quotes from the block: a 60 KB line stays in the block.
const QUOTE: usize = 64;

/// What async-nats 0.49 does with a message whose header block it cannot take.
///
/// ```
/// use transport_nats::{ClientFailure, check_header_block};
///
/// let err = check_header_block(b"NATS/1.0\r\nno colon\r\n\r\n").unwrap_err();
/// assert_eq!(err.failure(), ClientFailure::ConnectionLost);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClientFailure {
    /// The client fails its connection (an I/O error) and reconnects; what the connection
    /// was receiving is lost with it.
    ConnectionLost,
    /// The task that runs the client's connection panics: the client never sends or
    /// receives again, and reports no event.
    ClientDies,
    /// The client reads the message as a status from the server: a pull ends, fails or
    /// skips it, and never hands it over.
    ReadAsStatus,
}

/// Why async-nats 0.49 cannot hand a header block's message over, and where in the block.
///
/// ```
/// use transport_nats::{HeaderBlockProblem, check_header_block};
///
/// let err = check_header_block(b"NATS/1.0\r\ntenant: ac\xffme\r\n\r\n").unwrap_err();
/// assert_eq!((err.line, err.offset), (2, 20));
/// assert!(matches!(&err.problem, HeaderBlockProblem::NotUtf8 { header: Some(h), in_name: false } if h == "tenant"));
/// assert_eq!(
///     err.to_string(),
///     "line 2, byte 20: the value of header \"tenant\" is not UTF-8 (the client fails its connection)"
/// );
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}, byte {offset}: {problem} ({})", self.failure().consequence())]
pub struct HeaderBlockError {
    /// The line the culprit is on, from 1, as the client splits lines (at each LF, a CR
    /// before it dropped).
    pub line: usize,
    /// Where the culprit starts in the block, from 0.
    pub offset: usize,
    /// What is wrong there.
    pub problem: HeaderBlockProblem,
}

impl HeaderBlockError {
    /// What the client does with a message that carries this block.
    ///
    /// ```
    /// use transport_nats::{ClientFailure, check_header_block};
    ///
    /// let err = check_header_block(b"NATS/1.0\r\na: x\ry\r\n\r\n").unwrap_err();
    /// assert_eq!(err.failure(), ClientFailure::ClientDies);
    /// ```
    pub fn failure(&self) -> ClientFailure {
        match self.problem {
            HeaderBlockProblem::CarriageReturn { .. } => ClientFailure::ClientDies,
            HeaderBlockProblem::Status { .. } => ClientFailure::ReadAsStatus,
            _ => ClientFailure::ConnectionLost,
        }
    }
}

impl ClientFailure {
    fn consequence(self) -> &'static str {
        match self {
            ClientFailure::ConnectionLost => "the client fails its connection",
            ClientFailure::ClientDies => "the client's connection task panics",
            ClientFailure::ReadAsStatus => "a pull reads it as the server's status",
        }
    }
}

/// What is wrong with a header block, as async-nats 0.49 sees it. Quoted text is cut at 64
/// characters.
///
/// ```
/// use transport_nats::{HeaderBlockProblem, check_header_block};
///
/// let err = check_header_block(b"NATS/1.0\r\nbad name: x\r\n\r\n").unwrap_err();
/// assert_eq!(err.problem, HeaderBlockProblem::BadName { name: "bad name".into(), character: ' ' });
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderBlockProblem {
    /// The block is not UTF-8: the client reads it as text, whole.
    #[error("{} is not UTF-8", not_utf8_where(header.as_deref(), *in_name))]
    NotUtf8 {
        /// The header whose line holds the first invalid byte, its name as far as it is
        /// UTF-8 (invalid bytes shown as U+FFFD); `None` for the first line, or a line that
        /// has no colon before it.
        header: Option<String>,
        /// The invalid byte is in that header's name, not its value.
        in_name: bool,
    },
    /// The block is empty: it has no first line.
    #[error("the block is empty")]
    Empty,
    /// The first line does not begin with `NATS/1.0`.
    #[error("the first line {first:?} does not begin with NATS/1.0")]
    NoVersion {
        /// The first line.
        first: String,
    },
    /// The first line has a status that is not a code from 100 to 999.
    #[error("the status {status:?} is not a three-digit code from 100 to 999")]
    BadStatus {
        /// What stands where the status goes.
        status: String,
    },
    /// The first line carries a status code (other than 200): the client takes the
    /// message for the server's status about a pull (408: the pull expired; 100: an idle
    /// heartbeat; ...).
    #[error("the first line carries the status {code}")]
    Status {
        /// The code.
        code: u16,
    },
    /// A header line has no `:`.
    #[error("the line {text:?} has no `:`")]
    NoColon {
        /// The line.
        text: String,
    },
    /// A header name holds a character other than printable ASCII, or a `:`.
    #[error(
        "the header name {name:?} holds {character:?}, and a name is printable ASCII without `:`"
    )]
    BadName {
        /// The name.
        name: String,
        /// Its first character the client refuses.
        character: char,
    },
    /// A header value holds a carriage return that is not part of a line end: async-nats
    /// asserts that a value holds none, and the assertion panics.
    #[error("the value of header {name:?} holds a carriage return")]
    CarriageReturn {
        /// The header.
        name: String,
    },
}

fn not_utf8_where(header: Option<&str>, in_name: bool) -> String {
    match (header, in_name) {
        (None, _) => "the line".to_owned(),
        (Some(name), true) => format!("the header name {name:?}"),
        (Some(name), false) => format!("the value of header {name:?}"),
    }
}

/// Checks a stored message's header block (the bytes nats-server keeps and delivers:
/// `NATS/1.0\r\n`, header lines, an empty line) the way async-nats 0.49 parses it when the
/// message arrives. `Ok` when the client hands the message over as a message; otherwise
/// what it does instead ([`HeaderBlockError::failure`]) and why, at the first culprit the
/// client would stop at.
///
/// Runs in time linear in the block, never panics, and never recurses.
///
/// ```
/// use transport_nats::{ClientFailure, check_header_block};
///
/// assert!(check_header_block(b"NATS/1.0\r\nNats-Msg-Id: order-7\r\n\r\n").is_ok());
/// // A continuation line belongs to the header before it.
/// assert!(check_header_block(b"NATS/1.0\r\nnote: one\r\n two\r\n\r\n").is_ok());
/// let status = check_header_block(b"NATS/1.0 408 Request Timeout\r\n\r\n").unwrap_err();
/// assert_eq!(status.failure(), ClientFailure::ReadAsStatus);
/// ```
pub fn check_header_block(block: &[u8]) -> Result<(), HeaderBlockError> {
    let text = match std::str::from_utf8(block) {
        Ok(text) => text,
        Err(e) => return Err(not_utf8(block, e.valid_up_to())),
    };
    let offset_of = |part: &str| (part.as_ptr() as usize).saturating_sub(text.as_ptr() as usize);
    let fail = |line: usize, offset: usize, problem: HeaderBlockProblem| {
        Err(HeaderBlockError {
            line,
            offset,
            problem,
        })
    };
    // The client's steps, in its order: `lines()`, the version line, the status, then each
    // header line with the continuation lines after it.
    let mut lines = text.lines().peekable();
    let Some(first) = lines.next() else {
        return fail(1, 0, HeaderBlockProblem::Empty);
    };
    let Some(suffix) = first.strip_prefix("NATS/1.0").map(str::trim) else {
        return fail(
            1,
            0,
            HeaderBlockProblem::NoVersion {
                first: quote(first),
            },
        );
    };
    let status = suffix
        .split_once(' ')
        .map_or(suffix, |(status, _description)| status.trim());
    // A status the client reads matters only once the rest of the block parses too.
    let mut read_as_status = None;
    if !status.is_empty() {
        match async_nats::StatusCode::from_str(status) {
            Err(_) => {
                return fail(
                    1,
                    offset_of(status),
                    HeaderBlockProblem::BadStatus {
                        status: quote(status),
                    },
                );
            }
            // A pull hands over only a message without a status, or with 200.
            Ok(code) if code != async_nats::StatusCode::OK => {
                read_as_status = Some((offset_of(status), code.as_u16()));
            }
            Ok(_) => {}
        }
    }
    let mut number = 1;
    while let Some(line) = lines.next() {
        number += 1;
        if line.is_empty() {
            continue;
        }
        let Some((name, value)) = line.split_once(':') else {
            return fail(
                number,
                offset_of(line),
                HeaderBlockProblem::NoColon { text: quote(line) },
            );
        };
        if async_nats::HeaderName::from_str(name).is_err() {
            let (at, character) = name
                .char_indices()
                .find(|&(_, c)| !c.is_ascii_graphic() || c == ':')
                // The client refuses what this rule finds; should it ever refuse more, the
                // name as a whole is the culprit.
                .unwrap_or((0, ' '));
            return fail(
                number,
                offset_of(name) + at,
                HeaderBlockProblem::BadName {
                    name: quote(name),
                    character,
                },
            );
        }
        // The value is the rest of the line with its start trimmed, every continuation line
        // (one that starts with whitespace) appended as it is, and the end trimmed; the
        // client then asserts it holds no CR. Each piece is kept with where it came from.
        let mut pieces = vec![(value.trim_start(), number)];
        while let Some(more) = lines.next_if(|s| s.starts_with(char::is_whitespace)) {
            number += 1;
            pieces.push((more, number));
        }
        // Everything up to the last non-whitespace character stays after the trim.
        let kept_to = pieces.iter().enumerate().rev().find_map(|(i, (piece, _))| {
            let trimmed = piece.trim_end();
            (!trimmed.is_empty()).then_some((i, trimmed.len()))
        });
        let Some((last, last_len)) = kept_to else {
            continue;
        };
        for (i, (piece, line_number)) in pieces.iter().enumerate().take(last + 1) {
            let kept = if i == last {
                piece.get(..last_len).unwrap_or(piece)
            } else {
                piece
            };
            if let Some(at) = kept.find('\r') {
                return fail(
                    *line_number,
                    offset_of(kept) + at,
                    HeaderBlockProblem::CarriageReturn { name: quote(name) },
                );
            }
        }
    }
    match read_as_status {
        Some((offset, code)) => fail(1, offset, HeaderBlockProblem::Status { code }),
        None => Ok(()),
    }
}

/// The headers of a block [`check_header_block`] passes, or passes but for its status (the
/// status is left out), read as async-nats reads them; otherwise why not.
pub(crate) fn header_map(block: &[u8]) -> Result<async_nats::HeaderMap, HeaderBlockError> {
    match check_header_block(block) {
        Ok(()) => {}
        Err(e) if e.failure() == ClientFailure::ReadAsStatus => {}
        Err(e) => return Err(e),
    }
    let mut map = async_nats::HeaderMap::new();
    // Checked: UTF-8, every name valid, no value with a CR.
    let text = std::str::from_utf8(block).unwrap_or_default();
    let mut lines = text.lines().skip(1).peekable();
    while let Some(line) = lines.next() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let mut value = value.trim_start().to_owned();
        while let Some(more) = lines.next_if(|s| s.starts_with(char::is_whitespace)) {
            value.push_str(more);
        }
        let (Ok(name), Ok(value)) = (
            async_nats::HeaderName::from_str(name),
            async_nats::HeaderValue::from_str(value.trim_end()),
        ) else {
            continue;
        };
        map.append(name, value);
    }
    Ok(map)
}

/// The error for a block whose first invalid UTF-8 byte is at `offset`.
fn not_utf8(block: &[u8], offset: usize) -> HeaderBlockError {
    let before = block.get(..offset).unwrap_or(block);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let in_line = before.get(start..).unwrap_or_default();
    let (header, in_name) = if line == 1 {
        (None, false)
    } else {
        match in_line.iter().position(|&b| b == b':') {
            Some(colon) => (
                Some(quote(&String::from_utf8_lossy(
                    in_line.get(..colon).unwrap_or_default(),
                ))),
                false,
            ),
            None => {
                // The name runs to the line's colon, past the invalid byte.
                let rest = block.get(start..).unwrap_or_default();
                let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
                let line_bytes = rest.get(..end).unwrap_or_default();
                match line_bytes.iter().position(|&b| b == b':') {
                    Some(colon) => (
                        Some(quote(&String::from_utf8_lossy(
                            line_bytes.get(..colon).unwrap_or_default(),
                        ))),
                        true,
                    ),
                    None => (None, false),
                }
            }
        }
    };
    HeaderBlockError {
        line,
        offset,
        problem: HeaderBlockProblem::NotUtf8 { header, in_name },
    }
}

/// At most [`QUOTE`] characters of `text`.
fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE) {
        Some((end, _)) => format!("{}…", text.get(..end).unwrap_or_default()),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_brokers::nats::header_block as block;

    fn problem(bytes: &[u8]) -> HeaderBlockError {
        check_header_block(bytes).expect_err("refused")
    }

    #[test]
    fn blocks_well_behaved_clients_write_pass() {
        for ok in [
            block(&[]),
            block(&[b"Nats-Msg-Id: order-1", b"x-retry-attempts: ~i:2"]),
            block(&[b"tenant:acme", b"empty:", b"spaced:  x  "]),
            // Control characters other than CR, and anything printable, in a value.
            block(&[
                b"c: a\x01\x07\x1b\x7fb\tc",
                "u: caf\u{e9} \u{2028}".as_bytes(),
            ]),
            // Engine headers holding garbage are the engine's business, not the client's.
            block(&[b"x-retry-attempts: ~i:notanumber"]),
            // A continuation line starting with a tab, then one with a space.
            block(&[b"note: one", b"\ttwo", b" three"]),
            // Empty lines in the middle are skipped.
            b"NATS/1.0\r\na: 1\r\n\r\nb: 2\r\n\r\n".to_vec(),
            // Bare LF line ends, and a last line with no end at all.
            b"NATS/1.0\na: 1\nb: 2".to_vec(),
            // 200 is no status for a pull, and neither is a description alone.
            b"NATS/1.0 200 OK\r\n\r\n".to_vec(),
            b"NATS/1.0\r\n\r\n".to_vec(),
            b"NATS/1.0  \r\n\r\n".to_vec(),
            // A CR at either end of a value is trimmed away before the client looks.
            b"NATS/1.0\r\na:\r x\r\r\n\r\n".to_vec(),
        ] {
            assert_eq!(
                check_header_block(&ok),
                Ok(()),
                "{}",
                String::from_utf8_lossy(&ok)
            );
        }
        let big = [b"big: ".as_slice(), &[b'v'; 60_000]].concat();
        assert_eq!(check_header_block(&block(&[&big])), Ok(()));
        let many: Vec<Vec<u8>> = (0..3000)
            .map(|i| format!("h{i}: {i}").into_bytes())
            .collect();
        let many: Vec<&[u8]> = many.iter().map(Vec::as_slice).collect();
        assert_eq!(check_header_block(&block(&many)), Ok(()));
    }

    #[test]
    fn a_value_that_is_not_utf8_names_its_header() {
        let err = problem(&block(&[b"a: 1", b"tenant: ac\xffme"]));
        assert_eq!((err.line, err.offset), (3, 26));
        assert_eq!(
            err.problem,
            HeaderBlockProblem::NotUtf8 {
                header: Some("tenant".into()),
                in_name: false
            }
        );
        assert_eq!(err.failure(), ClientFailure::ConnectionLost);
    }

    #[test]
    fn a_name_that_is_not_utf8_is_named_as_far_as_it_goes() {
        let err = problem(&block(&[b"ten\xfeant: acme"]));
        assert_eq!((err.line, err.offset), (2, 13));
        assert_eq!(
            err.problem,
            HeaderBlockProblem::NotUtf8 {
                header: Some("ten\u{fffd}ant".into()),
                in_name: true
            }
        );
    }

    #[test]
    fn a_message_id_that_is_not_utf8_is_a_value_like_any_other() {
        let err = problem(&block(&[b"Nats-Msg-Id: bad-\xff\xfe-id"]));
        assert_eq!(
            err.problem,
            HeaderBlockProblem::NotUtf8 {
                header: Some("Nats-Msg-Id".into()),
                in_name: false
            }
        );
        assert_eq!(err.offset, 27);
    }

    #[test]
    fn a_first_line_that_is_not_utf8_names_no_header() {
        let err = problem(b"NATS/1.0 \xff\r\n\r\n");
        assert_eq!(
            (err.line, err.offset, err.problem),
            (
                1,
                9,
                HeaderBlockProblem::NotUtf8 {
                    header: None,
                    in_name: false
                }
            )
        );
        // A line with no colon at all, its invalid byte anywhere.
        let err = problem(&block(&[b"no colon \xff here"]));
        assert_eq!(
            err.problem,
            HeaderBlockProblem::NotUtf8 {
                header: None,
                in_name: false
            }
        );
    }

    #[test]
    fn a_line_without_a_colon_is_quoted() {
        let err = problem(&block(&[b"a: 1", b"no colon here"]));
        assert_eq!((err.line, err.offset), (3, 16));
        assert_eq!(
            err.problem,
            HeaderBlockProblem::NoColon {
                text: "no colon here".into()
            }
        );
        assert!(err.to_string().contains("no colon here"), "{err}");
    }

    #[test]
    fn a_continuation_line_needs_a_header_before_it() {
        // Right after the first line it is a header line of its own, and a name cannot
        // start with a space.
        let err = problem(&block(&[b" x: 1"]));
        assert_eq!(
            err.problem,
            HeaderBlockProblem::BadName {
                name: " x".into(),
                character: ' '
            }
        );
        assert_eq!(err.offset, 10);
        let err = problem(&block(&[b" folded"]));
        assert!(matches!(err.problem, HeaderBlockProblem::NoColon { .. }));
        // After an empty line too: the empty line is skipped, the header before it ended.
        let err = problem(b"NATS/1.0\r\na: 1\r\n\r\n more\r\n\r\n");
        assert!(matches!(err.problem, HeaderBlockProblem::NoColon { .. }));
        // Unicode whitespace continues a value as much as a space does.
        assert_eq!(
            check_header_block("NATS/1.0\r\na: 1\r\n\u{a0}more\r\n\r\n".as_bytes()),
            Ok(())
        );
    }

    #[test]
    fn names_are_printable_ascii_without_colons() {
        for (line, character) in [
            (b"bad name: x".as_slice(), ' '),
            (b"tab\tname: x", '\t'),
            (b"del\x7f: x", '\x7f'),
            ("caf\u{e9}: x".as_bytes(), '\u{e9}'),
        ] {
            let err = problem(&block(&[line]));
            match &err.problem {
                HeaderBlockProblem::BadName { character: c, .. } => assert_eq!(*c, character),
                other => panic!("{other:?}"),
            }
        }
        // An empty name: the client refuses none of its characters, and takes it.
        assert_eq!(check_header_block(&block(&[b": x"])), Ok(()));
    }

    #[test]
    fn a_bare_cr_inside_a_value_kills_the_client() {
        let err = problem(&block(&[b"a: x\ry"]));
        assert_eq!(
            (err.line, err.offset, err.failure()),
            (2, 14, ClientFailure::ClientDies)
        );
        assert_eq!(
            err.problem,
            HeaderBlockProblem::CarriageReturn { name: "a".into() }
        );
        // In a continuation line, and at the start of one whose header's value is empty
        // (the client trims only the first piece's start).
        let err = problem(&block(&[b"a: x", b" y\rz"]));
        assert_eq!((err.line, err.offset), (3, 18));
        let err = problem(&block(&[b"a:", b" \rz"]));
        assert_eq!((err.line, err.offset), (3, 15));
        // A CR at the very end of the last line (no LF) is trimmed.
        assert_eq!(check_header_block(b"NATS/1.0\r\na: x\r"), Ok(()));
        assert_eq!(check_header_block(b"NATS/1.0\r\na: x\r\n \r"), Ok(()));
    }

    #[test]
    fn the_first_line_and_its_status() {
        assert_eq!(problem(b"").problem, HeaderBlockProblem::Empty);
        let err = problem(b"NATS/1.1\r\n\r\n");
        assert_eq!(
            err.problem,
            HeaderBlockProblem::NoVersion {
                first: "NATS/1.1".into()
            }
        );
        let err = problem(b"\r\nNATS/1.0\r\n\r\n");
        assert!(matches!(err.problem, HeaderBlockProblem::NoVersion { .. }));
        for bad in ["abc", "99", "1000", "099", "20x", "garbage"] {
            let err = problem(format!("NATS/1.0 {bad} What\r\n\r\n").as_bytes());
            assert_eq!(
                err.problem,
                HeaderBlockProblem::BadStatus { status: bad.into() },
                "{bad}"
            );
            assert_eq!(err.offset, 9);
        }
        for (first, code) in [
            ("NATS/1.0 408 Request Timeout", 408),
            ("NATS/1.0 100 Idle Heartbeat", 100),
            ("NATS/1.0 503", 503),
            ("NATS/1.0    404   No Messages", 404),
            ("NATS/1.0999", 999),
        ] {
            let err = problem(format!("{first}\r\n\r\n").as_bytes());
            assert_eq!(err.problem, HeaderBlockProblem::Status { code }, "{first}");
            assert_eq!(err.failure(), ClientFailure::ReadAsStatus);
        }
    }

    #[test]
    fn a_status_counts_only_once_the_headers_parse() {
        let err = problem(b"NATS/1.0 408 Request Timeout\r\n :\r\n");
        assert_eq!(err.failure(), ClientFailure::ConnectionLost);
        let err = problem(b"NATS/1.0 408 Request Timeout\r\na: 1\r\n\r\n");
        assert_eq!(err.failure(), ClientFailure::ReadAsStatus);
    }

    #[test]
    fn the_first_culprit_is_reported() {
        // The client checks UTF-8 over the whole block before anything else.
        let err = problem(&block(&[b"no colon", b"a: \xff"]));
        assert!(matches!(err.problem, HeaderBlockProblem::NotUtf8 { .. }));
        // Then lines in order.
        let err = problem(&block(&[b"bad name: x", b"no colon"]));
        assert!(matches!(err.problem, HeaderBlockProblem::BadName { .. }));
    }

    #[test]
    fn a_passing_block_reads_as_async_nats_reads_it() {
        let map =
            header_map(b"NATS/1.0 408 Timeout\r\na: 1\r\nnote:  one\r\n two \r\na: 2\r\n\r\n")
                .expect("readable");
        let all: Vec<&str> = map.get_all("a").map(|v| v.as_str()).collect();
        assert_eq!(all, ["1", "2"]);
        assert_eq!(map.get("note").map(|v| v.as_str()), Some("one two"));
        assert!(header_map(b"NATS/1.0\r\na: x\ry\r\n\r\n").is_err());
    }

    #[test]
    fn long_culprits_are_quoted_short() {
        let long = vec![b'x'; 60_000];
        let err = problem(&block(&[&long]));
        match &err.problem {
            HeaderBlockProblem::NoColon { text } => assert_eq!(text.chars().count(), QUOTE + 1),
            other => panic!("{other:?}"),
        }
    }
}
