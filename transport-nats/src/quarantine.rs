//! The quarantine sweep: what takes a message async-nats cannot read out of the queue it
//! stops.
//!
//! async-nats parses every message's header block on its connection task, and there is no
//! way to look at the bytes first. A block it refuses fails the connection
//! ([`check_header_block`] says which blocks and why); the message stays handed out
//! (ack-pending) to the consumer that pulled it, comes back after the ack wait, and fails the
//! next connection that pulls it, forever. The sweep breaks that loop where it can be broken:
//! after the connection comes back, and when a queue is first read, it reads every message
//! the queue's consumer has handed out and not had acked (the stream sequences above the
//! consumer's ack floor up to the last one it delivered) with the stream's `MSG.GET` API,
//! by hand: the answer is JSON with the header block in base64, which async-nats never
//! parses. A message whose block the client cannot take is published to the plan's parking
//! queue with its payload, why, and its header block byte for byte, the parking stream's
//! acknowledgement awaited; then, and only then, it is deleted from its stream. A crash
//! between the two leaves a second, parked copy (the copy's `Nats-Msg-Id` names the stream,
//! sequence and store time, so a sweep repeated within the duplicate window stores it once),
//! never a loss.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::Info as ConsumerInfo;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::RawMessage;
use async_nats::{Client, HeaderMap};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use retry_core::{HeaderValue, Timestamp, TransportError, headers};
use tracing::{error, info, warn};

use crate::codec::{
    HEADER_BLOCK_HEADER, HEADER_BLOCK_LENGTH_HEADER, MSG_ID, UNDECODABLE_HEADER, copy_id,
    encode_value,
};
use crate::delivery::now_millis;
use crate::header_block::{HeaderBlockError, check_header_block};
use crate::names::{CONSUMER, stream_name};
use crate::provision::bounded;

/// JetStream's error code for "no message found".
const NO_MESSAGE: u64 = 10037;

/// Room kept in a parked copy for its other headers and the protocol's framing.
const HEADROOM: usize = 4096;

/// Why a sweep runs, for its log.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Trigger {
    /// The transport's connection came back.
    Reconnected,
    /// The queue is read for the first time by this transport.
    FirstRead,
    /// A pull of the queue brought a message async-nats read as a status.
    Misread,
}

/// What one sweep of a queue did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Swept {
    /// Messages read from the consumer's handed-out range.
    pub read: usize,
    /// Messages parked and deleted.
    pub parked: usize,
    /// Messages async-nats cannot read left where they are: no parking queue known.
    pub left: usize,
}

/// The queues this transport reads, each with the lock that keeps two sweeps of it apart.
#[derive(Default)]
pub(crate) struct Quarantine {
    queues: Mutex<HashMap<String, Arc<QueueState>>>,
}

#[derive(Default)]
struct QueueState {
    /// Held for the length of a sweep.
    sweeping: tokio::sync::Mutex<()>,
    /// Swept at least once: a first read need not wait for the lock.
    swept: AtomicBool,
}

/// Where a sweep reads and parks, and how long each request may take.
pub(crate) struct SweepTarget<'a> {
    pub client: &'a Client,
    pub js: &'a Context,
    pub queue: &'a str,
    /// The queue's parking queue, from the plan it belongs to.
    pub parking: Option<String>,
    pub timeout: Duration,
    pub publish_timeout: Duration,
}

