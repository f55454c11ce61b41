//! The forwarding layer forwards every method: a decorator that overrides nothing changes
//! nothing, provided methods included, and every delivery is marked once whichever way it
//! arrives.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::executor::block_on;
use futures::future::BoxFuture;
use retry_core::headers::EngineHeaders;
use retry_core::{
    Admin, Applied, AppliedObject, BrokerSignals, Capabilities, CheckReport, Delivery, Depth,
    DynTransport, Message, MessageParts, PlanOptions, Properties, Publish, PublishResult,
    QueueWalk, RetryPolicy, Route, Settlement, SoloGate, Subscription, Timestamp, TopologyPlan,
    Transport, TransportError,
};
use transport_kit::forward::{Decorate, Decorated};

/// Every method of `Transport`, `Subscription`, `QueueWalk` and `Admin`, as [`Probe`] writes
/// down its calls. A method added to one of those traits belongs here, with a call in
/// [`call_everything`].
const EVERY_METHOD: &[&str] = &[
    "capabilities",
    "provision",
    "verify",
    "consume",
    "fetch",
    "ready",
    "publish",
    "settle",
    "walk",
    "close",
    "now",
    "sleep",
    "solo_gate",
    "subscription.recv",
    "subscription.cancel",
    "subscription.flush",
    "walk.next",
    "walk.leave",
    "walk.ack",
    "walk.end",
    "depth",
    "apply",
    "check",
    "may_hide_headers",
    "hidden_headers",
];

/// Calls written down, shared by a probe and its subscriptions and walks.
#[derive(Clone, Debug, Default)]
struct Calls(Arc<Mutex<Vec<String>>>);

impl Calls {
    fn push(&self, call: impl Into<String>) {
        self.0.lock().unwrap().push(call.into());
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A transport that writes down each call and answers each with a value no default gives:
/// every provided method is overridden.
struct Probe {
    calls: Calls,
    gate: SoloGate,
}

const PROBE_CAPABILITIES: Capabilities = Capabilities {
    publisher_confirms: false,
    delivery_count: true,
    native_delays: true,
    dead_letter_exchange: false,
    declares_topology: false,
};
const PROBE_NOW: Timestamp = Timestamp::from_millis(42_000);

fn delivery(tag: u64) -> Delivery<u64> {
    let parts = MessageParts {
        queue: "orders".into(),
        body: b"order".to_vec(),
        properties: Properties {
            message_id: Some(format!("m-{tag}")),
            ..Properties::default()
        },
        ..MessageParts::default()
    };
    Delivery::new(tag, parts, BrokerSignals::default())
}

#[async_trait]
impl Transport for Probe {
    type Tag = u64;
    type Subscription = ProbeSubscription;

    fn capabilities(&self) -> Capabilities {
        self.calls.push("capabilities");
        PROBE_CAPABILITIES
    }

    async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> {
        self.calls.push("provision");
        Ok(())
    }

    async fn verify(&self, _: &TopologyPlan) -> Result<(), TransportError> {
        self.calls.push("verify");
        Err(TransportError::MissingAddress {
            address: "orders.retry.30s".into(),
            hint: "the probe's own".into(),
        })
    }

    async fn consume(&self, queue: &str, _: u16) -> Result<ProbeSubscription, TransportError> {
        self.calls.push("consume");
        assert_eq!(queue, "orders");
        Ok(ProbeSubscription {
            calls: self.calls.clone(),
        })
    }

    async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> {
        self.calls.push("fetch");
        Ok(Some(delivery(2)))
    }

    async fn ready(&self, _: &str, _: Duration) -> Result<(), TransportError> {
        self.calls.push("ready");
        Ok(())
    }

    async fn publish(&self, _: &Message, _: &Publish) -> PublishResult {
        self.calls.push("publish");
        PublishResult::Returned
    }

    async fn settle(&self, tag: &u64, settlement: Settlement) -> Result<(), TransportError> {
        self.calls.push("settle");
        assert_eq!((*tag, settlement), (2, Settlement::Reject));
        Ok(())
    }

    async fn walk<'a>(&'a self, _: &str) -> Result<Box<dyn QueueWalk<u64> + 'a>, TransportError> {
        self.calls.push("walk");
        Ok(Box::new(ProbeWalk {
            calls: self.calls.clone(),
        }))
    }

