//! AMQP 1.0 messages ↔ the engine's [`Message`]: reading a delivery and building a clone.
//!
//! A clone must be the original with new engine headers, so whatever of the original the
//! neutral [`MessageParts`] cannot hold travels beside it, inside the message's own headers,
//! under [`NATIVE_HEADER`]: the original `properties` section, the message annotations, a
//! marker for bodies that are not `data` sections, and the application properties whose AMQP
//! type a header value cannot carry. That header is the transport's: it is never sent.

use std::time::Duration;

use fe2o3_amqp::types::messaging::message::__private::Deserializable;
use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Body, Data, Header, Message as AmqpMessage, MessageAnnotations,
    MessageId, Priority, Properties as AmqpProperties,
};
use fe2o3_amqp::types::primitives::{Binary, Symbol, Timestamp as AmqpTimestamp, Value};
use retry_core::headers::BROKER_OWNED;
use retry_core::{
    BrokerSignals, Delivery, HeaderValue, Headers, Message, MessageParts, Properties, Publish,
    Timestamp,
};
use transport_kit::amqp10;

use crate::convert::{Originals, read_application_properties, write_application_properties};
use crate::profile::{BrokerProfile, NativeDelay};

/// The header under which a received message keeps what only AMQP 1.0 can express, so that
/// its clones carry it unchanged. It is removed before anything is sent, and an application
/// property of the same name arriving from the network is discarded.
pub const NATIVE_HEADER: &str = "x-amqp10-native";

/// The header of a message this transport could not decode, saying why (a string).
///
/// Such a message never reaches the engine: a subscription or a
/// [`fetch`](retry_core::Transport::fetch) settles it with `rejected`, and the queue
/// dead-letters it (a plan's work and isolation queues into its parking queue). Only a walk
/// of a queue ([`Transport::walk`](retry_core::Transport::walk), which the
/// [`ParkingLot`](retry_core::ParkingLot) reads with) hands one out, with this header, its
/// sections as they came as its body when the transport refused them before decoding (too
/// deeply nested, or no valid encoding), and nothing else. A clone of it cannot be
/// published (there is nothing of it to copy that is known to be right); it can be left or
/// purged. An application property of this name arriving from the network is discarded.
///
/// ```
/// use retry_core::Headers;
/// use transport_amqp10::UNDECODABLE_HEADER;
///
/// // How a parking-lot browser tells it from a parked message.
/// fn undecodable(headers: &Headers) -> Option<&str> {
///     headers.get(UNDECODABLE_HEADER).and_then(|why| why.as_str())
/// }
/// assert_eq!(undecodable(&Headers::new()), None);
/// ```
pub const UNDECODABLE_HEADER: &str = "x-amqp10-undecodable";

/// AMQP 1.0's default priority, used when a message has none.
const DEFAULT_PRIORITY: u8 = 4;

/// What a received message had that [`MessageParts`] cannot hold.
#[derive(Clone, Debug, Default, PartialEq)]
struct Native {
    /// The body is the AMQP encoding of `amqp-value` or `amqp-sequence` sections.
    encoded_body: bool,
    properties: Option<AmqpProperties>,
    annotations: Option<MessageAnnotations>,
    originals: Originals,
}

const KEY_BODY: &str = "encoded-body";
const KEY_PROPERTIES: &str = "properties";
const KEY_ANNOTATIONS: &str = "annotations";
const KEY_ORIGINALS: &str = "application-properties";

impl Native {
    fn is_empty(&self) -> bool {
        *self == Native::default()
    }

    fn encode(&self) -> Vec<u8> {
        let mut map = fe2o3_amqp::types::primitives::OrderedMap::new();
        let key = |k: &str| Value::Symbol(Symbol::from(k));
        if self.encoded_body {
            map.insert(key(KEY_BODY), Value::Bool(true));
        }
        if let Some(p) = &self.properties {
            map.insert(key(KEY_PROPERTIES), encoded(p));
        }
        if let Some(a) = &self.annotations {
            map.insert(key(KEY_ANNOTATIONS), encoded(a));
        }
        if !self.originals.is_empty() {
            let originals = ApplicationProperties(self.originals.clone());
            map.insert(key(KEY_ORIGINALS), encoded(&originals));
        }
        serde_amqp::to_vec(&Value::Map(map)).unwrap_or_default()
    }

