//! `Tapped`: the byte stream between a connection's socket and fe2o3, which reads the AMQP
//! frames coming in before fe2o3 does.
//!
//! It does two things fe2o3 0.18 offers no way to do:
//!
//! * **Every message is checked before fe2o3 decodes it** ([`amqp10::check_message`]): a
//!   valid encoding, nested no deeper than [`amqp10::MAX_DEPTH`]. fe2o3 decodes a message by
//!   recursing once per level of nesting, and a message nested thousands deep overflows the
//!   stack and aborts the process. A message that fails the check reaches fe2o3 with its
//!   payload replaced by one byte that is no format code, so fe2o3 reports it as a
//!   `MessageDecodeError` (which carries what is needed to settle it) without decoding
//!   anything; why it failed, and its original bytes, wait in the [`Tap`] for the link
//!   that receives it. A message split over several frames is held back, with every later
//!   frame of its session, until its last frame is in and checked; frames of other sessions
//!   and heartbeats pass at once.
//! * **The broker's `flow` frames are reported** ([`Tap::flows`]): RabbitMQ answers every
//!   `flow` a receiver sends with one that carries the queue's count of ready messages
//!   (`available`), which fe2o3 keeps to itself.
//! * **Transfers are counted** ([`Tap::transfers`]): fe2o3 drops a transfer that arrives
//!   once it has sent a detach, unread; the count tells that one was lost that way.
//!
//! A frame that is not well formed (shorter than its own header, a data offset past its
//! end) or larger than the connection allows fails the stream, as it would fail fe2o3:
//! nothing after it could be checked, and none of it is buffered.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use transport_kit::amqp10::{self, Refusal};

/// What a refused message's payload is replaced with: a byte that is no format code.
const REFUSED_PAYLOAD: &[u8] = &[0xff];

/// How many refusals wait for their link at most; older ones are dropped first.
const REFUSALS_KEPT: usize = 16;

/// The largest frame a connection accepts: what it tells the broker in its `open`
/// (`max-frame-size`; fe2o3's default). The broker never sends a larger one, so a frame
/// that says it is larger fails the stream without being buffered, as fe2o3 would fail it.
pub(crate) const MAX_FRAME_SIZE: u32 = 256 * 1024;

const DESCRIBED: u8 = 0x00;
const FLOW: u64 = 0x13;
const TRANSFER: u64 = 0x14;
const DETACH: u64 = 0x16;
const END: u64 = 0x17;
const CLOSE: u64 = 0x18;

/// The last `flow` the broker sent about one of this connection's links.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FlowSeen {
    /// How many link `flow`s have come in on the connection, this one included.
    pub(crate) seq: u64,
    pub(crate) channel: u16,
    pub(crate) handle: u32,
    pub(crate) delivery_count: Option<u32>,
    pub(crate) link_credit: Option<u32>,
    /// The messages the broker could send on the link: on RabbitMQ, the queue's ready ones.
    pub(crate) available: Option<u32>,
    /// How many complete transfers had come in on the connection before this flow.
    pub(crate) transfers_before: u64,
}

/// A message the tap kept from fe2o3.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) delivery_id: Option<u32>,
    pub(crate) refusal: Refusal,
    /// The payload as it came: the message's sections.
    pub(crate) payload: Vec<u8>,
}

struct Shared {
    flows: watch::Sender<FlowSeen>,
    refused: Mutex<VecDeque<Refused>>,
    /// Complete, not aborted transfers that came in on the connection.
    transfers: AtomicU64,
    /// Bytes that came in on the connection.
    received: AtomicU64,
}

/// The transport's side of a tapped connection.
#[derive(Clone)]
pub(crate) struct Tap {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap")
            .field("flow", &*self.shared.flows.borrow())
            .field("transfers", &self.transfers())
            .finish_non_exhaustive()
    }
}

