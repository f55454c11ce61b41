//! `Tapped`: the byte stream between a connection's socket (or its TLS session) and lapin,
//! which checks every frame that carries a message before lapin parses it.
//!
//! lapin fails the whole connection on a message it cannot parse, and aborts the process on
//! one nested too deeply (see the `inspect` module); the broker then hands the same message
//! to the next consumer, which dies on it too. So each frame coming in is read here first:
//!
//! * a content header that lapin would refuse, or that nests deeper than
//!   [`MAX_NESTING`](crate::inspect::MAX_NESTING), reaches lapin replaced by one it reads:
//!   the same class and body size, and one header, [`MARK`], which holds a token. Why it
//!   was refused and the properties as they came wait in the [`Refusals`] under that token
//!   for the transport, which settles the delivery (see `convert::received`);
//! * a `basic.deliver`, `basic.get-ok` or `basic.return` whose exchange, routing key or
//!   other short string is not UTF-8 reaches lapin with those strings made readable, and its
//!   message's content header is replaced as above, whatever it holds.
//!
//! Everything else passes as it came, body frames included. Frames are bounded by the
//! `frame_max` lapin agrees to, read from the broker's `connection.tune` (128 KiB before
//! it): a larger one fails the stream without being buffered. A protocol header from the broker (a version it refuses)
//! passes untouched, and so does everything after it.
//!
//! The token is the tap's secret followed by a counter: a publisher that writes [`MARK`]
//! itself cannot name a refusal, and its header is dropped as any other forged mark.
//!
//! For tests only, the tap can also lose `basic.get-ok`s ([`Refusals::lose_get_oks`]): the
//! frames of such a get-ok never reach lapin, as if it were late past any timeout, so the
//! broker holds its message unacknowledged on the get's channel until that channel closes.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncWrite};
use lapin::protocol::constants::FRAME_MIN_SIZE;

use crate::inspect::{self, Refusal};

/// The header a replaced content header carries: a token naming its [`Refused`] entry.
pub(crate) const MARK: &str = "x-amqp091-tap";

/// The largest frame before the broker's `connection.tune`: the protocol allows 4 KiB until
/// then, and RabbitMQ's `connection.start` is under 1 KiB.
const BEFORE_TUNE: usize = 128 * 1024;

/// The largest frame when neither the broker nor the URL sets a `frame_max`, and lapin takes
/// any: RabbitMQ's largest message.
const NO_LIMIT: usize = 128 << 20;

/// How many refusals wait for the transport at most, and how many of their bytes: a
/// delivery lapin drops unread (its channel closed) never takes its entry.
const REFUSALS_KEPT: usize = 256;
const REFUSED_BYTES_KEPT: usize = 8 << 20;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_END: u8 = 0xCE;
/// A frame's type, channel and size.
const FRAME_HEAD: usize = 7;
/// The `channel` class: a channel opened or closed starts its frames afresh.
const CHANNEL_CLASS: u16 = 20;
/// `connection.tune`: the broker's `frame_max`.
const TUNE: [u8; 4] = [0, 10, 0, 30];
/// `basic.get-ok`.
const GET_OK: [u8; 4] = [0, 60, 0, 71];
/// A frame carrying a piece of a message's body.
const FRAME_BODY: u8 = 3;

/// A message the tap kept from lapin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refused {
    pub(crate) refusal: Refusal,
    /// The content header's properties (property flags, then the property list) as they
    /// came.
    pub(crate) properties: Vec<u8>,
}

/// What a mark names.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// A message the tap refused.
    Refused(Refused),
    /// A message the tap refused, whose entry was dropped to bound memory.
    Forgotten,
    /// Not a mark of this tap: the header came from a publisher.
    Forged,
}

/// The refused messages of one transport's connections, by token; and, for tests, how many
/// `basic.get-ok`s their taps are still to lose.
#[derive(Debug)]
pub(crate) struct Refusals {
    secret: u64,
    state: Mutex<Kept>,
    get_oks_to_lose: AtomicU32,
}