    /// Best effort: the header is written by this module, but a caller may hand in any
    /// message, so a part that does not decode is left out.
    fn decode(headers: &Headers) -> Native {
        let Some(HeaderValue::Bytes(bytes)) = headers.get(NATIVE_HEADER) else {
            return Native::default();
        };
        // A message from another transport may carry anything under this name: nothing is
        // decoded that could be nested deep enough to overflow the decoder's stack.
        if amqp10::check_values(bytes).is_err() {
            return Native::default();
        }
        let Ok(Value::Map(map)) = serde_amqp::from_slice::<Value>(bytes) else {
            return Native::default();
        };
        let get = |k: &str| map.get(&Value::Symbol(Symbol::from(k)));
        let part = |k: &str| match get(k) {
            Some(Value::Binary(b)) if amqp10::check_values(b).is_ok() => Some(b.to_vec()),
            _ => None,
        };
        Native {
            encoded_body: matches!(get(KEY_BODY), Some(Value::Bool(true))),
            properties: part(KEY_PROPERTIES).and_then(|b| serde_amqp::from_slice(&b).ok()),
            annotations: part(KEY_ANNOTATIONS).and_then(|b| serde_amqp::from_slice(&b).ok()),
            originals: part(KEY_ORIGINALS)
                .and_then(|b| serde_amqp::from_slice::<ApplicationProperties>(&b).ok())
                .map(|p| p.0)
                .unwrap_or_default(),
        }
    }
}

fn encoded<T: serde_amqp::serde::Serialize>(value: &T) -> Value {
    Value::Binary(serde_amqp::to_vec(value).unwrap_or_default().into())
}

/// Converts a received AMQP 1.0 message consumed from `queue` into a delivery settled
/// through `tag`.
///
/// The exchange is unknown over AMQP 1.0 and left empty; the routing key is the `subject`
/// (RabbitMQ puts the AMQP 0-9-1 routing key there), else the queue name.
pub(crate) fn read_message<T>(
    message: AmqpMessage<Body<Value>>,
    queue: &str,
    profile: &BrokerProfile,
    tag: T,
) -> Delivery<T> {
    let AmqpMessage {
        header,
        delivery_annotations: _,
        message_annotations,
        properties,
        application_properties,
        body,
        footer: _,
    } = message;
    let mut native = Native::default();

    let (mut headers, originals) = application_properties
        .as_ref()
        .map(read_application_properties)
        .unwrap_or_default();
    // The names are this transport's: a peer must not be able to smuggle parts into clones,
    // or pass a message off as undecodable.
    headers.remove(NATIVE_HEADER);
    headers.remove(UNDECODABLE_HEADER);
    native.originals = originals;
    native.originals.swap_remove(NATIVE_HEADER);
    native.originals.swap_remove(UNDECODABLE_HEADER);

    let (body, encoded_body) = read_body(body);
    native.encoded_body = encoded_body;

    let mut neutral = Properties {
        persistent: header.as_ref().is_some_and(|h| h.durable),
        priority: header.as_ref().map(|h| h.priority.0),
        ..Properties::default()
    };
    let mut routing_key = queue.to_owned();
    if let Some(p) = &properties {
        neutral.content_type = p.content_type.as_ref().map(|s| s.as_str().to_owned());
        neutral.content_encoding = p.content_encoding.as_ref().map(|s| s.as_str().to_owned());
        neutral.message_id = p.message_id.as_ref().map(id_text);
        neutral.correlation_id = p.correlation_id.as_ref().map(id_text);
        neutral.reply_to = p.reply_to.clone();
        neutral.timestamp = p
            .creation_time
            .as_ref()
            .and_then(|t| u64::try_from(t.milliseconds()).ok())
            .map(Timestamp::from_millis);
        if let Some(subject) = &p.subject {
            routing_key = subject.clone();
        }
    }
    native.properties = properties;
    native.annotations = message_annotations.and_then(kept_annotations);

    if !native.is_empty() {
        headers.insert(NATIVE_HEADER, HeaderValue::Bytes(native.encode()));
    }

    let signals = signals(header.as_ref(), profile);
    let parts = MessageParts {
        queue: queue.to_owned(),
        exchange: String::new(),
        routing_key,
        body,
        properties: neutral,
        headers,
        native: Default::default(),
    };
    Delivery::new(tag, parts, signals)
}

