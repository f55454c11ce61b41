//! The retry engine's view of a delivery: its [`Message`], its
//! [`DeliveryFacts`](retry_core::DeliveryFacts) and its [`DeliveryTag`], made from what the
//! broker hands out.

use std::sync::Arc;

use retry_core::{BrokerSignals, Delivery, Headers, Message, MessageParts, Properties};

use crate::broker::core::State;
use crate::broker::message::{Handout, Held, MessageKey};

/// The handle that settles one delivery: its connection and its delivery tag there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeliveryTag {
    /// The connection it was delivered on.
    pub connection: u64,
    /// The delivery tag, from 1 on each connection.
    pub tag: u64,
}

/// The engine's delivery of a message the broker handed out, and what the client keeps of it
/// while it is unacknowledged: the same [`Message`], so the content is never copied.
pub(crate) fn receive(h: Handout) -> (Delivery<DeliveryTag>, Box<dyn Held>) {
    let Handout {
        connection,
        tag,
        queue,
        exchange,
        routing_key,
        body,
        properties,
        headers,
        redelivered,
    } = h;
    let parts = MessageParts {
        // `String::from`, not `to_string`: no formatting machinery per delivery.
        queue: String::from(&*queue),
        exchange: String::from(&*exchange),
        routing_key: String::from(&*routing_key),
        body,
        properties,
        headers,
        native: Default::default(),
    };
    let signals = BrokerSignals {
        redelivered,
        delivery_count: None,
    };
    let tag = DeliveryTag {
        connection: connection as u64,
        tag,
    };
    let delivery = Delivery::new(tag, parts, signals);
    let message = delivery.message.clone();
    (delivery, Box::new(message))
}

impl Held for Message {
    fn body(&self) -> &[u8] {
        Message::body(self)
    }

    fn properties(&self) -> &Properties {
        Message::properties(self)
    }

    fn headers(&self) -> &Headers {
        Message::headers(self)
    }

    /// Where its shared parts are: every clone of one delivery's message shares them.
    fn address(&self) -> usize {
        std::ptr::from_ref(self.parts()).addr()
    }
}

/// The broker's identity of `original`, a message delivered to a client and still
/// unacknowledged, so a clone published from it keeps it; `None` for any other message.
///
/// The engine hands back the very [`Message`] it received, and a `Message` has no room for
/// the broker's id, so the delivery is recognised by the message it holds: the same shared
/// parts, not equal ones (two deliveries can carry equal content with different ids).
pub(crate) fn identity_of(state: &State, original: &Message) -> Option<(MessageKey, Arc<str>)> {
    state.connections().find_held(original.address())
}