impl Tap {
    /// Wraps `stream`; the returned tap reports what comes in on it.
    pub(crate) fn wrap<S>(stream: S) -> (Tapped<S>, Tap) {
        let shared = Arc::new(Shared {
            flows: watch::Sender::new(FlowSeen::default()),
            refused: Mutex::new(VecDeque::new()),
            transfers: AtomicU64::new(0),
            received: AtomicU64::new(0),
        });
        let tapped = Tapped {
            inner: stream,
            frames: Frames::default(),
            shared: Arc::clone(&shared),
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
            eof: false,
        };
        (tapped, Tap { shared })
    }

    /// The broker's link `flow`s, latest first.
    pub(crate) fn flows(&self) -> watch::Receiver<FlowSeen> {
        self.shared.flows.subscribe()
    }

    /// How many complete transfers have come in on the connection.
    pub(crate) fn transfers(&self) -> u64 {
        self.shared.transfers.load(Ordering::Acquire)
    }

    /// How many bytes have come in on the connection: none means the broker has not
    /// answered anything yet.
    pub(crate) fn received(&self) -> u64 {
        self.shared.received.load(Ordering::Acquire)
    }

    /// Takes what the tap knows of the message with `delivery_id` it kept from fe2o3, and
    /// forgets every refusal before it (their links are gone, or they were taken).
    pub(crate) fn take_refused(&self, delivery_id: u32) -> Option<Refused> {
        let mut refused = self.shared.refused.lock().ok()?;
        let at = refused
            .iter()
            .position(|r| r.delivery_id == Some(delivery_id))?;
        refused.drain(..at);
        refused.pop_front()
    }
}

/// A stream whose incoming bytes go through [`Frames`]; see the [module](self) docs.
pub(crate) struct Tapped<S> {
    inner: S,
    frames: Frames,
    shared: Arc<Shared>,
    scratch: Box<[u8]>,
    eof: bool,
}

