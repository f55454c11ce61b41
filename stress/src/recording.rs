//! A transport wrapper that records every delivery the broker hands the consumer, as the
//! transport received it: the differential check compares these records between the memory
//! model and RabbitMQ.

use std::sync::{Arc, Mutex};

use retry_core::{Delivery, Headers, Message, Transport};
use transport_kit::forward::{Decorate, Decorated};

/// One delivery as the broker produced it.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The queue it came from.
    pub queue: String,
    /// Its `message-id` (empty when it has none).
    pub id: String,
    /// The exchange it was last published or dead-lettered through, where observed.
    pub exchange: Option<String>,
    /// The routing key it was last published or dead-lettered with, where observed.
    pub routing_key: Option<String>,
    /// The broker's redelivered flag, where observed (not on a parked message, which the
    /// harness reads with an auto-acknowledging get).
    pub redelivered: Option<bool>,
    /// Its headers: the broker's (`x-death`, `x-delivery-count`, ...) and the engine's.
    pub headers: Headers,
}

impl Observed {
    /// The record of `message`, delivered with the `redelivered` flag.
    pub fn of(message: &Message, redelivered: Option<bool>) -> Self {
        Observed {
            queue: message.queue().to_owned(),
            id: message.properties().message_id.clone().unwrap_or_default(),
            exchange: Some(message.exchange().to_owned()),
            routing_key: Some(message.routing_key().to_owned()),
            redelivered,
            headers: message.headers().clone(),
        }
    }
}

/// Deliveries in the order they arrived, shared by every [`Recorded`] transport of a run.
#[derive(Clone, Debug, Default)]
pub struct DeliveryLog(Arc<Mutex<Vec<Observed>>>);

impl DeliveryLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `observed`.
    pub fn push(&self, observed: Observed) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(observed);
    }

    fn record<T>(&self, delivery: &Delivery<T>) {
        self.push(Observed::of(
            &delivery.message,
            Some(delivery.facts.redelivered),
        ));
    }

    /// Everything logged so far, in arrival order.
    pub fn snapshot(&self) -> Vec<Observed> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A transport that passes everything to `T` and logs each delivery it hands out, from a
/// subscription, a fetch or a walk: `T` decorated by its [`DeliveryLog`].
pub type Recorded<T> = Decorated<T, DeliveryLog>;

/// Logs each delivery; forwards everything else.
impl<T: Transport> Decorate<T> for DeliveryLog {
    type Mark = ();

    fn delivered(&self, _queue: &str, delivery: &Delivery<T::Tag>) {
        self.record(delivery);
    }
}
