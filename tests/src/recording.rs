//! A transport wrapper that records every delivery the broker hands the consumer, as the
//! transport received it: the differential check compares these records between the memory
//! model and RabbitMQ.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use retry_core::{
    Capabilities, Delivery, Headers, Message, Publish, PublishResult, Settlement, SoloGate,
    Subscription, Timestamp, TopologyPlan, Transport, TransportError,
};

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

/// A transport that passes everything to `T` and logs each delivery its subscriptions
/// receive and each message its fetches take.
#[derive(Debug)]
pub struct Recorded<T> {
    inner: T,
    log: DeliveryLog,
}

impl<T> Recorded<T> {
    /// Wraps `inner`, logging into `log`.
    pub fn new(inner: T, log: DeliveryLog) -> Self {
        Recorded { inner, log }
    }
}

/// A subscription of a [`Recorded`] transport.
#[derive(Debug)]
pub struct RecordedSubscription<S> {
    inner: S,
    log: DeliveryLog,
}

#[async_trait]
impl<S: Subscription> Subscription for RecordedSubscription<S> {
    type Tag = S::Tag;

    async fn recv(&self) -> Result<Option<Delivery<S::Tag>>, TransportError> {
        let got = self.inner.recv().await?;
        if let Some(d) = &got {
            self.log.record(d);
        }
        Ok(got)
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        self.inner.cancel().await
    }

    async fn flush(&self) -> Result<(), TransportError> {
        self.inner.flush().await
    }
}

#[async_trait]
impl<T: Transport> Transport for Recorded<T> {
    type Tag = T::Tag;
    type Subscription = RecordedSubscription<T::Subscription>;

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.provision(plan).await
    }

    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.verify(plan).await
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self::Subscription, TransportError> {
        Ok(RecordedSubscription {
            inner: self.inner.consume(queue, prefetch).await?,
            log: self.log.clone(),
        })
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<T::Tag>>, TransportError> {
        let got = self.inner.fetch(queue).await?;
        if let Some(d) = &got {
            self.log.record(d);
        }
        Ok(got)
    }

    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        self.inner.ready(queue, poll).await
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        self.inner.publish(original, publish).await
    }

    async fn settle(&self, tag: &T::Tag, settlement: Settlement) -> Result<(), TransportError> {
        self.inner.settle(tag, settlement).await
    }

    fn now(&self) -> Timestamp {
        self.inner.now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.inner.sleep(duration)
    }

    fn solo_gate(&self) -> Option<SoloGate> {
        self.inner.solo_gate()
    }
}
