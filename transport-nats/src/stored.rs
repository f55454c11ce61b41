//! Stored messages read with the stream's API by hand, so that async-nats never parses their
//! header blocks.
//!
//! async-nats' own reads of a stored message (`Stream::get_raw_message`,
//! `raw_message_builder`) decode the header block and parse it with rules of their own: a
//! block that is not UTF-8, a line without a colon, or a name it refuses makes the read fail,
//! so a message the consumer cannot take could not be read for parking or listing either.
//! Here the answer stays JSON, with the block and the payload in base64, decoded into bytes.

use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::consumer::Info as ConsumerInfo;
use async_nats::jetstream::stream::RawMessage;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use retry_core::TransportError;

use crate::names::{CONSUMER, stream_name};
use crate::provision::bounded;

/// JetStream's error code for "no message found".
const NO_MESSAGE: u64 = 10037;

/// A message as its stream keeps it.
#[derive(Clone, Debug)]
pub(crate) struct StoredMessage {
    pub subject: String,
    pub sequence: u64,
    /// When the stream stored it, in nanoseconds since the epoch.
    pub stored_ns: i128,
    /// Its header block as stored; `None` for a message without headers.
    pub header_block: Option<Vec<u8>>,
    pub payload: Vec<u8>,
}

/// The first message of `queue`'s stream on `queue`'s subject at sequence `from` or later;
/// `None` when there is none.
pub(crate) async fn next_stored(
    client: &Client,
    timeout: Duration,
    queue: &str,
    from: u64,
) -> Result<Option<StoredMessage>, TransportError> {
    let request = serde_json::json!({ "seq": from, "next_by_subj": queue });
    let Some(answer) = api(
        client,
        timeout,
        format!("$JS.API.STREAM.MSG.GET.{}", stream_name(queue)),
        Bytes::from(request.to_string()),
        "reading a stored message",
    )
    .await?
    else {
        return Ok(None);
    };
    let unreadable = |why: String| {
        TransportError::connection_failed(
            format!("reading {queue} from sequence {from}: the server's answer"),
            why,
        )
    };
    let message: RawMessage = answer
        .get("message")
        .cloned()
        .ok_or_else(|| unreadable("no `message`".into()))
        .and_then(|m| serde_json::from_value(m).map_err(|e| unreadable(e.to_string())))?;
    let decode = |text: &str| -> Result<Vec<u8>, TransportError> {
        BASE64
            .decode(text)
            .map_err(|e| unreadable(format!("sequence {}: {e}", message.sequence)))
    };
    let header_block = match message.headers.as_deref() {
        None | Some("") => None,
        Some(text) => Some(decode(text)?),
    };
    let payload = decode(&message.payload)?;
    Ok(Some(StoredMessage {
        subject: message.subject,
        sequence: message.sequence,
        stored_ns: message.time.unix_timestamp_nanos(),
        header_block,
        payload,
    }))
}

/// Deletes the message at `sequence` from `queue`'s stream; `false` when it was gone
/// already.
pub(crate) async fn delete_stored(
    client: &Client,
    timeout: Duration,
    queue: &str,
    sequence: u64,
) -> Result<bool, TransportError> {
    let answer = api(
        client,
        timeout,
        format!("$JS.API.STREAM.MSG.DELETE.{}", stream_name(queue)),
        Bytes::from(serde_json::json!({ "seq": sequence }).to_string()),
        "deleting a stored message",
    )
    .await?;
    Ok(answer.is_some())
}

/// What the server says of `queue`'s consumer.
pub(crate) async fn consumer_info(
    client: &Client,
    timeout: Duration,
    queue: &str,
) -> Result<ConsumerInfo, TransportError> {
    let stream = stream_name(queue);
    let answer = api(
        client,
        timeout,
        format!("$JS.API.CONSUMER.INFO.{stream}.{CONSUMER}"),
        Bytes::new(),
        "reading a consumer",
    )
    .await?
    .ok_or_else(|| TransportError::MissingAddress {
        address: format!("consumer {CONSUMER} on stream {stream} (queue {queue})"),
        hint: "provision the plan first".into(),
    })?;
    serde_json::from_value(answer).map_err(|e| {
        TransportError::connection_failed(format!("reading the consumer of {queue}: its answer"), e)
    })
}

/// A JetStream API request made by hand: the answer's JSON, `None` for "no message found",
/// or the server's error.
async fn api(
    client: &Client,
    timeout: Duration,
    subject: String,
    body: Bytes,
    operation: &'static str,
) -> Result<Option<serde_json::Value>, TransportError> {
    let answer = bounded(timeout, operation, client.request(subject.clone(), body))
        .await?
        .map_err(|e| TransportError::connection_failed(format!("{operation}: {subject}"), e))?;
    let value: serde_json::Value = serde_json::from_slice(&answer.payload).map_err(|e| {
        TransportError::connection_failed(format!("{operation}: {subject}: its answer"), e)
    })?;
    let Some(err) = value.get("error") else {
        return Ok(Some(value));
    };
    if err.get("err_code").and_then(serde_json::Value::as_u64) == Some(NO_MESSAGE) {
        return Ok(None);
    }
    let context = format!("{operation}: {subject}");
    Err(
        match serde_json::from_value::<async_nats::jetstream::Error>(err.clone()) {
            Ok(server) => TransportError::connection_failed(context, server),
            Err(_) => TransportError::connection_failed(context, err.to_string()),
        },
    )
}