impl<S> std::fmt::Debug for Tapped<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tapped").finish_non_exhaustive()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tapped<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.frames.has_output() {
                this.frames.read_into(buf);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut read = ReadBuf::new(&mut this.scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let n = read.filled().len();
                    if n == 0 {
                        this.eof = true;
                        this.frames.finish();
                    } else {
                        this.shared.received.fetch_add(n as u64, Ordering::AcqRel);
                        if let Err(e) = this.frames.feed(&this.scratch[..n], &this.shared) {
                            return Poll::Ready(Err(e));
                        }
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

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The incoming side, without IO: bytes in, checked frames out.
#[derive(Default)]
struct Frames {
    /// Bytes not yet framed.
    input: Vec<u8>,
    /// Bytes for fe2o3, from `read`.
    output: Vec<u8>,
    read: usize,
    /// Per session channel: frames held back behind a message not yet complete.
    held: HashMap<u16, Held>,
}

#[derive(Default)]
struct Held {
    frames: VecDeque<HeldFrame>,
    /// Messages of this session still coming in, by link handle.
    assembling: HashMap<u32, Assembly>,
}

struct HeldFrame {
    bytes: Vec<u8>,
    /// The link whose message this frame is part of, until that message is complete.
    waits_for: Option<u32>,
    /// Where the payload starts in `bytes`, for a transfer frame.
    payload_at: usize,
}

struct Assembly {
    delivery_id: Option<u32>,
    payload: Vec<u8>,
}

/// What a frame's performative says, as far as the tap cares.
#[derive(Debug, PartialEq, Eq)]
enum Performative {
    Flow {
        handle: Option<u32>,
        delivery_count: Option<u32>,
        link_credit: Option<u32>,
        available: Option<u32>,
    },
    Transfer {
        handle: u32,
        delivery_id: Option<u32>,
        more: bool,
        aborted: bool,
        /// Where the payload starts, from the start of the frame body.
        payload_at: usize,
    },
    Detach {
        handle: Option<u32>,
    },
    End,
    Close,
    Other,
}

impl Frames {
    fn has_output(&self) -> bool {
        self.read < self.output.len()
    }

    fn read_into(&mut self, buf: &mut ReadBuf<'_>) {
        let n = buf.remaining().min(self.output.len() - self.read);
        buf.put_slice(&self.output[self.read..self.read + n]);
        self.read += n;
        if self.read == self.output.len() {
            self.output.clear();
            self.read = 0;
        }
    }

    /// The stream ended: everything held goes out as it came.
    fn finish(&mut self) {
        let mut channels: Vec<u16> = self.held.keys().copied().collect();
        channels.sort_unstable();
        for channel in channels {
            self.release(channel);
        }
        self.output.append(&mut self.input);
    }

    fn feed(&mut self, bytes: &[u8], shared: &Shared) -> io::Result<()> {
        // Taken out for the loop, so that frames are read from it in place.
        let mut input = std::mem::take(&mut self.input);
        input.extend_from_slice(bytes);
        let mut at = 0;
        let mut result = Ok(());
        loop {
            let rest = &input[at..];
            if rest.len() < 8 {
                break;
            }
            if rest.starts_with(b"AMQP") {
                // A protocol header (AMQP or SASL).
                self.output.extend_from_slice(&rest[..8]);
                at += 8;
                continue;
            }
            let size = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            let doff = usize::from(rest[4]) * 4;
            if size > MAX_FRAME_SIZE as usize || size < 8 || !(8..=size).contains(&doff) {
                result = Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the broker sent a frame of {size} bytes with its body at {doff}: not an AMQP frame this connection takes (at most {MAX_FRAME_SIZE} bytes)"
                    ),
                ));
                break;
            }
            if rest.len() < size {
                break;
            }
            self.frame(&rest[..size], shared);
            at += size;
        }
        input.drain(..at);
        self.input = input;
        result
    }

    fn frame(&mut self, frame: &[u8], shared: &Shared) {
        let body_at = usize::from(frame[4]) * 4;
        let amqp = frame[5] == 0;
        let channel = u16::from_be_bytes([frame[6], frame[7]]);
        if !amqp || body_at == frame.len() {
            // SASL, or a heartbeat: nothing a message depends on.
            self.output.extend_from_slice(frame);
            return;
        }
        match performative(&frame[body_at..]) {
            Some(Performative::Flow {
                handle: Some(handle),
                delivery_count,
                link_credit,
                available,
            }) => {
                let transfers_before = shared.transfers.load(Ordering::Acquire);
                shared.flows.send_modify(|seen| {
                    *seen = FlowSeen {
                        seq: seen.seq + 1,
                        channel,
                        handle,
                        delivery_count,
                        link_credit,
                        available,
                        transfers_before,
                    };
                });
                self.emit(channel, frame);
            }
            Some(Performative::Transfer {
                handle,
                delivery_id,
                more,
                aborted,
                payload_at,
            }) => self.transfer(
                channel,
                frame,
                body_at + payload_at,
                (handle, delivery_id, more, aborted),
                shared,
            ),
            Some(Performative::Detach { handle }) => {
                if let Some(handle) = handle {
                    self.let_through(channel, Some(handle));
                }
                self.emit(channel, frame);
            }
            Some(Performative::End) => {
                self.let_through(channel, None);
                self.emit(channel, frame);
            }
            Some(Performative::Close) => {
                // In channel order, as at the end of the stream: a hash map's order would
                // differ from one connection to the next.
                let mut channels: Vec<u16> = self.held.keys().copied().collect();
                channels.sort_unstable();
                for held in channels {
                    self.let_through(held, None);
                }
                self.emit(channel, frame);
            }
            Some(Performative::Flow { handle: None, .. } | Performative::Other) | None => {
                self.emit(channel, frame);
            }
        }
    }

    fn transfer(
        &mut self,
        channel: u16,
        frame: &[u8],
        payload_at: usize,
        (handle, delivery_id, more, aborted): (u32, Option<u32>, bool, bool),
        shared: &Shared,
    ) {
        if payload_at > frame.len() {
            self.emit(channel, frame);
            return;
        }
        if aborted {
            // Discarded by fe2o3 with whatever came before it.
            self.let_through(channel, Some(handle));
            self.emit(channel, frame);
            return;
        }
        let assembling = self
            .held
            .get(&channel)
            .is_some_and(|h| h.assembling.contains_key(&handle));
        if !assembling && !more {
            shared.transfers.fetch_add(1, Ordering::AcqRel);
            match amqp10::check_message(&frame[payload_at..]) {
                Ok(()) => self.emit(channel, frame),
                Err(refusal) => {
                    let payload = frame[payload_at..].to_vec();
                    let replaced = with_payload(frame, payload_at, REFUSED_PAYLOAD);
                    refuse(shared, delivery_id, refusal, payload);
                    self.emit(channel, &replaced);
                }
            }
            return;
        }
        let held = self.held.entry(channel).or_default();
        let assembly = held.assembling.entry(handle).or_insert_with(|| Assembly {
            delivery_id,
            payload: Vec::new(),
        });
        assembly.payload.extend_from_slice(&frame[payload_at..]);
        held.frames.push_back(HeldFrame {
            bytes: frame.to_vec(),
            waits_for: Some(handle),
            payload_at,
        });
        if more {
            return;
        }
        shared.transfers.fetch_add(1, Ordering::AcqRel);
        let Some(Assembly {
            delivery_id,
            payload,
        }) = held.assembling.remove(&handle)
        else {
            return;
        };
        let verdict = amqp10::check_message(&payload);
        let mut first = true;
        for f in held
            .frames
            .iter_mut()
            .filter(|f| f.waits_for == Some(handle))
        {
            f.waits_for = None;
            if verdict.is_err() {
                let replacement = if first { REFUSED_PAYLOAD } else { &[] };
                f.bytes = with_payload(&f.bytes, f.payload_at, replacement);
                first = false;
            }
        }
        if let Err(refusal) = verdict {
            refuse(shared, delivery_id, refusal, payload);
        }
        self.release(channel);
    }

    /// Hands `frame` on, behind whatever of its session is held.
    fn emit(&mut self, channel: u16, frame: &[u8]) {
        match self.held.get_mut(&channel) {
            Some(held) if !held.frames.is_empty() => held.frames.push_back(HeldFrame {
                bytes: frame.to_vec(),
                waits_for: None,
                payload_at: 0,
            }),
            _ => self.output.extend_from_slice(frame),
        }
    }

    /// A link (`Some`) or the whole session (`None`) of `channel` went away: messages of it
    /// still coming in will never be complete, and fe2o3 drops them unread. Their frames go
    /// on as they came.
    fn let_through(&mut self, channel: u16, handle: Option<u32>) {
        let Some(held) = self.held.get_mut(&channel) else {
            return;
        };
        held.assembling
            .retain(|h, _| handle.is_some_and(|gone| gone != *h));
        for f in &mut held.frames {
            if handle.is_none() || f.waits_for == handle {
                f.waits_for = None;
            }
        }
        self.release(channel);
    }

    /// Hands on the frames of `channel` up to the first that still waits.
    fn release(&mut self, channel: u16) {
        let Some(held) = self.held.get_mut(&channel) else {
            return;
        };
        while held.frames.front().is_some_and(|f| f.waits_for.is_none()) {
            if let Some(f) = held.frames.pop_front() {
                self.output.extend_from_slice(&f.bytes);
            }
        }
        if held.frames.is_empty() && held.assembling.is_empty() {
            self.held.remove(&channel);
        }
    }
}

