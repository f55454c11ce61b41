//! [`RawPublisher`]: an AMQP 0-9-1 client of a few hundred lines that publishes whatever
//! bytes it is given as a message's properties, exchange and routing key, with a publisher
//! confirm. lapin cannot write such messages (its types are valid by construction), and a
//! producer the consumer does not control can: this is how the tests send them.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The 14 properties of a `basic` content header, in the AMQP 0-9-1 specification's order
/// (property flag 15 down to 2): a property's index here is its place in the property list.
/// transport-amqp091's frame inspection has the same list (`inspect::PROPERTIES`, private
/// to it); this copy is ours since this crate cannot depend on a transport, and the
/// specification fixes the order.
const PROPERTIES: [&str; 14] = [
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

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;

/// A connection with one channel in confirm mode, publishing raw messages.
///
/// ```no_run
/// use test_brokers::rabbitmq::{RawProperties, RawPublisher};
///
/// let mut publisher = RawPublisher::connect("127.0.0.1:5672", "guest", "guest", "/")?;
/// let properties = RawProperties::new().message_id(b"bad-\xff\xfe-id");
/// publisher.publish(b"", b"comments", &properties.encode(), b"hello")?;
/// publisher.close()?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct RawPublisher {
    stream: TcpStream,
    frame_max: usize,
    published: u64,
}

/// A method frame's payload: class, method and arguments.
struct Method {
    class: u16,
    method: u16,
    args: Vec<u8>,
}

impl RawPublisher {
    /// Connects to `address` (`host:port`) with PLAIN `user`/`password`, opens `vhost` and
    /// channel 1, and puts the channel in confirm mode. Every read waits at most 10 s.
    pub fn connect(address: &str, user: &str, password: &str, vhost: &str) -> io::Result<Self> {
        let stream = TcpStream::connect(address)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_nodelay(true)?;
        let mut p = RawPublisher {
            stream,
            frame_max: 4096,
            published: 0,
        };
        p.stream.write_all(b"AMQP\x00\x00\x09\x01")?;
        p.expect(0, 10, 10)?; // connection.start
        let mut args = Vec::new();
        args.extend_from_slice(&0u32.to_be_bytes()); // client properties: an empty table
        short(&mut args, b"PLAIN");
        long(&mut args, format!("\0{user}\0{password}").as_bytes());
        short(&mut args, b"en_US");
        p.method(0, 10, 11, &args)?;
        let tune = p.expect(0, 10, 30)?;
        let frame_max = u32::from_be_bytes(field(&tune.args, 2, 4)?.try_into().unwrap_or([0; 4]));
        if frame_max >= 4096 {
            p.frame_max = frame_max as usize;
        }
        let mut args = Vec::new();
        args.extend_from_slice(&tune.args[..2]); // channel-max
        args.extend_from_slice(&(p.frame_max as u32).to_be_bytes());
        args.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        p.method(0, 10, 31, &args)?;
        let mut args = Vec::new();
        short(&mut args, vhost.as_bytes());
        short(&mut args, b"");
        args.push(0);
        p.method(0, 10, 40, &args)?;
        p.expect(0, 10, 41)?;
        p.method(1, 20, 10, &[0])?;
        p.expect(1, 20, 11)?;
        p.method(1, 85, 10, &[0])?;
        p.expect(1, 85, 11)?;
        Ok(p)
    }

    /// Publishes one message to `exchange` with `routing_key`, its content header carrying
    /// `properties` as they are (property flags, then the property list, as
    /// [`RawProperties::encode`] writes them), and waits for the broker's confirm. A nack,
    /// or a channel the broker closed, is an error that says so.
    pub fn publish(
        &mut self,
        exchange: &[u8],
        routing_key: &[u8],
        properties: &[u8],
        body: &[u8],
    ) -> io::Result<()> {
        let mut args = Vec::new();
        args.extend_from_slice(&0u16.to_be_bytes());
        short(&mut args, exchange);
        short(&mut args, routing_key);
        args.push(0); // neither mandatory nor immediate
        self.method(1, 60, 40, &args)?;
        let mut header = Vec::with_capacity(14 + properties.len());
        header.extend_from_slice(&60u16.to_be_bytes());
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(properties);
        self.frame(FRAME_HEADER, 1, &header)?;
        for chunk in body.chunks(self.frame_max - 8) {
            self.frame(FRAME_BODY, 1, chunk)?;
        }
        self.published += 1;
        let answer = self.read_method()?;
        match (answer.0, answer.1.class, answer.1.method) {
            (1, 60, 80) => Ok(()),
            (1, 60, 120) => Err(io::Error::other("the broker nacked the publish")),
            (_, 20, 40) | (_, 10, 50) => Err(io::Error::other(format!(
                "the broker closed the {}: {}",
                if answer.1.class == 20 {
                    "channel"
                } else {
                    "connection"
                },
                reply_text(&answer.1.args)
            ))),
            (ch, class, method) => Err(io::Error::other(format!(
                "unexpected method {class}.{method} on channel {ch}"
            ))),
        }
    }