#[derive(Debug, Default)]
struct Kept {
    next: u64,
    entries: BTreeMap<u64, Refused>,
    bytes: usize,
}

impl Refusals {
    pub(crate) fn new() -> Self {
        // The process's random hasher keys: no random-number crate for one secret.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x5eed);
        Refusals {
            secret: h.finish(),
            state: Mutex::new(Kept::default()),
            get_oks_to_lose: AtomicU32::new(0),
        }
    }

    /// The next `n` `basic.get-ok`s the taps read never reach lapin, their content frames
    /// neither: as if each came after the fetch gave up. For tests.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn lose_get_oks(&self, n: u32) {
        self.get_oks_to_lose.fetch_add(n, Ordering::AcqRel);
    }

    /// Whether a `basic.get-ok` just read is to be lost.
    fn lose_get_ok(&self) -> bool {
        self.get_oks_to_lose
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `refused` and returns the token that names it.
    fn keep(&self, refused: Refused) -> String {
        let mut kept = self.lock();
        let id = kept.next;
        kept.next += 1;
        kept.bytes += refused.properties.len();
        kept.entries.insert(id, refused);
        while kept.entries.len() > REFUSALS_KEPT || kept.bytes > REFUSED_BYTES_KEPT {
            let Some((_, oldest)) = kept.entries.pop_first() else {
                break;
            };
            kept.bytes -= oldest.properties.len();
        }
        format!("{:016x}{id:016x}", self.secret)
    }

    /// How many refusals it has kept so far, taken or not.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn issued(&self) -> usize {
        self.lock().next as usize
    }

    /// Takes the refusal `token` names.
    pub(crate) fn take(&self, token: &[u8]) -> Lookup {
        let parsed = std::str::from_utf8(token)
            .ok()
            .filter(|t| t.len() == 32)
            .and_then(|t| {
                Some((
                    u64::from_str_radix(&t[..16], 16).ok()?,
                    u64::from_str_radix(&t[16..], 16).ok()?,
                ))
            });
        match parsed {
            Some((secret, id)) if secret == self.secret => {
                let mut kept = self.lock();
                match kept.entries.remove(&id) {
                    Some(refused) => {
                        kept.bytes -= refused.properties.len();
                        Lookup::Refused(refused)
                    }
                    None => Lookup::Forgotten,
                }
            }
            _ => Lookup::Forged,
        }
    }
}

/// The incoming side, without IO: bytes in, checked frames out.
#[derive(Debug)]
pub(crate) struct Frames {
    /// Bytes not yet framed.
    input: Vec<u8>,
    /// Bytes for lapin, from `read`.
    output: Vec<u8>,
    read: usize,
    /// The largest frame that may come, its header and end byte included.
    frame_max: usize,
    /// The `frame_max` the connection proposes (the URL's), if any.
    proposed: Option<u32>,
    /// Per channel: a refusal of the method frame whose content header comes next.
    announced: HashMap<u16, Refusal>,
    /// Per channel, a `basic.get-ok` being lost: `None` until its content header says how
    /// many body bytes are still to drop.
    losing: HashMap<u16, Option<u64>>,
    /// The broker refused the protocol version: everything passes untouched.
    passthrough: bool,
}

impl Frames {
    /// For a connection that proposes `proposed` as its `frame_max`.
    pub(crate) fn new(proposed: Option<u32>) -> Self {
        Frames {
            input: Vec::new(),
            output: Vec::new(),
            read: 0,
            frame_max: BEFORE_TUNE,
            proposed: proposed.filter(|&n| n > 0),
            announced: HashMap::new(),
            losing: HashMap::new(),
            passthrough: false,
        }
    }

    pub(crate) fn has_output(&self) -> bool {
        self.read < self.output.len()
    }