fn refuse(shared: &Shared, delivery_id: Option<u32>, refusal: Refusal, payload: Vec<u8>) {
    if let Ok(mut refused) = shared.refused.lock() {
        if refused.len() == REFUSALS_KEPT {
            refused.pop_front();
        }
        refused.push_back(Refused {
            delivery_id,
            refusal,
            payload,
        });
    }
}

/// `frame` with its payload (from `payload_at`) replaced by `payload`, and its size set.
fn with_payload(frame: &[u8], payload_at: usize, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload_at + payload.len());
    out.extend_from_slice(&frame[..payload_at]);
    out.extend_from_slice(payload);
    let size = u32::try_from(out.len()).unwrap_or(u32::MAX);
    out[..4].copy_from_slice(&size.to_be_bytes());
    out
}

/// Reads a frame body's performative: a described list of fields.
fn performative(body: &[u8]) -> Option<Performative> {
    let mut r = Fields {
        bytes: body,
        pos: 0,
    };
    if r.byte()? != DESCRIBED {
        return None;
    }
    let code = match r.byte()? {
        0x53 => u64::from(r.byte()?),
        0x80 => u64::from_be_bytes(r.array::<8>()?),
        _ => return Some(Performative::Other),
    };
    let (count, end) = match r.byte()? {
        0x45 => (0, r.pos),
        0xc0 => {
            let size = usize::from(r.byte()?);
            let end = r.pos + size;
            (usize::from(r.byte()?), end)
        }
        0xd0 => {
            let size = u32::from_be_bytes(r.array::<4>()?) as usize;
            let end = r.pos.checked_add(size)?;
            (u32::from_be_bytes(r.array::<4>()?) as usize, end)
        }
        _ => return None,
    };
    if end > body.len() {
        return None;
    }
    r.bytes = &body[..end];
    let mut fields = Vec::with_capacity(count.min(11));
    for _ in 0..count.min(11) {
        fields.push(r.field()?);
    }
    let uint = |i: usize| fields.get(i).and_then(|f| f.uint);
    let flag = |i: usize| fields.get(i).and_then(|f| f.flag).unwrap_or(false);
    Some(match code {
        FLOW => Performative::Flow {
            handle: uint(4),
            delivery_count: uint(5),
            link_credit: uint(6),
            available: uint(7),
        },
        TRANSFER => Performative::Transfer {
            handle: uint(0)?,
            delivery_id: uint(1),
            more: flag(5),
            aborted: flag(9),
            payload_at: end,
        },
        DETACH => Performative::Detach { handle: uint(0) },
        END => Performative::End,
        CLOSE => Performative::Close,
        _ => Performative::Other,
    })
}