    /// Closes the connection.
    pub fn close(mut self) -> io::Result<()> {
        let mut args = Vec::new();
        args.extend_from_slice(&200u16.to_be_bytes());
        short(&mut args, b"done");
        args.extend_from_slice(&[0, 0, 0, 0]);
        self.method(0, 10, 50, &args)?;
        // close-ok, or whatever comes before it
        for _ in 0..8 {
            match self.read_method() {
                Ok((0, m)) if m.class == 10 && m.method == 51 => return Ok(()),
                Ok(_) => continue,
                Err(_) => return Ok(()),
            }
        }
        Ok(())
    }

    fn method(&mut self, channel: u16, class: u16, method: u16, args: &[u8]) -> io::Result<()> {
        let mut payload = Vec::with_capacity(4 + args.len());
        payload.extend_from_slice(&class.to_be_bytes());
        payload.extend_from_slice(&method.to_be_bytes());
        payload.extend_from_slice(args);
        self.frame(FRAME_METHOD, channel, &payload)
    }

    fn frame(&mut self, kind: u8, channel: u16, payload: &[u8]) -> io::Result<()> {
        let mut frame = Vec::with_capacity(8 + payload.len());
        frame.push(kind);
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(FRAME_END);
        self.stream.write_all(&frame)
    }

    /// The next method frame, heartbeats skipped.
    fn read_method(&mut self) -> io::Result<(u16, Method)> {
        loop {
            let mut head = [0u8; 7];
            self.stream.read_exact(&mut head)?;
            if &head[..4] == b"AMQP" {
                return Err(io::Error::other("the broker refused the protocol version"));
            }
            let channel = u16::from_be_bytes([head[1], head[2]]);
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            if size > 1 << 24 {
                return Err(io::Error::other(format!("a frame of {size} bytes")));
            }
            let mut payload = vec![0u8; size + 1];
            self.stream.read_exact(&mut payload)?;
            if payload.pop() != Some(FRAME_END) {
                return Err(io::Error::other("a frame without its end byte"));
            }
            match head[0] {
                FRAME_HEARTBEAT => continue,
                FRAME_METHOD if payload.len() >= 4 => {
                    return Ok((
                        channel,
                        Method {
                            class: u16::from_be_bytes([payload[0], payload[1]]),
                            method: u16::from_be_bytes([payload[2], payload[3]]),
                            args: payload[4..].to_vec(),
                        },
                    ));
                }
                other => {
                    return Err(io::Error::other(format!(
                        "unexpected frame of type {other} on channel {channel}"
                    )));
                }
            }
        }
    }

    fn expect(&mut self, channel: u16, class: u16, method: u16) -> io::Result<Method> {
        let (ch, m) = self.read_method()?;
        if (ch, m.class, m.method) == (channel, class, method) {
            return Ok(m);
        }
        if m.class == 10 && m.method == 50 || m.class == 20 && m.method == 40 {
            return Err(io::Error::other(format!(
                "the broker closed: {}",
                reply_text(&m.args)
            )));
        }
        Err(io::Error::other(format!(
            "expected method {class}.{method} on channel {channel}, got {}.{} on {ch}",
            m.class, m.method
        )))
    }
}

/// The reply text of a `connection.close` or `channel.close`.
fn reply_text(args: &[u8]) -> String {
    let len = args.get(2).copied().unwrap_or(0) as usize;
    String::from_utf8_lossy(args.get(3..3 + len).unwrap_or_default()).into_owned()
}

fn field(args: &[u8], at: usize, len: usize) -> io::Result<&[u8]> {
    args.get(at..at + len)
        .ok_or_else(|| io::Error::other("a method frame shorter than its fields"))
}