/// A message that could not be decoded, as a walk hands it out: `why` in
/// [`UNDECODABLE_HEADER`], its sections as they came (if kept) as the body.
pub(crate) fn undecodable_message<T>(
    queue: &str,
    why: String,
    sections: Option<Vec<u8>>,
    tag: T,
) -> Delivery<T> {
    let mut headers = Headers::new();
    headers.insert_static(UNDECODABLE_HEADER, why);
    let parts = MessageParts {
        queue: queue.to_owned(),
        exchange: String::new(),
        routing_key: queue.to_owned(),
        body: sections.unwrap_or_default(),
        properties: Properties::default(),
        headers,
        native: Default::default(),
    };
    Delivery::new(tag, parts, BrokerSignals::default())
}

/// The broker's signals. RabbitMQ 3.x leaves `delivery-count` at 0 and marks a redelivery
/// only by `first-acquirer = false`. Elsewhere `delivery-count` is the reliable signal, and
/// `first-acquirer` is not trusted: brokers that do not track it leave it at its default,
/// `false`, which would make every delivery look like a crash.
fn signals(header: Option<&Header>, profile: &BrokerProfile) -> BrokerSignals {
    let Some(h) = header else {
        return BrokerSignals::default();
    };
    match profile {
        BrokerProfile::RabbitMq3 => BrokerSignals {
            redelivered: !h.first_acquirer,
            delivery_count: None,
        },
        BrokerProfile::Generic(_) => BrokerSignals {
            redelivered: h.delivery_count > 0,
            delivery_count: Some(h.delivery_count),
        },
    }
}

/// The body as bytes, and whether they are encoded sections rather than `data` content.
///
/// `data` sections are the bytes themselves (several are joined). Any other body is its AMQP
/// encoding, which is also what RabbitMQ shows an AMQP 0-9-1 consumer of such a message.
fn read_body(body: Body<Value>) -> (Vec<u8>, bool) {
    match body {
        Body::Data(batch) => {
            let mut sections = batch.into_iter();
            match (sections.next(), sections.next()) {
                (None, _) => (Vec::new(), false),
                (Some(Data(only)), None) => (only.into_vec(), false),
                (Some(Data(first)), Some(Data(second))) => {
                    let mut out = first.into_vec();
                    out.extend_from_slice(&second);
                    for Data(more) in sections {
                        out.extend_from_slice(&more);
                    }
                    (out, false)
                }
            }
        }
        Body::Empty => (Vec::new(), false),
        other => match serde_amqp::to_vec(&other) {
            Ok(bytes) => (bytes, true),
            Err(_) => (Vec::new(), false),
        },
    }
}

/// Annotations a clone keeps: not the broker's own records, not a delay meant for the
/// original.
fn kept_annotations(annotations: MessageAnnotations) -> Option<MessageAnnotations> {
    let kept: MessageAnnotations = MessageAnnotations(
        annotations
            .0
            .into_iter()
            .filter(|(key, _)| match key {
                fe2o3_amqp::types::messaging::annotations::OwnedKey::Symbol(s) => {
                    let s = s.as_str();
                    !NativeDelay::ANNOTATIONS.contains(&s) && !BROKER_OWNED.contains(&s)
                }
                fe2o3_amqp::types::messaging::annotations::OwnedKey::Ulong(_) => true,
            })
            .collect(),
    );
    (!kept.0.is_empty()).then_some(kept)
}

