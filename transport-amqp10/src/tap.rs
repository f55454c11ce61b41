//! `Tapped`: the byte stream between a connection's socket and fe2o3, which reads the AMQP
//! frames coming in before fe2o3 does, and passes every byte on unchanged.
//!
//! It reports what fe2o3 0.18 keeps to itself:
//!
//! * **The broker's `flow` frames** ([`Tap::flows`]): RabbitMQ answers every `flow` a
//!   receiver sends with one that carries the queue's count of ready messages
//!   (`available`).
//! * **How many transfers came in** ([`Tap::transfers`]): fe2o3 drops a transfer that
//!   arrives once it has sent a detach, unread; the count tells that one was lost that way.
//!
//! Anything that is not a well-formed frame is passed on untouched from there on: fe2o3
//! reports it.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

/// Frames larger than this are not taken for frames: the stream is passed on untouched.
const LARGEST_FRAME: usize = 1 << 30;

const DESCRIBED: u8 = 0x00;
const FLOW: u64 = 0x13;
const TRANSFER: u64 = 0x14;

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
}

struct Shared {
    flows: watch::Sender<FlowSeen>,
    /// Complete, not aborted transfers that came in on the connection.
    transfers: AtomicU64,
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
            transfers: AtomicU64::new(0),
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
                        this.frames.feed(&this.scratch[..n], &this.shared);
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

/// The incoming side, without IO: bytes in, the same bytes out, frames read on the way.
#[derive(Default)]
struct Frames {
    /// Bytes not yet framed.
    input: Vec<u8>,
    /// Bytes for fe2o3, from `read`.
    output: Vec<u8>,
    read: usize,
    /// The stream stopped making sense as frames: everything passes untouched.
    passthrough: bool,
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
        more: bool,
        aborted: bool,
    },
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

    /// The stream ended: what is left goes out as it came.
    fn finish(&mut self) {
        self.output.append(&mut self.input);
    }

    fn feed(&mut self, bytes: &[u8], shared: &Shared) {
        self.input.extend_from_slice(bytes);
        let mut at = 0;
        loop {
            let rest = &self.input[at..];
            if self.passthrough {
                self.output.extend_from_slice(rest);
                at = self.input.len();
                break;
            }
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
            if !(8..=LARGEST_FRAME).contains(&size) {
                self.passthrough = true;
                continue;
            }
            if rest.len() < size {
                break;
            }
            let frame = self.input[at..at + size].to_vec();
            at += size;
            self.frame(frame, shared);
        }
        self.input.drain(..at);
    }

    fn frame(&mut self, frame: Vec<u8>, shared: &Shared) {
        let body_at = usize::from(frame[4]) * 4;
        let amqp = frame[5] == 0;
        let channel = u16::from_be_bytes([frame[6], frame[7]]);
        if body_at < 8 || body_at > frame.len() {
            self.passthrough = true;
        } else if amqp && body_at < frame.len() {
            match performative(&frame[body_at..]) {
                Some(Performative::Flow {
                    handle: Some(handle),
                    delivery_count,
                    link_credit,
                    available,
                }) => {
                    shared.flows.send_modify(|seen| {
                        *seen = FlowSeen {
                            seq: seen.seq + 1,
                            channel,
                            handle,
                            delivery_count,
                            link_credit,
                            available,
                        };
                    });
                }
                Some(Performative::Transfer {
                    more: false,
                    aborted: false,
                }) => {
                    shared.transfers.fetch_add(1, Ordering::AcqRel);
                }
                _ => {}
            }
        }
        self.output.extend_from_slice(&frame);
    }
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
            more: flag(5),
            aborted: flag(9),
        },
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

    /// A whole value (a descriptor).
    fn skip_value(&mut self) -> Option<()> {
        let mut code = self.byte()?;
        while code == DESCRIBED {
            self.skip_value()?;
            code = self.byte()?;
        }
        self.skip_data(code)
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

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            flows: watch::Sender::new(FlowSeen::default()),
            transfers: AtomicU64::new(0),
        })
    }

    fn run(frames: &[u8], chunk: usize) -> (Vec<u8>, Arc<Shared>) {
        let s = shared();
        let mut f = Frames::default();
        for piece in frames.chunks(chunk) {
            f.feed(piece, &s);
        }
        f.finish();
        (f.output, s)
    }

    #[test]
    fn frames_pass_unchanged_and_flows_and_transfers_are_reported_whatever_the_reads() {
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
    fn what_is_not_a_frame_is_passed_on_untouched() {
        let mut stream = vec![0, 0, 0, 3, 1, 2, 3, 4, 5];
        stream.extend(frame(0, &flow(1, 3), &[]));
        let (out, s) = run(&stream, 4);
        assert_eq!(out, stream);
        assert_eq!(s.flows.borrow().seq, 0, "nothing read past the bad frame");
    }
}