    /// Copies what is ready into `buf`; returns how much.
    pub(crate) fn read_into(&mut self, buf: &mut [u8]) -> usize {
        let n = buf.len().min(self.output.len() - self.read);
        buf[..n].copy_from_slice(&self.output[self.read..self.read + n]);
        self.read += n;
        if self.read == self.output.len() {
            self.output.clear();
            self.read = 0;
        }
        n
    }

    /// The stream ended: an unfinished frame goes out as it came, for lapin to report.
    pub(crate) fn finish(&mut self) {
        self.output.append(&mut self.input);
    }

    /// The broker proposed `frame_max` in its `connection.tune`: what lapin agrees to, as it
    /// agrees (the smaller of the two proposals, either where the other is 0; at least its
    /// `FRAME_MIN_SIZE`), bounds every frame from now on.
    fn tuned(&mut self, frame_max: u32) {
        let agreed = match (frame_max, self.proposed) {
            (0, None) => 0,
            (0, Some(ours)) => ours,
            (theirs, Some(ours)) => theirs.min(ours),
            (theirs, None) => theirs,
        };
        self.frame_max = match agreed {
            0 => NO_LIMIT,
            n => n.max(FRAME_MIN_SIZE) as usize,
        };
    }

    /// Takes `bytes` from the socket. A frame larger than the connection allows is an
    /// error: the broker never sends one, and it is not buffered.
    pub(crate) fn feed(&mut self, bytes: &[u8], refusals: &Refusals) -> io::Result<()> {
        if self.passthrough {
            self.output.extend_from_slice(bytes);
            return Ok(());
        }
        // Complete frames are read in place from `bytes` when nothing is pending, which is
        // nearly always; only a frame cut by the read is copied into `input`.
        let pending = std::mem::take(&mut self.input);
        let mut joined;
        let data: &[u8] = if pending.is_empty() {
            bytes
        } else {
            joined = pending;
            joined.extend_from_slice(bytes);
            &joined
        };
        let mut at = 0;
        while at < data.len() {
            let rest = &data[at..];
            if rest[0] == b'A' {
                // No frame type: "AMQP" and a version, the broker refusing ours. It closes
                // the connection after it; everything passes as it came.
                self.passthrough = true;
                self.output.extend_from_slice(rest);
                at = data.len();
                break;
            }
            if rest.len() < FRAME_HEAD {
                break;
            }
            let size = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]) as usize;
            let whole = FRAME_HEAD + size + 1;
            if whole > self.frame_max {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the broker sent a frame of {whole} bytes, over the {} this connection allows",
                        self.frame_max
                    ),
                ));
            }
            if rest.len() < whole {
                break;
            }
            self.frame(&rest[..whole], refusals);
            at += whole;
        }
        self.input = data[at..].to_vec();
        Ok(())
    }

    fn frame(&mut self, frame: &[u8], refusals: &Refusals) {
        let kind = frame[0];
        let channel = u16::from_be_bytes([frame[1], frame[2]]);
        let payload = &frame[FRAME_HEAD..frame.len() - 1];
        if frame[frame.len() - 1] != FRAME_END {
            // Not a frame lapin reads: it reports it.
            self.output.extend_from_slice(frame);
            return;
        }
        if !self.losing.is_empty() && self.lost(kind, channel, payload) {
            return;
        }
        match kind {
            FRAME_METHOD => {
                if payload.get(..4) == Some(&GET_OK[..]) && refusals.lose_get_ok() {
                    self.losing.insert(channel, None);
                    return;
                }
                if channel == 0
                    && payload.get(..4) == Some(&TUNE[..])
                    && let Some(b) = payload.get(6..10)
                {
                    self.tuned(u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                }
                if payload.get(..2) == Some(&CHANNEL_CLASS.to_be_bytes()) {
                    self.announced.remove(&channel);
                }
                if !inspect::announces_content(payload) {
                    self.output.extend_from_slice(frame);
                    return;
                }
                match inspect::check_delivery_method(payload) {
                    None => {
                        self.announced.remove(&channel);
                        self.output.extend_from_slice(frame);
                    }
                    Some(rewritten) => {
                        self.announced.insert(channel, rewritten.refusal);
                        self.put_frame(FRAME_METHOD, channel, &rewritten.payload);
                    }
                }
            }
            FRAME_HEADER => {
                // Nearly always empty: no lookup then.
                let announced = match self.announced.is_empty() {
                    true => None,
                    false => self.announced.remove(&channel),
                };
                let verdict = inspect::check_content_header(payload);
                let refusal = match (announced, verdict) {
                    (Some(refusal), _) | (None, Err(refusal)) => refusal,
                    (None, Ok(())) => {
                        self.output.extend_from_slice(frame);
                        return;
                    }
                };
                if payload.len() < inspect::FIXED {
                    // No body size to keep: nothing lapin could read in its place.
                    self.output.extend_from_slice(frame);
                    return;
                }
                let token = refusals.keep(Refused {
                    refusal,
                    properties: payload[inspect::FIXED - 2..].to_vec(),
                });
                let replaced = marked_header(&payload[..inspect::FIXED - 2], &token);
                self.put_frame(FRAME_HEADER, channel, &replaced);
            }
            _ => self.output.extend_from_slice(frame),
        }
    }

    /// Whether the frame belongs to a `basic.get-ok` being lost, and so goes no further.
    fn lost(&mut self, kind: u8, channel: u16, payload: &[u8]) -> bool {
        let Some(state) = self.losing.get_mut(&channel) else {
            return false;
        };
        let left = match (kind, *state) {
            (FRAME_HEADER, None) if payload.len() >= 12 => {
                u64::from_be_bytes(payload[4..12].try_into().unwrap_or_default())
            }
            (FRAME_BODY, Some(left)) => left.saturating_sub(payload.len() as u64),
            // Anything else (a channel closing, a frame out of order) ends the loss there.
            _ => {
                self.losing.remove(&channel);
                return false;
            }
        };
        if left == 0 {
            self.losing.remove(&channel);
        } else {
            *state = Some(left);
        }
        true
    }

    fn put_frame(&mut self, kind: u8, channel: u16, payload: &[u8]) {
        self.output.push(kind);
        self.output.extend_from_slice(&channel.to_be_bytes());
        self.output.extend_from_slice(
            &u32::try_from(payload.len())
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        self.output.extend_from_slice(payload);
        self.output.push(FRAME_END);
    }
}

/// A content header payload with `head` (class, weight, body size) and, as its only
/// property, a header table holding [`MARK`] = `token`.
fn marked_header(head: &[u8], token: &str) -> Vec<u8> {
    let mut table = Vec::with_capacity(MARK.len() + token.len() + 6);
    table.push(MARK.len() as u8);
    table.extend_from_slice(MARK.as_bytes());
    table.push(b'S');
    table.extend_from_slice(&(token.len() as u32).to_be_bytes());
    table.extend_from_slice(token.as_bytes());
    let mut out = Vec::with_capacity(head.len() + 6 + table.len());
    out.extend_from_slice(head);
    out.extend_from_slice(&(1u16 << 13).to_be_bytes());
    out.extend_from_slice(&(table.len() as u32).to_be_bytes());
    out.extend_from_slice(&table);
    out
}

/// A stream whose incoming bytes go through [`Frames`]; see the [module](self) docs.
pub(crate) struct Tapped<S> {
    inner: S,
    frames: Frames,
    refusals: std::sync::Arc<Refusals>,
    scratch: Box<[u8]>,
    eof: bool,
}

impl<S> std::fmt::Debug for Tapped<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tapped").finish_non_exhaustive()
    }
}