    async fn close(&self) {
        self.calls.push("close");
    }

    fn now(&self) -> Timestamp {
        self.calls.push("now");
        PROBE_NOW
    }

    fn sleep(&self, _: Duration) -> BoxFuture<'static, ()> {
        self.calls.push("sleep");
        Box::pin(std::future::ready(()))
    }

    fn solo_gate(&self) -> Option<SoloGate> {
        self.calls.push("solo_gate");
        Some(self.gate.clone())
    }
}

#[async_trait]
impl Admin for Probe {
    async fn depth(&self, _: &str) -> Result<Depth, TransportError> {
        self.calls.push("depth");
        Ok(Depth::Ready(3))
    }

    async fn apply(&self, _: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        self.calls.push("apply");
        Ok(vec![AppliedObject::new("queue orders", Applied::Created)])
    }

    async fn check(
        &self,
        _: &TopologyPlan,
        _: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        self.calls.push("check");
        Ok(CheckReport::default().with_note("checked by the probe"))
    }

    fn may_hide_headers(&self) -> bool {
        self.calls.push("may_hide_headers");
        true
    }

    fn hidden_headers(&self, _: &Message) -> Option<String> {
        self.calls.push("hidden_headers");
        Some("the probe hides them".into())
    }
}

struct ProbeSubscription {
    calls: Calls,
}

#[async_trait]
impl Subscription for ProbeSubscription {
    type Tag = u64;

    async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> {
        self.calls.push("subscription.recv");
        Ok(Some(delivery(1)))
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        self.calls.push("subscription.cancel");
        Ok(())
    }

    async fn flush(&self) -> Result<(), TransportError> {
        self.calls.push("subscription.flush");
        Ok(())
    }
}

struct ProbeWalk {
    calls: Calls,
}

#[async_trait]
impl QueueWalk<u64> for ProbeWalk {
    async fn next(&mut self) -> Result<Option<Delivery<u64>>, TransportError> {
        self.calls.push("walk.next");
        Ok(Some(delivery(3)))
    }

    fn leave(&mut self, tag: u64) {
        self.calls.push("walk.leave");
        assert_eq!(tag, 3);
    }

    async fn ack(&mut self, tag: u64) -> Result<(), TransportError> {
        self.calls.push("walk.ack");
        assert_eq!(tag, 3);
        Ok(())
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        self.calls.push("walk.end");
        Ok(())
    }
}

/// A decorator that overrides nothing.
struct Nothing;

impl<T: Transport> Decorate<T> for Nothing {
    type Mark = ();
}

fn plan() -> TopologyPlan {
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .unwrap();
    TopologyPlan::new("orders", &policy).unwrap()
}

fn publish() -> Publish {
    Publish {
        route: Route {
            exchange: "".into(),
            routing_key: "orders.retry.30s".into(),
        },
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: None,
            last_failure: None,
            last_error: None,
            reason: None,
            delay: None,
            suspect: None,
        },
    }
}

/// Calls every method of `t` (and of a subscription and a walk of it) once, in the order of
/// [`EVERY_METHOD`], checking that each answer is the probe's.
async fn call_everything<T: Admin>(t: &T, gate: &SoloGate) {
    let plan = plan();
    assert_eq!(t.capabilities(), PROBE_CAPABILITIES);
    t.provision(&plan).await.unwrap();
    let verified = t.verify(&plan).await;
    assert!(
        matches!(verified, Err(TransportError::MissingAddress { .. })),
        "{verified:?}"
    );
    let subscription = t.consume("orders", 10).await.unwrap();
    let fetched = t
        .fetch("orders")
        .await
        .unwrap()
        .expect("the probe's delivery");
    t.ready("orders", Duration::from_secs(1)).await.unwrap();
    let published = t.publish(&fetched.message, &publish()).await;
    assert!(
        matches!(published, PublishResult::Returned),
        "{published:?}"
    );
    t.settle(&fetched.tag, Settlement::Reject).await.unwrap();
    {
        let mut walk = t.walk("orders.parking").await.unwrap();
        t.close().await;
        assert_eq!(t.now(), PROBE_NOW);
        t.sleep(Duration::from_secs(3600)).await;
        assert!(t.solo_gate().expect("the probe's gate").same_as(gate));
        let received = subscription.recv().await.unwrap().expect("a delivery");
        assert_eq!(
            received.message.properties().message_id.as_deref(),
            Some("m-1")
        );
        subscription.cancel().await.unwrap();
        subscription.flush().await.unwrap();
        let walked = walk.next().await.unwrap().expect("a delivery");
        walk.leave(walked.tag.clone());
        walk.ack(walked.tag).await.unwrap();
        walk.end().await.unwrap();
    }
    assert_eq!(t.depth("orders").await.unwrap(), Depth::Ready(3));
    assert_eq!(t.apply(&plan).await.unwrap().len(), 1);
    assert_eq!(
        t.check(&plan, &PlanOptions::new())
            .await
            .unwrap()
            .notes
            .len(),
        1
    );
    assert!(t.may_hide_headers());
    assert!(t.hidden_headers(&fetched.message).is_some());
}

