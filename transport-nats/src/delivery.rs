//! What a JetStream message becomes: a delivery with its facts and its settling tag.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::Client;
use async_nats::jetstream;
use retry_core::{BrokerSignals, Delivery, MessageParts, NativeParts, TransportError};
use tokio::sync::OwnedSemaphorePermit;

use crate::codec::read_headers;
use crate::tag::{NatsTag, TagKind};

/// Where a delivery came from, kept with its message so a clone's `Nats-Msg-Id` names it.
#[derive(Clone, Debug)]
pub(crate) struct Origin {
    pub stream: String,
    pub sequence: u64,
    pub stored_ns: i128,
}

/// The wall clock in milliseconds since the epoch, rounded up: a due time made from it is
/// never early.
pub(crate) fn now_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
        u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
    })
}

/// The delivery a consumer's message makes.
pub(crate) fn delivery_of(
    client: &Client,
    message: jetstream::Message,
    queue: &str,
    fetched: bool,
    timeout: Duration,
    permit: Option<OwnedSemaphorePermit>,
) -> Result<Delivery<NatsTag>, TransportError> {
    let info = message.info().map_err(TransportError::Other)?;
    let origin = Origin {
        stream: info.stream.to_owned(),
        sequence: info.stream_sequence,
        stored_ns: info.published.unix_timestamp_nanos(),
    };
    // The server counts every delivery, a nak's as much as a crash's: a redelivered flag.
    let redelivered = info.delivered > 1;
    let reply = message.message.reply.clone().ok_or_else(|| {
        TransportError::Other("a JetStream delivery without a reply subject".into())
    })?;
    let (properties, headers) = read_headers(message.message.headers.as_ref());
    let parts = MessageParts {
        queue: queue.to_owned(),
        exchange: String::new(),
        routing_key: message.message.subject.to_string(),
        body: message.message.payload.to_vec(),
        properties,
        headers,
        native: NativeParts::new(origin.clone()),
    };
    let tag = NatsTag::delivered(
        TagKind::Delivered {
            client: client.clone(),
            reply,
            stream: origin.stream,
            sequence: origin.sequence,
            fetched,
            timeout,
        },
        permit,
    );
    Ok(Delivery::new(
        tag,
        parts,
        BrokerSignals {
            redelivered,
            delivery_count: None,
        },
    ))
}