impl Quarantine {
    /// Every queue this transport has read, in no order.
    pub(crate) fn queues(&self) -> Vec<String> {
        self.queues
            .lock()
            .map(|q| q.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn state(&self, queue: &str) -> Arc<QueueState> {
        match self.queues.lock() {
            Ok(mut queues) => Arc::clone(queues.entry(queue.to_owned()).or_default()),
            // A poisoned map: sweep without the guard rather than not at all.
            Err(_) => Arc::default(),
        }
    }

    /// Sweeps `target.queue`, after any sweep of it under way; with
    /// [`Trigger::FirstRead`], only if it was never swept.
    pub(crate) async fn sweep(
        &self,
        target: SweepTarget<'_>,
        trigger: Trigger,
    ) -> Result<Swept, TransportError> {
        let state = self.state(target.queue);
        let first_read = matches!(trigger, Trigger::FirstRead);
        if first_read && state.swept.load(Ordering::Acquire) {
            return Ok(Swept::default());
        }
        let _sweeping = state.sweeping.lock().await;
        if first_read && state.swept.load(Ordering::Acquire) {
            return Ok(Swept::default());
        }
        let swept = sweep(&target).await?;
        state.swept.store(true, Ordering::Release);
        if swept != Swept::default() {
            info!(queue = %target.queue, ?trigger, read = swept.read, parked = swept.parked, left = swept.left, "quarantine sweep done");
        }
        Ok(swept)
    }
}

/// Reads the consumer's handed-out range of `target.queue` and parks each message the client
/// cannot read.
async fn sweep(target: &SweepTarget<'_>) -> Result<Swept, TransportError> {
    let stream = stream_name(target.queue);
    let info: ConsumerInfo = api(
        target,
        format!("$JS.API.CONSUMER.INFO.{stream}.{CONSUMER}"),
        Bytes::new(),
        "reading a consumer",
    )
    .await?
    .ok_or_else(|| missing(target, format!("consumer {CONSUMER} on stream {stream}")))
    .and_then(|v| {
        serde_json::from_value(v).map_err(|e| {
            TransportError::connection_failed(
                format!("reading the consumer of {}: its answer", target.queue),
                e,
            )
        })
    })?;
    let last = info.delivered.stream_sequence;
    let mut next = info.ack_floor.stream_sequence.saturating_add(1);
    let mut swept = Swept::default();
    // Acked messages are gone from a work-queue stream: asking for the next one on the
    // subject from `next` skips them, so the requests number the messages still handed out.
    while next <= last {
        let request = serde_json::json!({ "seq": next, "next_by_subj": target.queue });
        let Some(answer) = api(
            target,
            format!("$JS.API.STREAM.MSG.GET.{stream}"),
            Bytes::from(request.to_string()),
            "reading a stored message",
        )
        .await?
        else {
            break;
        };
        let message: RawMessage = answer
            .get("message")
            .cloned()
            .ok_or("no `message` in the answer")
            .and_then(|m| serde_json::from_value(m).map_err(|_| "a `message` that does not parse"))
            .map_err(|why| {
                TransportError::connection_failed(
                    format!("reading {} from sequence {next}", target.queue),
                    why,
                )
            })?;
        if message.sequence > last || message.sequence < next {
            break;
        }
        next = message.sequence.saturating_add(1);
        swept.read += 1;
        let Some(block) = decoded(target, &message, message.headers.as_deref())? else {
            continue;
        };
        let Err(why) = check_header_block(&block) else {
            continue;
        };
        match &target.parking {
            Some(parking) => {
                let payload =
                    decoded(target, &message, Some(&message.payload))?.unwrap_or_default();
                park(target, parking, &stream, &message, block, payload, &why).await?;
                swept.parked += 1;
            }
            None => {
                error!(queue = %target.queue, stream = %stream, sequence = message.sequence, why = %why,
                    "a message async-nats cannot read is left in its stream: no plan this transport provisioned or verified names a parking queue for this queue; every consumer that pulls it loses its connection");
                swept.left += 1;
            }
        }
    }
    Ok(swept)
}

/// Publishes the parked copy, awaits the parking stream's acknowledgement, then deletes the
/// original.
async fn park(
    target: &SweepTarget<'_>,
    parking: &str,
    stream: &str,
    message: &RawMessage,
    block: Vec<u8>,
    payload: Vec<u8>,
    why: &HeaderBlockError,
) -> Result<(), TransportError> {
    let stored_ns = message.time.unix_timestamp_nanos();
    let id = copy_id(stream, message.sequence, stored_ns, parking);
    let text = |s: &str| encode_value(&HeaderValue::Str(s.to_owned()));
    let now = Timestamp::from_millis(now_millis());
    let mut map = HeaderMap::new();
    map.insert(MSG_ID, id.as_str());
    map.insert(headers::REASON, "malformed");
    map.insert(headers::ORIGIN_QUEUE, text(target.queue).as_str());
    map.insert(UNDECODABLE_HEADER, text(&why.to_string()).as_str());
    map.insert(
        headers::LAST_ERROR,
        text(&format!("async-nats cannot read its header block: {why}")).as_str(),
    );
    map.insert(
        headers::LAST_FAILURE,
        encode_value(&HeaderValue::Timestamp(now)).as_str(),
    );
    // A block kept whole (hex doubles it) must still fit the server's largest message with
    // the payload; a longer one is kept as far as it fits, and says how long it was.
    let room = target
        .client
        .server_info()
        .max_payload
        .saturating_sub(payload.len() + HEADROOM)
        / 2;
    let original_len = block.len();
    let kept = if block.len() > room {
        map.insert(
            HEADER_BLOCK_LENGTH_HEADER,
            encode_value(&HeaderValue::UInt(original_len as u64)).as_str(),
        );
        block.get(..room).unwrap_or_default().to_vec()
    } else {
        block
    };
    map.insert(
        HEADER_BLOCK_HEADER,
        encode_value(&HeaderValue::Bytes(kept)).as_str(),
    );
    let publish = PublishMessage::build()
        .payload(payload.into())
        .headers(map)
        .expected_stream(stream_name(parking));
    let acked = bounded(
        target.publish_timeout,
        "parking a message async-nats cannot read",
        async {
            match target.js.send_publish(parking.to_owned(), publish).await {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            }
        },
    )
    .await?
    .map_err(|e| {
        TransportError::connection_failed(
            format!(
                "parking {stream}#{} (its headers cannot be read) in {parking}",
                message.sequence
            ),
            e,
        )
    })?;
    let deleted = api(
        target,
        format!("$JS.API.STREAM.MSG.DELETE.{stream}"),
        Bytes::from(serde_json::json!({ "seq": message.sequence }).to_string()),
        "deleting a parked message",
    )
    .await?;
    warn!(
        queue = %target.queue,
        sequence = message.sequence,
        why = %why,
        parking = %parking,
        parked_as = acked.sequence,
        duplicate = acked.duplicate,
        already_gone = deleted.is_none(),
        "a message async-nats cannot read was parked `malformed` and removed from its queue"
    );
    Ok(())
}

/// `base64`, decoded; `None` for no text at all.
fn decoded(
    target: &SweepTarget<'_>,
    message: &RawMessage,
    base64: Option<&str>,
) -> Result<Option<Vec<u8>>, TransportError> {
    let Some(text) = base64.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    BASE64.decode(text).map(Some).map_err(|e| {
        TransportError::connection_failed(
            format!(
                "reading {}#{}: the server's base64",
                target.queue, message.sequence
            ),
            e,
        )
    })
}

fn missing(target: &SweepTarget<'_>, what: String) -> TransportError {
    TransportError::MissingAddress {
        address: format!("{what} (queue {})", target.queue),
        hint: "provision the plan first".into(),
    }
}

/// A JetStream API request made by hand: the answer's JSON, `None` for "no message found",
/// or the server's error.
async fn api(
    target: &SweepTarget<'_>,
    subject: String,
    body: Bytes,
    operation: &'static str,
) -> Result<Option<serde_json::Value>, TransportError> {
    let answer = bounded(
        target.timeout,
        operation,
        target.client.request(subject.clone(), body),
    )
    .await?
    .map_err(|e| TransportError::connection_failed(format!("{operation}: {subject}"), e))?;
    let value: serde_json::Value = serde_json::from_slice(&answer.payload).map_err(|e| {
        TransportError::connection_failed(format!("{operation}: {subject}: its answer"), e)
    })?;
    if let Some(err) = value.get("error") {
        if err.get("err_code").and_then(serde_json::Value::as_u64) == Some(NO_MESSAGE) {
            return Ok(None);
        }
        let server: Result<async_nats::jetstream::Error, _> = serde_json::from_value(err.clone());
        return Err(match server {
            Ok(e) => TransportError::connection_failed(format!("{operation}: {subject}"), e),
            Err(_) => TransportError::connection_failed(
                format!("{operation}: {subject}"),
                err.to_string(),
            ),
        });
    }
    Ok(Some(value))
}