#[test]
fn a_decorator_that_overrides_nothing_forwards_every_method() {
    let calls = Calls::default();
    let gate = SoloGate::new();
    let probe = Probe {
        calls: calls.clone(),
        gate: gate.clone(),
    };
    // The probe answers each call itself, so a check that holds of the probe holds of it.
    block_on(call_everything(&probe, &gate));
    assert_eq!(calls.take(), EVERY_METHOD);

    let decorated = Decorated::new(probe, Nothing);
    block_on(call_everything(&decorated, &gate));
    assert_eq!(calls.take(), EVERY_METHOD);
}

#[test]
fn a_decorated_transport_forwards_every_method_behind_a_dyn_transport() {
    let calls = Calls::default();
    let gate = SoloGate::new();
    let probe = Probe {
        calls: calls.clone(),
        gate: gate.clone(),
    };
    let erased = DynTransport::with_admin(Decorated::new(probe, Nothing));
    block_on(call_everything(&erased, &gate));
    assert_eq!(calls.take(), EVERY_METHOD);
}

/// Notes each delivery's message id, and writes down what comes back with it.
#[derive(Default)]
struct Ids(Mutex<Vec<String>>);

impl Ids {
    fn note(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
}

impl<T: Transport> Decorate<T> for Ids {
    type Mark = String;

    fn delivered(&self, queue: &str, delivery: &Delivery<T::Tag>) -> String {
        let id = delivery.message.properties().message_id.clone().unwrap();
        self.note(format!("delivered {id} from {queue}"));
        id
    }

    async fn settle(
        &self,
        inner: &T,
        tag: &T::Tag,
        id: &String,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        self.note(format!("settle {id}"));
        inner.settle(tag, settlement).await
    }

    fn walk_leave(
        &self,
        _: &str,
        walk: &mut (dyn QueueWalk<T::Tag> + '_),
        tag: T::Tag,
        id: String,
    ) {
        self.note(format!("leave {id}"));
        walk.leave(tag);
    }

    async fn walk_ack(
        &self,
        _: &str,
        walk: &mut (dyn QueueWalk<T::Tag> + '_),
        tag: T::Tag,
        id: String,
    ) -> Result<(), TransportError> {
        self.note(format!("walk ack {id}"));
        walk.ack(tag).await
    }
}

#[test]
fn every_delivery_is_marked_once_and_its_mark_comes_back_when_it_is_settled() {
    let calls = Calls::default();
    let t = Decorated::new(
        Probe {
            calls: calls.clone(),
            gate: SoloGate::new(),
        },
        Ids::default(),
    );
    block_on(async {
        let subscription = t.consume("orders", 10).await.unwrap();
        let received = subscription.recv().await.unwrap().unwrap();
        assert_eq!(received.tag.mark(), "m-1");
        assert_eq!(*received.tag.tag(), 1);
        let fetched = t.fetch("orders.suspect").await.unwrap().unwrap();
        t.settle(&fetched.tag, Settlement::Reject).await.unwrap();
        let mut walk = t.walk("orders.parking").await.unwrap();
        let walked = walk.next().await.unwrap().unwrap();
        walk.leave(walked.tag.clone());
        walk.ack(walked.tag).await.unwrap();
    });
    assert_eq!(
        *t.decorator().0.lock().unwrap(),
        [
            "delivered m-1 from orders",
            "delivered m-2 from orders.suspect",
            "settle m-2",
            "delivered m-3 from orders.parking",
            "leave m-3",
            "walk ack m-3",
        ]
    );
}