/// Appends a short string: a length byte, then at most 255 bytes of `s`.
fn short(out: &mut Vec<u8>, s: &[u8]) {
    let s = &s[..s.len().min(255)];
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

fn long(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// A `basic` content header's properties, written as given: short strings need not be
/// UTF-8, and the header table is any bytes (see [`RawTable`]).
#[derive(Clone, Debug, Default)]
pub struct RawProperties {
    /// Each property by its index in the property list (0 = `content-type`), raw.
    fields: [Option<Vec<u8>>; 14],
    /// Bytes written after the property list, as if it went on.
    trailing: Vec<u8>,
}

impl RawProperties {
    /// No properties.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the short-string property `name` (`content-type`, `message-id`, ...) to
    /// `value`, any bytes (at most 255). Panics on a name that is not a short-string
    /// property.
    pub fn short_string(mut self, name: &str, value: &[u8]) -> Self {
        let i = PROPERTIES
            .iter()
            .position(|n| *n == name)
            .filter(|&i| !matches!(i, 2 | 3 | 4 | 9))
            .unwrap_or_else(|| panic!("{name} is not a short-string property"));
        let mut raw = Vec::new();
        short(&mut raw, value);
        self.fields[i] = Some(raw);
        self
    }

    /// Sets `message-id`.
    pub fn message_id(self, value: &[u8]) -> Self {
        self.short_string("message-id", value)
    }

    /// Sets `content-type`.
    pub fn content_type(self, value: &[u8]) -> Self {
        self.short_string("content-type", value)
    }

    /// Sets the header table to `table`'s bytes (its length is written before them).
    pub fn headers(mut self, table: &RawTable) -> Self {
        let mut raw = Vec::new();
        long(&mut raw, &table.0);
        self.fields[2] = Some(raw);
        self
    }

    /// Sets the header table's field to exactly `raw` (length included): a length that lies
    /// is written as it is.
    pub fn headers_field(mut self, raw: Vec<u8>) -> Self {
        self.fields[2] = Some(raw);
        self
    }

    /// Sets `delivery-mode` (2: persistent).
    pub fn delivery_mode(mut self, mode: u8) -> Self {
        self.fields[3] = Some(vec![mode]);
        self
    }

    /// Bytes written after the property list.
    pub fn trailing(mut self, bytes: &[u8]) -> Self {
        self.trailing = bytes.to_vec();
        self
    }

    /// Property flags, then each property set, in order, then the trailing bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut flags = 0u16;
        let mut out = vec![0, 0];
        for (i, f) in self.fields.iter().enumerate() {
            if let Some(raw) = f {
                flags |= 1 << (15 - i);
                out.extend_from_slice(raw);
            }
        }
        out[..2].copy_from_slice(&flags.to_be_bytes());
        out.extend_from_slice(&self.trailing);
        out
    }
}

/// A field table's entries, as bytes (without the table's length).
#[derive(Clone, Debug, Default)]
pub struct RawTable(pub Vec<u8>);

impl RawTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an entry: `name` (any bytes, at most 255) and a value already encoded with its
    /// type tag ([`RawTable::long_string`], [`RawTable::nested_tables`], ...).
    pub fn entry(mut self, name: &[u8], value: &[u8]) -> Self {
        short(&mut self.0, name);
        self.0.extend_from_slice(value);
        self
    }

    /// A long-string value (`S`) of any bytes.
    pub fn long_string(value: &[u8]) -> Vec<u8> {
        let mut out = vec![b'S'];
        long(&mut out, value);
        out
    }

    /// A value `depth` tables deep (`F`), each holding one entry `k`, around an integer.
    pub fn nested_tables(depth: usize) -> Vec<u8> {
        Self::nested(depth, b'F')
    }

    /// A value `depth` arrays deep (`A`), each holding one element, around an integer.
    pub fn nested_arrays(depth: usize) -> Vec<u8> {
        Self::nested(depth, b'A')
    }

    fn nested(depth: usize, kind: u8) -> Vec<u8> {
        const INNERMOST: [u8; 5] = [b'I', 0, 0, 0, 7];
        // Each level is its tag, the length of what it holds, (a table's key) and the level
        // inside it: the lengths are known from the inside out, the bytes written from the
        // outside in.
        let key = if kind == b'F' { 2 } else { 0 };
        let mut held = Vec::with_capacity(depth);
        let mut inner = INNERMOST.len();
        for _ in 0..depth {
            held.push(inner + key);
            inner += 5 + key;
        }
        let mut out = Vec::with_capacity(inner);
        for &len in held.iter().rev() {
            out.push(kind);
            out.extend_from_slice(&(len as u32).to_be_bytes());
            if kind == b'F' {
                short(&mut out, b"k");
            }
        }
        out.extend_from_slice(&INNERMOST);
        out
    }
}