fn id_text(id: &MessageId) -> String {
    match id {
        MessageId::String(s) => s.clone(),
        MessageId::Ulong(n) => n.to_string(),
        MessageId::Uuid(u) => transport_kit::amqp10::hyphenated(u.as_inner()),
        MessageId::Binary(b) => b.iter().map(|byte| format!("{byte:02x}")).collect(),
    }
}

/// How a clone is to be delayed by the broker, when the profile delays natively.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub(crate) kind: NativeDelay,
    pub(crate) now: Timestamp,
    pub(crate) delay: Duration,
}

/// Builds the clone of `original` that `publish` asks for.
///
/// The body, properties and annotations are the original's; the application properties are
/// the original's headers with the engine's written over (see
/// [`clone_headers`]); `ttl` is the engine's per-message expiration unless the broker delays
/// the clone by itself.
pub(crate) fn build_clone(
    original: &Message,
    publish: &Publish,
    schedule: Option<Schedule>,
) -> AmqpMessage<Body<Value>> {
    let mut headers = publish.clone_headers(original);
    headers.remove(NATIVE_HEADER);
    let native = Native::decode(original.headers());
    let application_properties = write_application_properties(&headers, &native.originals);

    let neutral = original.properties();
    let ttl = match schedule {
        Some(_) => None,
        None => publish
            .expiration
            .map(|d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX)),
    };
    let header = Header {
        durable: neutral.persistent,
        priority: Priority(neutral.priority.unwrap_or(DEFAULT_PRIORITY)),
        ttl,
        first_acquirer: false,
        delivery_count: 0,
    };

    let properties = match native.properties {
        Some(mut p) => {
            // The broker checks user-id against the connection's user, and `to` named the
            // original's address.
            p.user_id = None;
            p.to = None;
            p
        }
        None => properties_from_neutral(neutral),
    };

    let mut annotations = native.annotations.unwrap_or_default();
    if let Some(s) = schedule {
        let (key, value) = s.kind.annotate(s.now, s.delay);
        annotations.0.insert(key, value);
    }

    let body = if native.encoded_body {
        decode_sections(original.body())
    } else {
        None
    }
    .unwrap_or_else(|| Body::Data(vec![Data(Binary::from(original.body().to_vec()))].into()));

    AmqpMessage {
        header: Some(header),
        delivery_annotations: None,
        message_annotations: (!annotations.0.is_empty()).then_some(annotations),
        properties: Some(properties),
        application_properties: Some(application_properties),
        body,
        footer: None,
    }
}

/// Body sections from their encoding; a message that holds only body sections is a valid
/// encoded message.
fn decode_sections(bytes: &[u8]) -> Option<Body<Value>> {
    amqp10::check_message(bytes).ok()?;
    serde_amqp::from_slice::<Deserializable<AmqpMessage<Body<Value>>>>(bytes)
        .ok()
        .map(|m| m.0.body)
        .filter(|b| !b.is_empty())
}

