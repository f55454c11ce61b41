//! The quarantine sweep: what takes a message async-nats cannot read out of the queue it
//! stops.
//!
//! async-nats parses every message's header block on its connection task, and there is no
//! way to look at the bytes first. A block it refuses fails the connection, or kills the
//! client, or passes for the server's status ([`check_header_block`] says which blocks and
//! why); the message stays handed out (ack-pending) to the consumer that pulled it, comes
//! back after the ack wait, and does the same to the next pull, forever. The sweep breaks
//! that loop: after the pulling connection comes back (or is replaced), when a pull reports
//! a misread message, and before a queue is first read, it reads every message the queue's
//! consumer has handed out and not had acked (the stream sequences above the consumer's ack
//! floor up to the last one it delivered) by hand (see the `stored` module), so that
//! async-nats never parses them. A message whose block the client cannot take is published
//! to the plan's parking queue with its payload, why, and its header block byte for byte,
//! the parking stream's acknowledgement awaited; then, and only then, it is deleted from its
//! stream. A crash between the two leaves a second, parked copy (the copy's `Nats-Msg-Id`
//! names the stream, sequence and store time, so a sweep repeated within the duplicate
//! window stores it once), never a loss.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::message::PublishMessage;
use async_nats::{Client, HeaderMap};
use retry_core::{HeaderValue, TransportError, headers};
use tracing::{error, info, warn};

use crate::codec::{
    HEADER_BLOCK_HEADER, HEADER_BLOCK_LENGTH_HEADER, MSG_ID, UNDECODABLE_HEADER, copy_id,
    encode_value,
};
use crate::delivery::now_millis;
use crate::header_block::{HeaderBlockError, check_header_block};
use crate::names::stream_name;
use crate::provision::bounded;
use crate::stored::{StoredMessage, consumer_info, delete_stored, next_stored};

/// Room kept in a parked copy for its other headers and the protocol's framing.
const HEADROOM: usize = 4096;

/// Why a sweep runs, for its log.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Trigger {
    /// The pulling connection came back, or a new one replaced it.
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
    /// Messages async-nats cannot read left where they are: no parking queue known, or the
    /// parking failed.
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
    let info = consumer_info(target.client, target.timeout, target.queue).await?;
    let last = info.delivered.stream_sequence;
    let mut next = info.ack_floor.stream_sequence.saturating_add(1);
    let mut swept = Swept::default();
    // Acked messages are gone from a work-queue stream: asking for the next one on the
    // subject from `next` skips them, so the requests number the messages still handed out.
    while next <= last {
        let Some(message) = next_stored(target.client, target.timeout, target.queue, next).await?
        else {
            break;
        };
        if message.sequence > last || message.sequence < next {
            break;
        }
        next = message.sequence.saturating_add(1);
        swept.read += 1;
        let Some(block) = &message.header_block else {
            continue;
        };
        let Err(why) = check_header_block(block) else {
            continue;
        };
        match &target.parking {
            // One that cannot be parked does not keep the others in place.
            Some(parking) => match park(target, parking, &message, &why).await {
                Ok(()) => swept.parked += 1,
                Err(e) => {
                    error!(queue = %target.queue, sequence = message.sequence, why = %why, parking = %parking, error = &e as &dyn std::error::Error,
                        "parking a message async-nats cannot read failed; it stays handed out, and the next sweep tries again");
                    swept.left += 1;
                }
            },
            None => {
                error!(queue = %target.queue, stream = %stream_name(target.queue), sequence = message.sequence, why = %why,
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
    message: &StoredMessage,
    why: &HeaderBlockError,
) -> Result<(), TransportError> {
    let stream = stream_name(target.queue);
    let id = copy_id(&stream, message.sequence, message.stored_ns, parking);
    let text = |s: &str| encode_value(&HeaderValue::Str(s.to_owned()));
    let mut map = HeaderMap::new();
    map.insert(MSG_ID, id.as_str());
    map.insert(headers::REASON, "malformed");
    map.insert(headers::ORIGIN_QUEUE, text(target.queue).as_str());
    map.insert(UNDECODABLE_HEADER, text(&why.to_string()).as_str());
    map.insert(
        headers::LAST_ERROR,
        text(&format!("async-nats cannot read its header block: {why}")).as_str(),
    );
    // As the engine writes it: integer milliseconds.
    let now = i64::try_from(now_millis()).unwrap_or(i64::MAX);
    map.insert(
        headers::LAST_FAILURE,
        encode_value(&HeaderValue::Int(now)).as_str(),
    );
    let block = message.header_block.as_deref().unwrap_or_default();
    // A block kept whole (hex doubles it) must still fit the server's largest message with
    // the payload; a longer one is kept as far as it fits, and says how long it was.
    let room = target
        .client
        .server_info()
        .max_payload
        .saturating_sub(message.payload.len() + HEADROOM)
        / 2;
    let kept = match block.get(..room) {
        Some(start) if start.len() < block.len() => {
            map.insert(
                HEADER_BLOCK_LENGTH_HEADER,
                encode_value(&HeaderValue::UInt(block.len() as u64)).as_str(),
            );
            start
        }
        _ => block,
    };
    map.insert(
        HEADER_BLOCK_HEADER,
        encode_value(&HeaderValue::Bytes(kept.to_vec())).as_str(),
    );
    let publish = PublishMessage::build()
        .payload(message.payload.clone().into())
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
    let deleted = delete_stored(
        target.client,
        target.timeout,
        target.queue,
        message.sequence,
    )
    .await?;
    warn!(
        queue = %target.queue,
        sequence = message.sequence,
        why = %why,
        parking = %parking,
        parked_as = acked.sequence,
        duplicate = acked.duplicate,
        already_gone = !deleted,
        "a message async-nats cannot read was parked `malformed` and removed from its queue"
    );
    Ok(())
}
