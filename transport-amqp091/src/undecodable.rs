//! Deliveries the connection's tap kept from lapin (see the `tap` module), as the transport
//! hands them on: never to a handler.
//!
//! A delivery from a plan's work or isolation queue is settled `basic.reject` without
//! requeue where it arrives, so the queue dead-letters it into the plan's parking queue with
//! its bytes exactly as they came. From any other queue (a walk of a parking queue, a queue
//! of no plan this transport provisioned or verified, whose dead-lettering it cannot know)
//! it is handed out as a message with no properties, its body, and two headers:
//! [`UNDECODABLE_HEADER`] (why) and [`RAW_PROPERTIES_HEADER`] (its properties as they came).
//! Neither header is ever taken from the network: a publisher that writes them has them
//! removed.

use lapin::types::AMQPValue;
use retry_core::{
    Delivery, HeaderValue, Headers, MessageParts, NativeParts, Properties, Settlement,
};
use tracing::warn;

use crate::tag::AmqpTag;
use crate::tap::{Lookup, MARK, Refusals};

/// Why a message could not be read as it came: set on a delivery the transport hands out
/// in place of a message lapin cannot parse (see the crate docs). A publisher cannot set
/// it: the header is removed from every message read from the broker.
///
/// ```
/// use retry_core::Headers;
/// use transport_amqp091::UNDECODABLE_HEADER;
///
/// fn undecodable(headers: &Headers) -> Option<&str> {
///     headers.get(UNDECODABLE_HEADER).and_then(|why| why.as_str())
/// }
/// assert_eq!(undecodable(&Headers::new()), None);
/// ```
pub const UNDECODABLE_HEADER: &str = "x-amqp091-undecodable";

/// The properties of a message that could not be read, as they came (the content header's
/// property flags, then its property list): bytes, beside [`UNDECODABLE_HEADER`]. Absent
/// when the transport had to drop them to bound its memory.
///
/// ```
/// use retry_core::{HeaderValue, Headers};
/// use transport_amqp091::RAW_PROPERTIES_HEADER;
///
/// fn raw_properties(headers: &Headers) -> Option<&[u8]> {
///     match headers.get(RAW_PROPERTIES_HEADER) {
///         Some(HeaderValue::Bytes(raw)) => Some(raw),
///         _ => None,
///     }
/// }
/// assert_eq!(raw_properties(&Headers::new()), None);
/// ```
pub const RAW_PROPERTIES_HEADER: &str = "x-amqp091-raw-properties";

/// What a delivery's content header says of the tap.
pub(crate) enum Reading {
    /// Read as it came.
    Plain,
    /// Kept from lapin: why, and its properties as they came when still known.
    Undecodable {
        why: String,
        properties: Option<Vec<u8>>,
    },
}

/// Whether `delivery` is one the tap kept from lapin, by the mark it carries. A mark that
/// names nothing of `refusals` came from a publisher and is left for [`strip`] to remove.
pub(crate) fn reading(delivery: &lapin::message::Delivery, refusals: Option<&Refusals>) -> Reading {
    let Some(table) = delivery.properties.headers() else {
        return Reading::Plain;
    };
    let Some(mark) = table.inner().get(MARK) else {
        return Reading::Plain;
    };
    let token = match mark {
        AMQPValue::LongString(s) => s.as_bytes(),
        _ => return Reading::Plain,
    };
    match refusals.map(|r| r.take(token)) {
        Some(Lookup::Refused(refused)) => Reading::Undecodable {
            why: refused.refusal.to_string(),
            properties: Some(refused.properties),
        },
        Some(Lookup::Forgotten) => Reading::Undecodable {
            why: "it could not be read as it came; what was wrong was not kept".into(),
            properties: None,
        },
        Some(Lookup::Forged) | None => Reading::Plain,
    }
}

/// Removes the headers only the transport may set from headers read off the network.
pub(crate) fn strip(headers: &mut Headers) {
    for name in [MARK, UNDECODABLE_HEADER, RAW_PROPERTIES_HEADER] {
        headers.remove(name);
    }
}

/// The parts of a delivery kept from lapin: its body, no properties, why and its properties
/// as they came in headers.
pub(crate) fn parts(
    delivery: lapin::message::Delivery,
    queue: &str,
    why: String,
    properties: Option<Vec<u8>>,
) -> MessageParts {
    let mut headers = Headers::new();
    headers.insert(UNDECODABLE_HEADER, HeaderValue::Str(why));
    if let Some(raw) = properties {
        headers.insert(RAW_PROPERTIES_HEADER, HeaderValue::Bytes(raw));
    }
    MessageParts {
        queue: queue.to_owned(),
        exchange: delivery.exchange.as_str().to_owned(),
        routing_key: delivery.routing_key.as_str().to_owned(),
        body: delivery.data,
        properties: Properties::default(),
        headers,
        native: NativeParts::default(),
    }
}

/// `delivery`, unless the tap kept it from lapin and `queue` dead-letters into its parking
/// queue (`dead_letters`): that one is settled `basic.reject` without requeue here, so the
/// queue dead-letters it as it came, and `None` comes back. A reject that fails (the channel
/// is gone) is logged and left: the broker has the delivery back and hands it out again.
pub(crate) async fn unless_parked(
    queue: &str,
    delivery: Delivery<AmqpTag>,
    dead_letters: bool,
) -> Option<Delivery<AmqpTag>> {
    let why = match delivery.message.headers().get(UNDECODABLE_HEADER) {
        Some(why) if dead_letters => why.as_str().unwrap_or_default(),
        _ => return Some(delivery),
    };
    warn!(
        queue,
        delivery_tag = delivery.tag.delivery_tag(),
        why,
        "rejecting a message that cannot be read as it came: the queue dead-letters it into its parking queue"
    );
    if let Err(e) = delivery.tag.settle(Settlement::Reject).await {
        warn!(queue, error = %e, "the reject of a message that cannot be read failed; the broker hands it out again");
    }
    None
}
