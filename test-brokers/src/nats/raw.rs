//! [`RawPublisher`]: a NATS client of a few lines that publishes any header bytes at all.
//!
//! async-nats only writes header blocks it could parse back, and nats-server stores whatever a
//! `HPUB` carries. Tests of what the transport does with a message no well-behaved client
//! writes (a header name that is not UTF-8, a line without a colon) need a client that sends
//! the bytes as given: this one speaks just enough of the protocol (`INFO`, `CONNECT`, `SUB`,
//! `HPUB`, `PING`/`PONG`) over a blocking [`TcpStream`], and waits for JetStream's PubAck.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// How long any step waits for the server.
const WAIT: Duration = Duration::from_secs(10);

/// A connection to a NATS server that publishes header blocks byte for byte.
///
/// ```no_run
/// use test_brokers::nats::{RawPublisher, header_block};
///
/// # fn demo() -> Result<(), test_brokers::nats::RawPublishError> {
/// let mut raw = RawPublisher::connect("nats://127.0.0.1:4222")?;
/// // A header value that is not UTF-8: async-nats cannot write this, nats-server stores it.
/// let block = header_block(&[b"tenant: ac\xffme"]);
/// let ack = raw.publish("orders", &block, b"body")?;
/// assert_eq!(ack.stream, "orders");
/// # Ok(()) }
/// ```
pub struct RawPublisher {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    inbox: String,
}

impl std::fmt::Debug for RawPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawPublisher")
            .field("inbox", &self.inbox)
            .finish_non_exhaustive()
    }
}

/// What a stream answered to a publish: where it stored the message.
///
/// ```
/// use test_brokers::nats::PubAck;
///
/// let ack = PubAck { stream: "orders".into(), sequence: 7, duplicate: false };
/// assert_eq!(ack.sequence, 7);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PubAck {
    /// The stream that stored it.
    pub stream: String,
    /// Its sequence in that stream.
    pub sequence: u64,
    /// The stream had a message with the same `Nats-Msg-Id` within its duplicate window, and
    /// stored nothing.
    pub duplicate: bool,
}

/// Why a raw publish failed.
///
/// ```
/// use test_brokers::nats::RawPublishError;
///
/// let err = RawPublishError::NotPubAck { reply: "hello".into() };
/// assert!(err.to_string().contains("hello"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RawPublishError {
    /// The URL is not `nats://host:port` (or `host:port`).
    #[error("{url:?} is not a plain nats://host:port URL")]
    Url {
        /// What was given.
        url: String,
    },
    /// The socket failed during a step.
    #[error("{step}: {source}")]
    Io {
        /// The step: connecting, reading the server's INFO, ...
        step: &'static str,
        /// What the socket said.
        source: std::io::Error,
    },
    /// The server sent something this client did not expect at this step, or `-ERR`.
    #[error("{step}: the server sent {line:?}")]
    Protocol {
        /// The step.
        step: &'static str,
        /// The line it sent.
        line: String,
    },
    /// The answer to the publish is not a JetStream PubAck (no stream captures the subject:
    /// `503` no responders; or an answer of another kind).
    #[error("the answer to the publish is not a PubAck: {reply}")]
    NotPubAck {
        /// The answer, its header block and payload as text.
        reply: String,
    },
    /// The stream refused the message.
    #[error("the stream refused the publish: {code} {description}")]
    Refused {
        /// JetStream's error code (`err_code`).
        code: u64,
        /// The server's words.
        description: String,
    },
}

/// A header block as nats-server stores it: `NATS/1.0`, each line as given (any bytes), and
/// the empty line that ends the block, every line ended by CR LF.
///
/// ```
/// use test_brokers::nats::header_block;
///
/// assert_eq!(header_block(&[b"a: 1"]), b"NATS/1.0\r\na: 1\r\n\r\n");
/// ```
pub fn header_block(lines: &[&[u8]]) -> Vec<u8> {
    let mut block = b"NATS/1.0\r\n".to_vec();
    for line in lines {
        block.extend_from_slice(line);
        block.extend_from_slice(b"\r\n");
    }
    block.extend_from_slice(b"\r\n");
    block
}

impl RawPublisher {
    /// Connects to the server at `url` (`nats://host:port`; no credentials, no TLS), says
    /// it speaks headers, and subscribes an inbox for the PubAcks.
    ///
    /// ```no_run
    /// use test_brokers::nats::RawPublisher;
    ///
    /// let raw = RawPublisher::connect("nats://127.0.0.1:4222").expect("a NATS server");
    /// ```
    pub fn connect(url: &str) -> Result<Self, RawPublishError> {
        let address = url.strip_prefix("nats://").unwrap_or(url);
        if address.is_empty() || address.contains(['@', '/', ',']) {
            return Err(RawPublishError::Url { url: url.into() });
        }
        let io = |step| move |source| RawPublishError::Io { step, source };
        let stream = TcpStream::connect(address).map_err(io("connecting"))?;
        stream
            .set_read_timeout(Some(WAIT))
            .map_err(io("setting a read timeout"))?;
        stream
            .set_write_timeout(Some(WAIT))
            .map_err(io("setting a write timeout"))?;
        let writer = stream.try_clone().map_err(io("cloning the socket"))?;
        let mut raw = RawPublisher {
            reader: BufReader::new(stream),
            writer,
            inbox: format!("_RAW_INBOX.{}.{:x}", std::process::id(), nanos()),
        };
        let info = raw.line("reading the server's INFO")?;
        if !info.starts_with("INFO ") {
            return Err(RawPublishError::Protocol {
                step: "reading the server's INFO",
                line: info,
            });
        }
        let hello = format!(
            "CONNECT {{\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":true,\"lang\":\"rust-raw\",\"version\":\"0\",\"protocol\":1}}\r\nSUB {} 1\r\nPING\r\n",
            raw.inbox
        );
        raw.send("sending CONNECT", hello.as_bytes())?;
        raw.until_pong("waiting for the server to take CONNECT")?;
        Ok(raw)
    }