impl<S> Tapped<S> {
    pub(crate) fn new(inner: S, proposed: Option<u32>, refusals: std::sync::Arc<Refusals>) -> Self {
        Tapped {
            inner,
            frames: Frames::new(proposed),
            refusals,
            scratch: vec![0; 64 * 1024].into_boxed_slice(),
            eof: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tapped<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            if this.frames.has_output() {
                return Poll::Ready(Ok(this.frames.read_into(buf)));
            }
            if this.eof || buf.is_empty() {
                return Poll::Ready(Ok(0));
            }
            match Pin::new(&mut this.inner).poll_read(cx, &mut this.scratch) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(0)) => {
                    this.eof = true;
                    this.frames.finish();
                }
                Poll::Ready(Ok(n)) => {
                    if let Err(e) = this.frames.feed(&this.scratch[..n], &this.refusals) {
                        return Poll::Ready(Err(e));
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tapped<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::basic::parse_properties;
    use lapin::types::AMQPValue;
    use test_brokers::rabbitmq::{RawProperties, RawTable};

    fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![kind];
        out.extend_from_slice(&channel.to_be_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out.push(FRAME_END);
        out
    }

    fn deliver(channel: u16, routing_key: &[u8]) -> Vec<u8> {
        let mut p = vec![0, 60, 0, 60, 4];
        p.extend_from_slice(b"ctag");
        p.extend_from_slice(&9u64.to_be_bytes());
        p.push(0);
        p.push(0);
        p.push(routing_key.len() as u8);
        p.extend_from_slice(routing_key);
        frame(FRAME_METHOD, channel, &p)
    }

    fn header(channel: u16, properties: &RawProperties) -> Vec<u8> {
        let mut p = vec![0, 60, 0, 0];
        p.extend_from_slice(&3u64.to_be_bytes());
        p.extend_from_slice(&properties.encode());
        frame(FRAME_HEADER, channel, &p)
    }

    fn body(channel: u16) -> Vec<u8> {
        frame(3, channel, b"abc")
    }

    /// Feeds `bytes` in pieces of `step` and returns what lapin reads.
    fn through(frames: &mut Frames, refusals: &Refusals, bytes: &[u8], step: usize) -> Vec<u8> {
        for piece in bytes.chunks(step) {
            frames.feed(piece, refusals).unwrap();
        }
        let mut out = vec![0; bytes.len() * 2 + 256];
        let n = frames.read_into(&mut out);
        out.truncate(n);
        out
    }

    /// The mark in a content header frame lapin reads, and its body size.
    fn mark_of(frame_bytes: &[u8]) -> (Vec<u8>, u64) {
        assert_eq!(frame_bytes[0], FRAME_HEADER);
        let payload = &frame_bytes[FRAME_HEAD..frame_bytes.len() - 1];
        let size = u64::from_be_bytes(payload[4..12].try_into().unwrap());
        let (rest, properties) = parse_properties(&payload[12..]).expect("lapin parses it");
        assert!(rest.is_empty());
        let headers = properties.headers().clone().expect("headers");
        let Some(AMQPValue::LongString(token)) = headers.inner().get(MARK) else {
            panic!("no mark in {headers:?}");
        };
        (token.as_bytes().to_vec(), size)
    }

    #[test]
    fn good_frames_pass_unchanged_however_the_reads_cut_them() {
        let props = RawProperties::new()
            .message_id(b"id")
            .headers(&RawTable::new().entry(b"deep", &RawTable::nested_tables(20)));
        let stream = [
            deliver(1, b"q"),
            header(1, &props),
            body(1),
            frame(8, 0, b""),
        ]
        .concat();
        for step in 1..stream.len() {
            let refusals = Refusals::new();
            let mut frames = Frames::new(None);
            assert_eq!(
                through(&mut frames, &refusals, &stream, step),
                stream,
                "reads of {step}"
            );
        }
    }

    #[test]
    fn a_header_lapin_cannot_read_is_replaced_by_a_mark_naming_it() {
        let refusals = Refusals::new();
        let mut frames = Frames::new(None);
        let bad = RawProperties::new().message_id(b"bad-\xff");
        let stream = [deliver(1, b"q"), header(1, &bad), body(1)].concat();
        let out = through(&mut frames, &refusals, &stream, 5);
        let deliver_len = deliver(1, b"q").len();
        assert_eq!(out[..deliver_len], stream[..deliver_len]);
        let header_len = FRAME_HEAD
            + u32::from_be_bytes(out[deliver_len + 3..deliver_len + 7].try_into().unwrap())
                as usize
            + 1;
        let (token, size) = mark_of(&out[deliver_len..deliver_len + header_len]);
        assert_eq!(size, 3, "the body size is kept");
        assert_eq!(out[deliver_len + header_len..], body(1)[..]);
        let Lookup::Refused(refused) = refusals.take(&token) else {
            panic!("the mark names nothing")
        };
        assert_eq!(refused.refusal.field, "message-id");
        assert_eq!(refused.properties, bad.encode());
        assert_eq!(refusals.take(&token), Lookup::Forgotten, "taken once");
        // Another tap's token, or anything else, is a forgery.
        assert_eq!(Refusals::new().take(&token), Lookup::Forged);
        assert_eq!(refusals.take(b"x-retry"), Lookup::Forged);
    }

    #[test]
    fn a_routing_key_lapin_cannot_read_marks_its_message() {
        let refusals = Refusals::new();
        let mut frames = Frames::new(None);
        let good = RawProperties::new().message_id(b"fine");
        let stream = [
            deliver(2, b"k\xff"),
            header(2, &good),
            body(2),
            deliver(2, b"q"),
            header(2, &good),
        ]
        .concat();
        let out = through(&mut frames, &refusals, &stream, stream.len());
        let rewritten = deliver(2, "k\u{fffd}".as_bytes());
        assert_eq!(out[..rewritten.len()], rewritten[..]);
        let rest = &out[rewritten.len()..];
        let header_len =
            FRAME_HEAD + u32::from_be_bytes(rest[3..7].try_into().unwrap()) as usize + 1;
        let (token, _) = mark_of(&rest[..header_len]);
        let Lookup::Refused(refused) = refusals.take(&token) else {
            panic!("the mark names nothing")
        };
        assert_eq!(refused.refusal.field, "routing-key");
        assert_eq!(refused.properties, good.encode());
        // The next message on the channel is read as it came.
        let tail = [body(2), deliver(2, b"q"), header(2, &good)].concat();
        assert_eq!(rest[header_len..], tail[..]);
    }

    #[test]
    fn a_channel_closed_between_method_and_header_forgets_the_method() {
        let refusals = Refusals::new();
        let mut frames = Frames::new(None);
        let close_ok = frame(FRAME_METHOD, 3, &[0, 20, 0, 41]);
        let good = RawProperties::new();
        let stream = [deliver(3, b"\xff"), close_ok, header(3, &good)].concat();
        let out = through(&mut frames, &refusals, &stream, stream.len());
        assert!(
            out.ends_with(&header(3, &good)),
            "the header passes as it came"
        );
    }

    #[test]
    fn a_get_ok_to_lose_never_reaches_lapin_and_what_follows_does() {
        let refusals = Refusals::new();
        refusals.lose_get_oks(1);
        let get_ok = |channel| {
            let mut p = GET_OK.to_vec();
            p.extend_from_slice(&5u64.to_be_bytes());
            p.extend_from_slice(&[0, 0, 1, b'q', 0, 0, 0, 0]);
            frame(FRAME_METHOD, channel, &p)
        };
        let good = RawProperties::new().message_id(b"fine");
        let lost = [get_ok(4), header(4, &good), body(4)].concat();
        let kept = [get_ok(4), header(4, &good), body(4)].concat();
        let other = [deliver(5, b"q"), header(5, &good), body(5)].concat();
        for step in [1, 7, 1000] {
            let refusals = Refusals::new();
            refusals.lose_get_oks(1);
            let mut frames = Frames::new(None);
            let stream = [lost.clone(), other.clone(), kept.clone()].concat();
            let out = through(&mut frames, &refusals, &stream, step);
            assert_eq!(
                out,
                [other.clone(), kept.clone()].concat(),
                "reads of {step}"
            );
        }
        // Interleaved with another channel's frames, and lost only as many times as asked.
        let mut frames = Frames::new(None);
        let stream = [
            get_ok(4),
            deliver(5, b"q"),
            header(4, &good),
            header(5, &good),
            body(4),
            body(5),
            kept.clone(),
        ]
        .concat();
        let out = through(&mut frames, &refusals, &stream, 3);
        assert_eq!(out, [other, kept].concat());
    }

    /// `connection.tune` with `frame_max`.
    fn tune(frame_max: u32) -> Vec<u8> {
        let mut p = TUNE.to_vec();
        p.extend_from_slice(&2047u16.to_be_bytes());
        p.extend_from_slice(&frame_max.to_be_bytes());
        p.extend_from_slice(&60u16.to_be_bytes());
        frame(FRAME_METHOD, 0, &p)
    }

    #[test]
    fn a_frame_over_the_agreed_frame_max_fails_the_stream_without_being_buffered() {
        let refusals = Refusals::new();
        // (the broker's proposal, the URL's, the largest frame lapin then agrees to)
        for (theirs, ours, agreed) in [
            (131_072, None, 131_072),
            (131_072, Some(8_192), 8_192),
            (0, Some(8_192), 8_192),
            (1_000, None, FRAME_MIN_SIZE as usize),
            (0, None, NO_LIMIT),
        ] {
            let mut frames = Frames::new(ours);
            frames.feed(&tune(theirs), &refusals).unwrap();
            let size = u32::try_from(agreed - 8).unwrap();
            let fits = [&[FRAME_HEADER, 0, 1][..], &size.to_be_bytes()].concat();
            assert!(frames.feed(&fits, &refusals).is_ok(), "{agreed} fits");
            let mut frames = Frames::new(ours);
            frames.feed(&tune(theirs), &refusals).unwrap();
            let over = [&[FRAME_HEADER, 0, 1][..], &(size + 1).to_be_bytes()].concat();
            let err = frames.feed(&over, &refusals).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            assert!(
                err.to_string().contains(&format!("over the {agreed}")),
                "{err}"
            );
            assert!(frames.input.len() < FRAME_HEAD, "nothing buffered");
        }
        // Before the tune: 128 KiB.
        let mut frames = Frames::new(None);
        let head = [FRAME_HEADER, 0, 1, 0, 2, 0, 0];
        assert!(frames.feed(&head, &refusals).is_err());
    }

    #[test]
    fn a_protocol_header_from_the_broker_passes_with_all_after_it() {
        let refusals = Refusals::new();
        let mut frames = Frames::new(None);
        let stream = b"AMQP\x00\x00\x09\x01\x02\xff\xff\xff\xff\xff";
        assert_eq!(through(&mut frames, &refusals, stream, 3), stream);
    }

    #[test]
    fn refusals_kept_are_bounded_oldest_first() {
        let refusals = Refusals::new();
        let refused = |n: usize| Refused {
            refusal: Refusal {
                field: "message-id".into(),
                problem: inspect::Problem::Trailing(n),
            },
            properties: vec![0; 64 * 1024],
        };
        let tokens: Vec<String> = (0..200).map(|n| refusals.keep(refused(n))).collect();
        // 200 × 64 KiB is over the byte bound: the oldest went first.
        assert_eq!(refusals.take(tokens[0].as_bytes()), Lookup::Forgotten);
        assert!(matches!(
            refusals.take(tokens[199].as_bytes()),
            Lookup::Refused(_)
        ));
        let kept = refusals.lock();
        assert!(kept.bytes <= REFUSED_BYTES_KEPT && kept.entries.len() <= REFUSALS_KEPT);
    }
}