/// A performative field, as far as it is read: a uint or a boolean, else nothing.
#[derive(Clone, Copy, Default)]
struct Field {
    uint: Option<u32>,
    flag: Option<bool>,
}

struct Fields<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Fields<'_> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let out = self
            .bytes
            .get(self.pos..self.pos.checked_add(N)?)?
            .try_into()
            .ok()?;
        self.pos += N;
        Some(out)
    }

    fn skip(&mut self, n: usize) -> Option<()> {
        let end = self.pos.checked_add(n)?;
        (end <= self.bytes.len()).then(|| self.pos = end)
    }

    /// One field. Described values (a transfer's `state`) and compounds are skipped by
    /// their sizes, without looking inside.
    fn field(&mut self) -> Option<Field> {
        let mut code = self.byte()?;
        while code == DESCRIBED {
            self.skip_value()?;
            code = self.byte()?;
        }
        let mut field = Field::default();
        match code {
            0x41 => field.flag = Some(true),
            0x42 => field.flag = Some(false),
            0x56 => field.flag = Some(self.byte()? != 0),
            0x43 => field.uint = Some(0),
            0x52 => field.uint = Some(u32::from(self.byte()?)),
            0x70 => field.uint = Some(u32::from_be_bytes(self.array::<4>()?)),
            other => self.skip_data(other)?,
        }
        Some(field)
    }

    /// A whole value (a descriptor), however many descriptors wrap it: read in a loop, not
    /// by recursion, since each `0x00` of a hostile frame would cost a stack frame.
    fn skip_value(&mut self) -> Option<()> {
        // A descriptor byte stands for two values where there was one: its descriptor and
        // the value it describes.
        let mut owed = 1usize;
        while owed > 0 {
            match self.byte()? {
                DESCRIBED => owed += 1,
                code => {
                    self.skip_data(code)?;
                    owed -= 1;
                }
            }
        }
        Some(())
    }

    fn skip_data(&mut self, code: u8) -> Option<()> {
        let n = match code {
            0x40..=0x45 => 0,
            0x50..=0x56 => 1,
            0x60..=0x61 => 2,
            0x70..=0x74 => 4,
            0x80..=0x84 => 8,
            0x94 | 0x98 => 16,
            0xa0..=0xaf | 0xc0..=0xcf | 0xe0..=0xef => usize::from(self.byte()?),
            0xb0..=0xbf | 0xd0..=0xdf | 0xf0..=0xff => {
                u32::from_be_bytes(self.array::<4>()?) as usize
            }
            _ => return None,
        };
        self.skip(n)
    }
}