    /// Publishes `payload` to `subject` with `header_block` as its header bytes, exactly as
    /// given, and waits for the stream's PubAck.
    ///
    /// ```no_run
    /// use test_brokers::nats::{RawPublisher, header_block};
    ///
    /// let mut raw = RawPublisher::connect("nats://127.0.0.1:4222").expect("a NATS server");
    /// // A line without a colon.
    /// let ack = raw.publish("orders", &header_block(&[b"no colon here"]), b"{}").expect("stored");
    /// assert!(!ack.duplicate);
    /// ```
    pub fn publish(
        &mut self,
        subject: &str,
        header_block: &[u8],
        payload: &[u8],
    ) -> Result<PubAck, RawPublishError> {
        let total = header_block.len() + payload.len();
        let mut frame = format!(
            "HPUB {subject} {} {} {total}\r\n",
            self.inbox,
            header_block.len()
        )
        .into_bytes();
        frame.extend_from_slice(header_block);
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\n");
        self.send("sending HPUB", &frame)?;
        let (headers, body) = self.reply()?;
        let text = String::from_utf8_lossy(&body).into_owned();
        let not_ack = || RawPublishError::NotPubAck {
            reply: format!("{}{text}", String::from_utf8_lossy(&headers)),
        };
        if !headers.is_empty() {
            // A status (`503` no responders): no stream captures the subject.
            return Err(not_ack());
        }
        let answer: serde_json::Value = serde_json::from_slice(&body).map_err(|_| not_ack())?;
        if let Some(error) = answer.get("error") {
            return Err(RawPublishError::Refused {
                code: error
                    .get("err_code")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0),
                description: error
                    .get("description")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            });
        }
        match (
            answer.get("stream").and_then(serde_json::Value::as_str),
            answer.get("seq").and_then(serde_json::Value::as_u64),
        ) {
            (Some(stream), Some(sequence)) => Ok(PubAck {
                stream: stream.to_owned(),
                sequence,
                duplicate: answer
                    .get("duplicate")
                    .and_then(serde_json::Value::as_bool)
                    .unwrap_or(false),
            }),
            _ => Err(not_ack()),
        }
    }

    fn send(&mut self, step: &'static str, bytes: &[u8]) -> Result<(), RawPublishError> {
        self.writer
            .write_all(bytes)
            .and_then(|()| self.writer.flush())
            .map_err(|source| RawPublishError::Io { step, source })
    }

    /// One protocol line, without its CR LF.
    fn line(&mut self, step: &'static str) -> Result<String, RawPublishError> {
        let mut line = String::new();
        let read = self
            .reader
            .read_line(&mut line)
            .map_err(|source| RawPublishError::Io { step, source })?;
        if read == 0 {
            return Err(RawPublishError::Io {
                step,
                source: std::io::ErrorKind::UnexpectedEof.into(),
            });
        }
        Ok(line.trim_end_matches(['\r', '\n']).to_owned())
    }

    /// Lines until `PONG`, answering the server's pings; `-ERR` is an error.
    fn until_pong(&mut self, step: &'static str) -> Result<(), RawPublishError> {
        loop {
            let line = self.line(step)?;
            match line.as_str() {
                "PONG" => return Ok(()),
                "PING" => self.send(step, b"PONG\r\n")?,
                "+OK" => {}
                _ if line.starts_with("INFO ") => {}
                _ => return Err(RawPublishError::Protocol { step, line }),
            }
        }
    }

    /// The next message on the inbox: its header block (empty for a `MSG`) and payload.
    fn reply(&mut self) -> Result<(Vec<u8>, Vec<u8>), RawPublishError> {
        const STEP: &str = "waiting for the PubAck";
        loop {
            let line = self.line(STEP)?;
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            let sizes = match fields.as_slice() {
                ["PING"] => {
                    self.send(STEP, b"PONG\r\n")?;
                    continue;
                }
                ["+OK"] | ["PONG"] => continue,
                ["INFO", ..] => continue,
                ["MSG", _, _, len] | ["MSG", _, _, _, len] => (None, *len),
                ["HMSG", _, _, hdr, len] | ["HMSG", _, _, _, hdr, len] => (Some(*hdr), *len),
                _ => {
                    return Err(RawPublishError::Protocol { step: STEP, line });
                }
            };
            let number = |text: &str| {
                text.parse::<usize>()
                    .map_err(|_| RawPublishError::Protocol {
                        step: STEP,
                        line: line.clone(),
                    })
            };
            let total = number(sizes.1)?;
            let header_len = sizes.0.map(number).transpose()?.unwrap_or(0);
            if header_len > total {
                return Err(RawPublishError::Protocol { step: STEP, line });
            }
            let mut message = vec![0; total + 2];
            self.reader
                .read_exact(&mut message)
                .map_err(|source| RawPublishError::Io { step: STEP, source })?;
            message.truncate(total);
            let payload = message.split_off(header_len);
            return Ok((message, payload));
        }
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}