fn properties_from_neutral(p: &Properties) -> AmqpProperties {
    AmqpProperties {
        message_id: p.message_id.clone().map(MessageId::String),
        correlation_id: p.correlation_id.clone().map(MessageId::String),
        reply_to: p.reply_to.clone(),
        content_type: p.content_type.clone().map(Symbol::from),
        content_encoding: p.content_encoding.clone().map(Symbol::from),
        creation_time: p.timestamp.map(|t| {
            AmqpTimestamp::from_milliseconds(i64::try_from(t.as_millis()).unwrap_or(i64::MAX))
        }),
        ..AmqpProperties::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp::types::messaging::{AmqpSequence, AmqpValue, annotations::OwnedKey};
    use fe2o3_amqp::types::primitives::SimpleValue;
    use retry_core::headers::{ATTEMPTS, EngineHeaders, ORIGIN_QUEUE};
    use retry_core::{Route, headers::DELAY};
    use std::sync::Arc;

    fn publish(expiration: Option<Duration>) -> Publish {
        Publish {
            route: Route {
                exchange: Arc::from("q.retry"),
                routing_key: Arc::from("q.retry.1s"),
            },
            expiration,
            headers: EngineHeaders {
                attempts: 1,
                crashes: 0,
                first_failure: Some(Timestamp::from_millis(10)),
                last_failure: Some(Timestamp::from_millis(10)),
                last_error: Some("boom".into()),
                reason: None,
                delay: Some(Duration::from_secs(1)),
                suspect: None,
            },
        }
    }

    fn rabbit() -> BrokerProfile {
        BrokerProfile::RabbitMq3
    }

    #[test]
    fn data_body_and_properties_survive_a_clone() {
        let body = vec![0u8, 159, 146, 150, 255];
        let incoming = AmqpMessage {
            header: Some(Header {
                durable: true,
                priority: Priority(7),
                ttl: None,
                first_acquirer: true,
                delivery_count: 0,
            }),
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(AmqpProperties {
                message_id: Some(MessageId::Ulong(42)),
                user_id: Some(Binary::from(b"alice".to_vec())),
                subject: Some("orders.created".into()),
                content_type: Some(Symbol::from("application/octet-stream")),
                group_id: Some("g".into()),
                ..AmqpProperties::default()
            }),
            application_properties: Some(
                ApplicationProperties::builder()
                    .insert("tenant", SimpleValue::Symbol(Symbol::from("acme")))
                    .insert(NATIVE_HEADER, "smuggled")
                    .build(),
            ),
            body: Body::Data(vec![Data(Binary::from(body.clone()))].into()),
            footer: None,
        };
        let received = read_message(incoming, "q", &rabbit(), ());
        let msg = &received.message;
        assert_eq!(msg.body(), &body[..]);
        assert_eq!(msg.routing_key(), "orders.created");
        assert_eq!(msg.properties().message_id.as_deref(), Some("42"));
        assert_eq!(msg.properties().priority, Some(7));
        assert!(msg.properties().persistent);
        assert_eq!(
            msg.headers().get("tenant"),
            Some(&HeaderValue::Str("acme".into()))
        );
        assert!(!received.facts.redelivered);

        let clone = build_clone(msg, &publish(Some(Duration::from_millis(300))), None);
        let Body::Data(batch) = &clone.body else {
            panic!("{:?}", clone.body)
        };
        assert_eq!(batch.len(), 1);
        assert_eq!(batch.iter().next().map(|d| d.0.to_vec()), Some(body));
        let header = clone.header.expect("header");
        assert_eq!(header.ttl, Some(300));
        assert_eq!(header.priority, Priority(7));
        assert!(header.durable);
        let props = clone.properties.expect("properties");
        assert_eq!(props.message_id, Some(MessageId::Ulong(42)), "id type kept");
        assert_eq!(props.subject.as_deref(), Some("orders.created"));
        assert_eq!(props.group_id.as_deref(), Some("g"));
        assert_eq!(props.user_id, None, "user-id is the connection's business");
        let app = clone
            .application_properties
            .expect("application properties");
        assert_eq!(
            app.get("tenant"),
            Some(&SimpleValue::Symbol(Symbol::from("acme")))
        );
        assert_eq!(app.get(ATTEMPTS), Some(&SimpleValue::Long(1)));
        assert_eq!(app.get(DELAY), Some(&SimpleValue::Long(1_000)));
        assert_eq!(
            app.get(ORIGIN_QUEUE),
            Some(&SimpleValue::String("q".into()))
        );
        assert!(app.get(NATIVE_HEADER).is_none(), "never sent");
        assert!(!app.values().any(|v| *v == SimpleValue::from("smuggled")));
    }

    #[test]
    fn value_and_sequence_bodies_go_back_as_the_same_sections() {
        for body in [
            Body::Value(AmqpValue(Value::String("hello".into()))),
            Body::Sequence(
                vec![
                    AmqpSequence(vec![Value::Int(1), Value::Bool(false)]),
                    AmqpSequence(vec![Value::Null]),
                ]
                .into(),
            ),
        ] {
            let incoming = AmqpMessage {
                header: None,
                delivery_annotations: None,
                message_annotations: None,
                properties: None,
                application_properties: None,
                body: body.clone(),
                footer: None,
            };
            let received = read_message(incoming, "q", &rabbit(), ());
            assert_eq!(
                received.message.body(),
                serde_amqp::to_vec(&body).expect("encodes").as_slice(),
                "the body is the sections' encoding"
            );
            let clone = build_clone(&received.message, &publish(None), None);
            assert_eq!(clone.body, body);
        }
    }

    #[test]
    fn several_data_sections_are_joined() {
        let incoming = AmqpMessage {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: None,
            application_properties: None,
            body: Body::<Value>::Data(
                vec![
                    Data(Binary::from(b"ab".to_vec())),
                    Data(Binary::from(b"c".to_vec())),
                    Data(Binary::from(b"de".to_vec())),
                ]
                .into(),
            ),
            footer: None,
        };
        let received = read_message(incoming, "q", &rabbit(), ());
        assert_eq!(received.message.body(), b"abcde");
    }

    #[test]
    fn rabbitmq_redelivery_is_first_acquirer_false() {
        let header = Header {
            first_acquirer: false,
            delivery_count: 0,
            ..Header::default()
        };
        let s = signals(Some(&header), &rabbit());
        assert!(s.redelivered);
        assert_eq!(s.delivery_count, None);
        assert_eq!(signals(None, &rabbit()), BrokerSignals::default());
    }

    #[test]
    fn generic_brokers_are_read_by_delivery_count() {
        let generic = BrokerProfile::Generic(crate::profile::GenericProfile::new());
        let fresh = Header {
            first_acquirer: false,
            delivery_count: 0,
            ..Header::default()
        };
        assert!(!signals(Some(&fresh), &generic).redelivered);
        let again = Header {
            delivery_count: 3,
            ..fresh
        };
        let s = signals(Some(&again), &generic);
        assert!(s.redelivered);
        assert_eq!(s.delivery_count, Some(3));
    }

    #[test]
    fn native_delays_annotate_and_drop_the_ttl() {
        let msg = Message::new(MessageParts {
            queue: "q".into(),
            body: b"x".to_vec(),
            ..MessageParts::default()
        });
        let schedule = Schedule {
            kind: NativeDelay::DeliveryDelay,
            now: Timestamp::from_millis(1_000),
            delay: Duration::from_secs(2),
        };
        let clone = build_clone(&msg, &publish(Some(Duration::from_secs(1))), Some(schedule));
        assert_eq!(clone.header.expect("header").ttl, None);
        let annotations = clone.message_annotations.expect("annotations");
        assert_eq!(
            annotations
                .0
                .get(&OwnedKey::Symbol(Symbol::from("x-opt-delivery-delay"))),
            Some(&Value::Long(2_000))
        );
    }

    #[test]
    fn stale_delays_and_broker_records_are_not_copied() {
        let mut annotations = MessageAnnotations::default();
        annotations.0.insert(
            OwnedKey::Symbol(Symbol::from("x-opt-delivery-time")),
            Value::Long(5),
        );
        annotations
            .0
            .insert(OwnedKey::Symbol(Symbol::from("x-death")), Value::Null);
        annotations.0.insert(
            OwnedKey::Symbol(Symbol::from("x-opt-jms-type")),
            Value::String("t".into()),
        );
        let kept = kept_annotations(annotations).expect("one kept");
        assert_eq!(kept.0.len(), 1);
        assert!(
            kept_annotations(MessageAnnotations::default()).is_none(),
            "nothing to keep"
        );
    }

    /// Lists (list32, one element each) nested `depth` deep around an empty one.
    fn nested_lists(depth: usize) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(9 * depth + 1);
        for level in 0..depth {
            let size = u32::try_from(4 + 9 * (depth - level - 1) + 1).expect("fits");
            bytes.push(0xd0);
            bytes.extend_from_slice(&size.to_be_bytes());
            bytes.extend_from_slice(&1u32.to_be_bytes());
        }
        bytes.push(0x45);
        bytes
    }

    #[test]
    fn a_native_record_nested_too_deep_is_ignored_not_decoded() {
        // What another transport may hand in under the name: decoding it would recurse
        // 100 000 deep and abort the process.
        let msg = Message::new(MessageParts {
            queue: "q".into(),
            body: b"plain".to_vec(),
            headers: [(NATIVE_HEADER, HeaderValue::Bytes(nested_lists(100_000)))]
                .into_iter()
                .collect(),
            ..MessageParts::default()
        });
        let clone = build_clone(&msg, &publish(None), None);
        assert_eq!(
            clone.body,
            Body::Data(vec![Data(Binary::from(b"plain".to_vec()))].into())
        );
    }

    #[test]
    fn encoded_sections_nested_too_deep_are_sent_as_data_not_decoded() {
        let native = Native {
            encoded_body: true,
            ..Native::default()
        };
        let mut sections = vec![0x00, 0x53, 0x77];
        sections.extend_from_slice(&nested_lists(100_000));
        let msg = Message::new(MessageParts {
            queue: "q".into(),
            body: sections.clone(),
            headers: [(NATIVE_HEADER, HeaderValue::Bytes(native.encode()))]
                .into_iter()
                .collect(),
            ..MessageParts::default()
        });
        let clone = build_clone(&msg, &publish(None), None);
        assert_eq!(
            clone.body,
            Body::Data(vec![Data(Binary::from(sections))].into())
        );
    }

    #[test]
    fn an_undecodable_mark_from_the_network_is_discarded() {
        // Left in, it would make every clone of the message fail to publish.
        let mut props = ApplicationProperties::default();
        props.0.insert(
            UNDECODABLE_HEADER.to_owned(),
            SimpleValue::String("forged".into()),
        );
        props
            .0
            .insert("kept".to_owned(), SimpleValue::String("yes".into()));
        let incoming = AmqpMessage {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: None,
            application_properties: Some(props),
            body: Body::<Value>::Empty,
            footer: None,
        };
        let received = read_message(incoming, "q", &rabbit(), ());
        assert_eq!(received.message.headers().get(UNDECODABLE_HEADER), None);
        assert!(received.message.headers().get("kept").is_some());
        let clone = build_clone(&received.message, &publish(None), None);
        let written = clone
            .application_properties
            .expect("application properties");
        assert!(!written.0.contains_key(UNDECODABLE_HEADER));
    }

    #[test]
    fn an_undecodable_message_is_its_sections_and_why() {
        let d = undecodable_message("q", "why".into(), Some(vec![0x00, 0x53]), ());
        assert_eq!(d.message.body(), [0x00, 0x53]);
        assert_eq!(
            d.message
                .headers()
                .get(UNDECODABLE_HEADER)
                .and_then(|v| v.as_str()),
            Some("why")
        );
        assert!(!d.facts.redelivered);
    }

    #[test]
    fn a_message_from_elsewhere_is_cloned_from_its_neutral_parts() {
        let msg = Message::new(MessageParts {
            queue: "q".into(),
            body: b"plain".to_vec(),
            properties: Properties {
                message_id: Some("m-1".into()),
                content_type: Some("text/plain".into()),
                ..Properties::default()
            },
            headers: [(NATIVE_HEADER, HeaderValue::Bytes(vec![0xff, 0x00]))]
                .into_iter()
                .collect(),
            ..MessageParts::default()
        });
        let clone = build_clone(&msg, &publish(None), None);
        let props = clone.properties.expect("properties");
        assert_eq!(props.message_id, Some(MessageId::String("m-1".into())));
        assert_eq!(props.content_type, Some(Symbol::from("text/plain")));
        assert_eq!(
            clone.body,
            Body::Data(vec![Data(Binary::from(b"plain".to_vec()))].into())
        );
    }
}