/// What [`Frames`] makes of `stream` read `step` bytes at a time: whether it read it, the
/// bytes out, and the transfers it counted and refused. For the fuzz targets.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_frames(stream: &[u8], step: usize) -> (bool, Vec<u8>, u64, usize) {
    let shared = Shared {
        flows: watch::Sender::new(FlowSeen::default()),
        refused: Mutex::new(VecDeque::new()),
        transfers: AtomicU64::new(0),
        received: AtomicU64::new(0),
    };
    let mut frames = Frames::default();
    let mut ok = true;
    for chunk in stream.chunks(step.max(1)) {
        if frames.feed(chunk, &shared).is_err() {
            ok = false;
            break;
        }
    }
    if ok {
        frames.finish();
    }
    let refused = shared.refused.lock().map_or(0, |r| r.len());
    (
        ok,
        frames.output,
        shared.transfers.load(Ordering::Relaxed),
        refused,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An AMQP frame on `channel` with `performative` (its encoding) and `payload`.
    fn frame(channel: u16, performative: &[u8], payload: &[u8]) -> Vec<u8> {
        let size = u32::try_from(8 + performative.len() + payload.len()).unwrap();
        let mut f = size.to_be_bytes().to_vec();
        f.extend_from_slice(&[2, 0]);
        f.extend_from_slice(&channel.to_be_bytes());
        f.extend_from_slice(performative);
        f.extend_from_slice(payload);
        f
    }

    /// A transfer performative on `handle`, with `more`.
    fn transfer(handle: u8, delivery_id: Option<u8>, more: bool) -> Vec<u8> {
        let mut fields = vec![0x52, handle];
        match delivery_id {
            Some(id) => fields.extend_from_slice(&[0x52, id, 0xa0, 1, id, 0x43]),
            None => fields.extend_from_slice(&[0x40, 0x40, 0x40]),
        }
        fields.push(0x40); // settled
        fields.push(if more { 0x41 } else { 0x42 });
        let mut p = vec![0x00, 0x53, 0x14, 0xc0];
        p.push(u8::try_from(fields.len() + 1).unwrap());
        p.push(6);
        p.extend_from_slice(&fields);
        p
    }

    fn flow(handle: u8, available: u8) -> Vec<u8> {
        // next-incoming-id, incoming-window, next-outgoing-id, outgoing-window, handle,
        // delivery-count, link-credit, available
        let fields = [
            0x43, 0x70, 0, 0, 0x13, 0x88, 0x43, 0x70, 0, 0, 0x13, 0x88, 0x52, handle, 0x43, 0x43,
            0x52, available,
        ];
        let mut p = vec![0x00, 0x53, 0x13, 0xc0];
        p.push(u8::try_from(fields.len() + 1).unwrap());
        p.push(8);
        p.extend_from_slice(&fields);
        p
    }

    fn message(value: &[u8]) -> Vec<u8> {
        let mut m = vec![0x00, 0x53, 0x77];
        m.extend_from_slice(value);
        m
    }

    fn nested(depth: usize) -> Vec<u8> {
        let mut v = vec![0xc0, 0, 1]
            .into_iter()
            .cycle()
            .take(3 * depth)
            .collect::<Vec<u8>>();
        v.push(0x40);
        // list8 sizes: everything after each size byte.
        for level in 0..depth {
            v[3 * level + 1] = u8::try_from(v.len() - 3 * level - 2).unwrap();
        }
        v
    }

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            flows: watch::Sender::new(FlowSeen::default()),
            refused: Mutex::new(VecDeque::new()),
            transfers: AtomicU64::new(0),
            received: AtomicU64::new(0),
        })
    }

    fn run(frames: &[u8], chunk: usize) -> (Vec<u8>, Arc<Shared>) {
        let s = shared();
        let mut f = Frames::default();
        for piece in frames.chunks(chunk) {
            f.feed(piece, &s).expect("well-formed frames");
        }
        f.finish();
        (f.output, s)
    }

    #[test]
    fn healthy_frames_pass_unchanged_whatever_the_reads() {
        let mut stream = b"AMQP\x00\x01\x00\x00".to_vec();
        stream.extend(frame(0, &flow(1, 3), &[]));
        stream.extend(frame(
            0,
            &transfer(1, Some(0), false),
            &message(&[0xa1, 2, b'h', b'i']),
        ));
        stream.extend(frame(0, &[], &[])); // heartbeat
        stream.extend(frame(0, &transfer(1, Some(1), true), &message(&[0xa1, 2])));
        stream.extend(frame(0, &transfer(1, None, false), b"ok"));
        stream.extend(frame(0, &flow(1, 0), &[]));
        for chunk in [1, 3, 7, 1000] {
            let (out, s) = run(&stream, chunk);
            assert_eq!(out, stream, "read {chunk} bytes at a time");
            assert_eq!(s.transfers.load(Ordering::Acquire), 2);
            let seen = *s.flows.borrow();
            assert_eq!((seen.seq, seen.handle, seen.available), (2, 1, Some(0)));
        }
    }

    #[test]
    fn a_message_nested_too_deep_reaches_fe2o3_as_one_invalid_byte() {
        let deep = message(&nested(80));
        let stream = frame(3, &transfer(1, Some(7), false), &deep);
        let (out, s) = run(&stream, 5);
        assert_eq!(out, frame(3, &transfer(1, Some(7), false), &[0xff]));
        let refused = s.refused.lock().unwrap().pop_front().expect("kept");
        assert_eq!(refused.delivery_id, Some(7));
        assert_eq!(refused.refusal.why, amqp10::Why::TooDeep);
        assert_eq!(refused.payload, deep);
    }

    #[test]
    fn a_split_message_is_held_with_its_session_and_replaced_when_refused() {
        let deep = message(&nested(80));
        let (a, b) = deep.split_at(100);
        let mut stream = frame(1, &transfer(1, Some(0), true), a);
        stream.extend(frame(1, &flow(1, 0), &[])); // held behind it: same session
        stream.extend(frame(2, &flow(4, 9), &[])); // another session: passes
        stream.extend(frame(1, &transfer(1, None, false), b));
        let (out, s) = run(&stream, 64);
        let mut expected = frame(2, &flow(4, 9), &[]);
        expected.extend(frame(1, &transfer(1, Some(0), true), &[0xff]));
        expected.extend(frame(1, &flow(1, 0), &[]));
        expected.extend(frame(1, &transfer(1, None, false), &[]));
        assert_eq!(out, expected);
        assert_eq!(s.refused.lock().unwrap().front().unwrap().payload, deep);

        // The same message, healthy: everything in order, unchanged.
        let fine = message(&nested(10));
        let (a, b) = fine.split_at(5);
        let mut stream = frame(1, &transfer(1, Some(0), true), a);
        stream.extend(frame(1, &flow(1, 0), &[]));
        stream.extend(frame(1, &transfer(1, None, false), b));
        assert_eq!(run(&stream, 64).0, stream);
    }

    #[test]
    fn a_session_that_ends_mid_message_lets_its_frames_through() {
        let mut stream = frame(1, &transfer(1, Some(0), true), &message(&[0xc0]));
        let end = [0x00, 0x53, 0x17, 0x45];
        stream.extend(frame(1, &end, &[]));
        let (out, s) = run(&stream, 1000);
        assert_eq!(out, stream);
        assert!(s.refused.lock().unwrap().is_empty());
    }

    #[test]
    fn what_is_not_a_frame_fails_the_stream_and_nothing_after_it_passes() {
        let s = shared();
        for bad in [
            vec![0, 0, 0, 3, 2, 0, 0, 0],  // shorter than a frame header
            vec![0, 0, 0, 12, 1, 0, 0, 0], // its body before the end of its header
            vec![0, 0, 0, 12, 9, 0, 0, 0], // its body past its end
        ] {
            let mut f = Frames::default();
            let mut stream = frame(0, &flow(1, 3), &[]);
            stream.extend(&bad);
            stream.extend(frame(
                0,
                &transfer(1, Some(0), false),
                &message(&nested(80)),
            ));
            let err = f.feed(&stream, &s).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            assert_eq!(
                f.output,
                frame(0, &flow(1, 3), &[]),
                "only what came before it"
            );
        }
    }

    #[test]
    fn a_frame_over_the_connection_s_limit_fails_the_stream_unbuffered() {
        let s = shared();
        let mut f = Frames::default();
        let mut head = (MAX_FRAME_SIZE + 1).to_be_bytes().to_vec();
        head.extend_from_slice(&[2, 0, 0, 0]);
        let err = f.feed(&head, &s).unwrap_err();
        assert!(
            err.to_string().contains(&format!("{}", MAX_FRAME_SIZE + 1)),
            "{err}"
        );
        assert!(f.input.len() <= 8 && f.output.is_empty());
    }

    #[test]
    fn a_performative_of_descriptors_only_is_read_without_recursion() {
        // 100,000 descriptor bytes where a transfer's first field goes: each one a level of
        // recursion once. On a thread with a small stack, so that recursion would show.
        let mut performative = vec![0x00, 0x53, 0x14, 0xd0];
        let zeros = 100_000usize;
        performative.extend_from_slice(&u32::try_from(zeros + 5).unwrap().to_be_bytes());
        performative.extend_from_slice(&1u32.to_be_bytes());
        performative.extend(std::iter::repeat_n(0x00, zeros));
        performative.push(0x40);
        let stream = frame(0, &performative, &message(&[0x40]));
        let out = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || run(&stream, 4096).0)
            .unwrap()
            .join()
            .expect("no stack overflow");
        assert!(!out.is_empty());
    }

    #[test]
    fn refusals_are_taken_by_delivery_id_and_older_ones_forgotten() {
        let (_, tap) = Tap::wrap(());
        for id in [1, 2, 3] {
            refuse(
                &tap.shared,
                Some(id),
                Refusal {
                    at: 0,
                    why: amqp10::Why::TooDeep,
                },
                vec![],
            );
        }
        assert_eq!(tap.take_refused(2).map(|r| r.delivery_id), Some(Some(2)));
        assert!(tap.take_refused(1).is_none(), "forgotten");
        assert_eq!(tap.take_refused(3).map(|r| r.delivery_id), Some(Some(3)));
    }
}
