//! The broker model against the RabbitMQ 3.10 behaviour the retry engine relies on.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::FutureExt;
use retry_core::headers::EngineHeaders;
use retry_core::{
    Confirm, DeliveryFacts, ExchangeKind, HeaderValue, Headers, Publish, PublishResult, QueueType,
    RetryPolicy, Route, Settlement, Subscription, Timestamp, TopologyPlan, Transport,
    TransportError,
};
use transport_memory::{
    Broker, BrokerError, DeathReason, DeliveryTag, EventKind, MemorySubscription, MemoryTransport,
    Outgoing, QueueOptions, QueueOverflow,
};

const S: Duration = Duration::from_secs(1);

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn since_start(broker: &Broker) -> Duration {
    broker
        .now()
        .saturating_duration_since(transport_memory::DEFAULT_START)
}

/// A work queue that dead-letters to `parking`, and a delay queue that expires back to work.
fn work_and_delay(broker: &Broker, delay_ttl: Option<Duration>) {
    broker
        .declare_queue(
            "work",
            QueueOptions::new()
                .with_dead_letter_exchange("")
                .with_dead_letter_routing_key("delay"),
        )
        .unwrap();
    let mut delay = QueueOptions::new()
        .with_dead_letter_exchange("")
        .with_dead_letter_routing_key("work");
    if let Some(ttl) = delay_ttl {
        delay = delay.with_message_ttl(ttl);
    }
    broker.declare_queue("delay", delay).unwrap();
}

/// `broker` with a plain queue "work" holding one message per body, in order.
fn fill_work(broker: &Broker, bodies: impl IntoIterator<Item = Vec<u8>>) {
    broker.declare_queue("work", QueueOptions::new()).unwrap();
    for body in bodies {
        broker.publish(Outgoing::to_queue("work", body)).unwrap();
    }
}

/// A connection with one subscription, driven by hand.
struct Client {
    conn: MemoryTransport,
    sub: MemorySubscription,
}

type Received = Result<Option<retry_core::Delivery<DeliveryTag>>, TransportError>;

impl Client {
    fn try_recv(&self) -> Received {
        self.sub.try_recv()
    }

    async fn recv(&self) -> Received {
        self.sub.recv().await
    }

    fn settle_now(&self, tag: &DeliveryTag, settlement: Settlement) -> Result<(), BrokerError> {
        self.conn.settle_now(tag, settlement)
    }

    fn connection_id(&self) -> u64 {
        self.conn.connection_id()
    }

    fn is_open(&self) -> bool {
        self.conn.is_open()
    }

    fn without_recovery(self) -> Self {
        Client {
            conn: self.conn.without_recovery(),
            sub: self.sub,
        }
    }
}

fn consumer(broker: &Broker, queue: &str, prefetch: u16) -> Client {
    let conn = broker.connect();
    let sub = conn
        .consume(queue, prefetch)
        .now_or_never()
        .expect("consume completes at once")
        .unwrap();
    Client { conn, sub }
}

fn drain(conn: &Client) -> Vec<retry_core::Delivery<DeliveryTag>> {
    std::iter::from_fn(|| conn.try_recv().unwrap()).collect()
}

fn bodies(broker: &Broker, queue: &str) -> Vec<Vec<u8>> {
    broker
        .messages(queue)
        .unwrap()
        .into_iter()
        .map(|m| m.body)
        .collect()
}

fn x_death(headers: &Headers) -> Vec<Headers> {
    match headers.get("x-death") {
        Some(HeaderValue::Array(entries)) => entries
            .iter()
            .map(|e| match e {
                HeaderValue::Table(t) => t.clone(),
                other => panic!("x-death entry is not a table: {other:?}"),
            })
            .collect(),
        other => panic!("x-death is not an array: {other:?}"),
    }
}

fn text<'a>(t: &'a Headers, name: &str) -> &'a str {
    match t.get(name) {
        Some(HeaderValue::Str(s)) => s,
        other => panic!("{name} is not a string: {other:?}"),
    }
}

#[test]
fn queue_ttl_expires_at_the_exact_virtual_time_and_dead_letters() {
    let broker = Broker::new();
    work_and_delay(&broker, Some(secs(30)));
    broker
        .publish(Outgoing::to_queue("delay", b"m".to_vec()))
        .unwrap();
    assert_eq!(broker.next_deadline(), Some(broker.now() + secs(30)));

    broker.advance(Duration::from_millis(29_999));
    assert_eq!(bodies(&broker, "delay"), [b"m".to_vec()]);
    assert_eq!(broker.ready("work"), Some(0));

    broker.advance(Duration::from_millis(1));
    assert_eq!(broker.ready("delay"), Some(0));
    let back = broker.messages("work").unwrap();
    assert_eq!(back.len(), 1);
    // Dead-lettered through the default exchange with the dead-letter routing key.
    assert_eq!(back[0].exchange, "");
    assert_eq!(back[0].routing_key, "work");
    let deaths = x_death(&back[0].headers);
    assert_eq!(deaths.len(), 1);
    assert_eq!(text(&deaths[0], "reason"), "expired");
    assert_eq!(text(&deaths[0], "queue"), "delay");
    assert_eq!(deaths[0].get("count"), Some(&HeaderValue::Int(1)));
}

#[test]
fn the_lower_of_queue_ttl_and_per_message_expiration_wins() {
    let broker = Broker::new();
    work_and_delay(&broker, Some(secs(60)));
    broker
        .publish(Outgoing::to_queue("delay", b"short".to_vec()).with_expiration(secs(10)))
        .unwrap();
    broker.advance(secs(10));
    assert_eq!(bodies(&broker, "work"), [b"short".to_vec()]);
    let deaths = x_death(&broker.messages("work").unwrap()[0].headers);
    // The expiration property is removed on dead-lettering and kept in x-death.
    assert_eq!(text(&deaths[0], "original-expiration"), "10000");
    assert_eq!(broker.messages("work").unwrap()[0].expiration, None);

    broker
        .publish(Outgoing::to_queue("delay", b"long".to_vec()).with_expiration(secs(120)))
        .unwrap();
    broker.advance(secs(59));
    assert_eq!(broker.ready("delay"), Some(1));
    broker.advance(S);
    assert_eq!(
        broker.ready("delay"),
        Some(0),
        "queue TTL caps a longer expiration"
    );
}

#[test]
fn only_the_head_expires_so_a_long_ttl_blocks_shorter_ones_behind_it() {
    let broker = Broker::new();
    work_and_delay(&broker, None);
    broker
        .publish(Outgoing::to_queue("delay", b"1h".to_vec()).with_expiration(secs(3600)))
        .unwrap();
    broker
        .publish(Outgoing::to_queue("delay", b"10s".to_vec()).with_expiration(secs(10)))
        .unwrap();

    broker.advance(secs(10));
    assert_eq!(
        broker.ready("work"),
        Some(0),
        "the 10 s message is overdue but not at the head"
    );
    broker.advance(secs(3590));
    assert_eq!(
        bodies(&broker, "work"),
        [b"1h".to_vec(), b"10s".to_vec()],
        "both leave when the head does, in queue order"
    );

    // The same message on its own queue leaves on time: why the engine uses one queue per
    // delay.
    let broker = Broker::new();
    work_and_delay(&broker, None);
    broker
        .publish(Outgoing::to_queue("delay", b"10s".to_vec()).with_expiration(secs(10)))
        .unwrap();
    broker.advance(secs(10));
    assert_eq!(bodies(&broker, "work"), [b"10s".to_vec()]);
}

#[test]
fn x_death_has_one_entry_per_queue_and_reason_and_the_latest_moves_to_the_front() {
    let broker = Broker::new();
    work_and_delay(&broker, Some(secs(5)));
    broker
        .publish(Outgoing::to_queue("work", b"m".to_vec()).with_message_id("m"))
        .unwrap();
    let conn = consumer(&broker, "work", 1);

    for round in 1..=2i64 {
        let d = conn.try_recv().unwrap().expect("delivered");
        conn.settle_now(&d.tag, Settlement::Reject).unwrap();
        let in_delay = broker.messages("delay").unwrap();
        let deaths = x_death(&in_delay[0].headers);
        assert_eq!(text(&deaths[0], "queue"), "work");
        assert_eq!(text(&deaths[0], "reason"), "rejected");
        assert_eq!(deaths[0].get("count"), Some(&HeaderValue::Int(round)));
        broker.advance(secs(5));
    }
    let d = conn
        .try_recv()
        .unwrap()
        .expect("back after the second delay");
    let deaths = x_death(d.message.headers());
    assert_eq!(deaths.len(), 2);
    assert_eq!(text(&deaths[0], "queue"), "delay");
    assert_eq!(text(&deaths[0], "reason"), "expired");
    assert_eq!(deaths[0].get("count"), Some(&HeaderValue::Int(2)));
    assert_eq!(text(&deaths[1], "queue"), "work");
    assert_eq!(deaths[1].get("count"), Some(&HeaderValue::Int(2)));

    // The full shape of an entry.
    let e = &deaths[0];
    let mut fields: Vec<&str> = e.iter().map(|(k, _)| k).collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "count",
            "exchange",
            "queue",
            "reason",
            "routing-keys",
            "time"
        ]
    );
    assert_eq!(
        text(e, "exchange"),
        "",
        "the delay copy came from the default exchange"
    );
    assert_eq!(
        e.get("routing-keys"),
        Some(&HeaderValue::Array(vec![HeaderValue::Str("delay".into())]))
    );
    // The first expiry happened 5 s in; the entry keeps the first death's time, in whole
    // seconds.
    let first_expiry = transport_memory::DEFAULT_START.as_millis() + 5_000;
    assert_eq!(
        e.get("time"),
        Some(&HeaderValue::Timestamp(Timestamp::from_millis(
            first_expiry
        )))
    );
    assert_eq!(
        d.message.headers().get("x-first-death-reason"),
        Some(&"rejected".into())
    );
    assert_eq!(
        d.message.headers().get("x-first-death-queue"),
        Some(&"work".into())
    );
    // The engine reads the sum of the counts.
    assert_eq!(d.facts.deaths, 4);
}

#[test]
fn automatic_dead_letter_cycles_are_dropped_but_rejections_break_them() {
    let broker = Broker::new();
    for (name, next) in [("a", "b"), ("b", "a")] {
        broker
            .declare_queue(
                name,
                QueueOptions::new()
                    .with_message_ttl(S)
                    .with_dead_letter_exchange("")
                    .with_dead_letter_routing_key(next),
            )
            .unwrap();
    }
    broker
        .publish(Outgoing::to_queue("a", b"loop".to_vec()))
        .unwrap();
    broker.advance(S);
    assert_eq!(broker.ready("b"), Some(1));
    broker.advance(S);
    assert_eq!((broker.ready("a"), broker.ready("b")), (Some(0), Some(0)));
    assert_eq!(broker.next_deadline(), None, "nothing left to expire");
    let dead_letters: Vec<_> = broker
        .trace()
        .events()
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::DeadLettered { queue, routed, .. } => {
                Some((queue.to_string(), routed.len()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        dead_letters,
        [("a".to_owned(), 1), ("b".to_owned(), 0)],
        "the hop back into 'a' closes a cycle and is dropped"
    );
}

#[test]
fn prefetch_limits_unacknowledged_deliveries() {
    let broker = Broker::new();
    fill_work(&broker, (0..5u8).map(|i| vec![i]));
    let conn = consumer(&broker, "work", 2);
    let first = drain(&conn);
    assert_eq!(first.len(), 2);
    assert_eq!(
        broker.stats("work").map(|s| (s.ready, s.unacked)),
        Some((3, 2))
    );

    conn.settle_now(&first[0].tag, Settlement::Ack).unwrap();
    let next = drain(&conn);
    assert_eq!(next.len(), 1, "one ack makes room for one more");
    assert_eq!(next[0].message.body(), [2]);
}

#[test]
fn deliveries_held_by_a_closed_connection_come_back_redelivered_in_order() {
    let broker = Broker::new();
    fill_work(&broker, (0..4u8).map(|i| vec![i]));
    let crashing = consumer(&broker, "work", 3);
    let held = drain(&crashing);
    assert_eq!(held.len(), 3);
    assert!(held.iter().all(|d| !d.facts.redelivered));
    assert!(broker.close_connection(crashing.connection_id(), "consumer crashed"));

    let next = consumer(&broker, "work", 10);
    let again = drain(&next);
    let seen: Vec<(u8, bool)> = again
        .iter()
        .map(|d| (d.message.body()[0], d.facts.redelivered))
        .collect();
    assert_eq!(
        seen,
        [(0, true), (1, true), (2, true), (3, false)],
        "returned messages go back to their places, ahead of the never-delivered one"
    );
    assert_eq!(again[0].facts.crash_evidence(), 1);
}

#[test]
fn requeue_by_the_consumer_sets_redelivered_and_dropping_the_transport_returns_deliveries() {
    let broker = Broker::new();
    fill_work(&broker, [b"m".to_vec()]);
    let conn = consumer(&broker, "work", 1);
    let d = conn.try_recv().unwrap().unwrap();
    conn.settle_now(&d.tag, Settlement::Requeue).unwrap();
    let d = conn.try_recv().unwrap().expect("redelivered at once");
    assert!(d.facts.redelivered);

    drop(conn);
    assert_eq!(
        broker.stats("work").map(|s| (s.ready, s.unacked)),
        Some((1, 0))
    );
    assert!(broker.messages("work").unwrap()[0].redelivered);
}

#[test]
fn a_full_reject_publish_queue_nacks_and_drop_head_dead_letters_with_maxlen() {
    let broker = Broker::new();
    broker
        .declare_queue(
            "bounded",
            QueueOptions::new()
                .with_max_length(1)
                .with_overflow(QueueOverflow::RejectPublish),
        )
        .unwrap();
    assert_eq!(
        broker.publish(Outgoing::to_queue("bounded", b"1".to_vec())),
        Ok(Confirm::Ack)
    );
    assert_eq!(
        broker.publish(Outgoing::to_queue("bounded", b"2".to_vec())),
        Ok(Confirm::Nack)
    );
    let conn = broker.connect();
    assert!(matches!(
        conn.publish_message(Outgoing::to_queue("bounded", b"3".to_vec())),
        PublishResult::Refused
    ));
    assert_eq!(bodies(&broker, "bounded"), [b"1".to_vec()]);

    // A quorum queue refuses only once it is over the limit: at 0 it takes one message.
    broker
        .declare_queue(
            "bounded-quorum",
            QueueOptions::new()
                .with_queue_type(QueueType::Quorum)
                .with_max_length(0)
                .with_overflow(QueueOverflow::RejectPublish),
        )
        .unwrap();
    let confirms: Vec<_> = (0..4)
        .map(|i| broker.publish(Outgoing::to_queue("bounded-quorum", vec![i])))
        .collect();
    assert_eq!(broker.ready("bounded-quorum"), Some(1));
    assert_eq!(
        confirms,
        [Confirm::Ack, Confirm::Nack, Confirm::Nack, Confirm::Nack].map(Ok)
    );

    broker
        .declare_queue("overflow", QueueOptions::new())
        .unwrap();
    broker
        .declare_queue(
            "oldest-out",
            QueueOptions::new()
                .with_max_length(2)
                .with_dead_letter_exchange("")
                .with_dead_letter_routing_key("overflow"),
        )
        .unwrap();
    for b in [b"a", b"b", b"c"] {
        assert_eq!(
            broker.publish(Outgoing::to_queue("oldest-out", b.to_vec())),
            Ok(Confirm::Ack)
        );
    }
    assert_eq!(
        bodies(&broker, "oldest-out"),
        [b"b".to_vec(), b"c".to_vec()]
    );
    let dropped = broker.messages("overflow").unwrap();
    assert_eq!(dropped[0].body, b"a");
    assert_eq!(text(&x_death(&dropped[0].headers)[0], "reason"), "maxlen");
}

#[test]
fn unroutable_mandatory_publishes_are_returned_and_others_dropped() {
    let broker = Broker::new();
    broker
        .declare_exchange("events", ExchangeKind::Direct)
        .unwrap();
    let conn = broker.connect();
    assert!(matches!(
        conn.publish_message(Outgoing::new("events", "nobody", b"m".to_vec()).with_mandatory(true)),
        PublishResult::Returned
    ));
    assert!(matches!(
        conn.publish_message(Outgoing::new("events", "nobody", b"m".to_vec())),
        PublishResult::Confirmed
    ));
    // A missing exchange is a channel error: the publish fails and the channel closes.
    assert!(matches!(
        conn.publish_message(Outgoing::new("missing", "k", b"m".to_vec())),
        PublishResult::Failed(TransportError::MissingAddress { .. })
    ));
    assert!(!conn.is_open());
}

#[test]
fn the_engine_clone_publish_is_mandatory_and_keeps_the_message_identity() {
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new("comments", &policy).unwrap();
    let broker = Broker::new();
    broker.provision(&plan).unwrap();
    broker
        .publish(
            Outgoing::to_queue("comments", b"c".to_vec())
                .with_message_id("c-1")
                .with_header("tenant", "acme"),
        )
        .unwrap();
    let conn = consumer(&broker, "comments", 1);
    let d = conn.try_recv().unwrap().unwrap();
    let engine_headers = EngineHeaders {
        attempts: 1,
        crashes: 0,
        first_failure: Some(broker.now()),
        last_failure: Some(broker.now()),
        last_error: Some("boom".into()),
        reason: None,
        delay: Some(secs(30)),
        suspect: None,
    };
    let (route, _) = plan.route_for(secs(30)).unwrap();
    let publish = Publish {
        route: route.clone(),
        expiration: None,
        headers: engine_headers.clone(),
    };
    let result = conn
        .conn
        .publish(&d.message, &publish)
        .now_or_never()
        .unwrap();
    assert!(matches!(result, PublishResult::Confirmed));
    let clone = &broker.messages("comments.retry.30s").unwrap()[0];
    assert_eq!(clone.label.as_ref(), "c-1");
    assert_eq!(clone.headers.get("tenant"), Some(&"acme".into()));
    assert_eq!(
        clone.headers.get("x-retry-attempts"),
        Some(&HeaderValue::Int(1))
    );
    assert_eq!(
        clone.headers.get("x-retry-origin-queue"),
        Some(&"comments".into())
    );
    let original_key = broker
        .trace()
        .events()
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::Delivered { message, .. } => Some(message.key),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        clone.key, original_key,
        "the clone is followed as the same message"
    );

    let unroutable = Publish {
        route: Route {
            exchange: route.exchange.clone(),
            routing_key: "comments.retry.nowhere".into(),
        },
        expiration: None,
        headers: engine_headers,
    };
    let result = conn
        .conn
        .publish(&d.message, &unroutable)
        .now_or_never()
        .unwrap();
    assert!(matches!(result, PublishResult::Returned));
}

/// A clone publish as the engine makes one: attempt 1 failed, retry in 30 s.
fn retry_in_30s(plan: &TopologyPlan, now: Timestamp) -> Publish {
    let (route, _) = plan.route_for(secs(30)).unwrap();
    Publish {
        route: route.clone(),
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: Some(now),
            last_failure: Some(now),
            last_error: Some("boom".into()),
            reason: None,
            delay: Some(secs(30)),
            suspect: None,
        },
    }
}

#[test]
fn clones_of_deliveries_with_equal_content_keep_each_its_own_identity() {
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new("comments", &policy).unwrap();
    let broker = Broker::new();
    broker.provision(&plan).unwrap();
    for _ in 0..2 {
        broker
            .publish(Outgoing::to_queue("comments", b"same".to_vec()))
            .unwrap();
    }
    let conn = consumer(&broker, "comments", 2);
    let [first, second]: [_; 2] = drain(&conn).try_into().unwrap();
    assert_eq!(first.message.parts(), second.message.parts());
    let publish = retry_in_30s(&plan, broker.now());
    let clone_of = |d: &retry_core::Delivery<DeliveryTag>| {
        let result = conn.conn.publish(&d.message, &publish).now_or_never();
        assert!(matches!(result, Some(PublishResult::Confirmed)));
    };
    clone_of(&second);
    clone_of(&first);
    // Once settled, a delivery is no longer followed: a clone of it is a new message.
    conn.settle_now(&first.tag, Settlement::Ack).unwrap();
    clone_of(&first);
    let clones: Vec<(u64, String)> = broker
        .messages("comments.retry.30s")
        .unwrap()
        .into_iter()
        .map(|m| (m.key.get(), m.label.to_string()))
        .collect();
    assert_eq!(
        clones,
        [(2, "#2".into()), (1, "#1".into()), (3, "#3".into())],
        "each clone is the message it was made from"
    );
}

#[test]
fn a_delivery_settled_before_it_is_received_keeps_its_content() {
    let broker = Broker::new();
    broker
        .declare_queue("parking", QueueOptions::new())
        .unwrap();
    broker
        .declare_queue(
            "work",
            QueueOptions::new()
                .with_dead_letter_exchange("")
                .with_dead_letter_routing_key("parking"),
        )
        .unwrap();
    broker
        .publish(Outgoing::to_queue("work", b"early".to_vec()).with_header("tenant", "acme"))
        .unwrap();
    let conn = consumer(&broker, "work", 1);
    // Pushed to the consumer, not yet received: its tag is the connection's first.
    let tag = DeliveryTag {
        connection: conn.connection_id(),
        tag: 1,
    };
    conn.settle_now(&tag, Settlement::Reject).unwrap();
    let parked = broker.messages("parking").unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].body, b"early");
    assert_eq!(parked[0].headers.get("tenant"), Some(&"acme".into()));
    // The client still hands it out, as a client library that had it buffered does.
    let d = conn.try_recv().unwrap().expect("still buffered");
    assert_eq!(d.message.body(), b"early");
}

#[test]
fn deliveries_not_yet_received_come_back_with_their_content_when_the_connection_closes() {
    let broker = Broker::new();
    fill_work(&broker, (0..3u8).map(|i| vec![i]));
    let crashing = consumer(&broker, "work", 3);
    let received = crashing.try_recv().unwrap().expect("a delivery");
    assert_eq!(received.message.body(), [0]);
    assert!(broker.close_connection(crashing.connection_id(), "consumer crashed"));
    assert_eq!(bodies(&broker, "work"), [vec![0], vec![1], vec![2]]);
    assert!(
        broker
            .messages("work")
            .unwrap()
            .iter()
            .all(|m| m.redelivered)
    );
}

#[test]
fn quorum_queues_count_deliveries_and_dead_letter_past_the_limit() {
    let broker = Broker::new();
    broker
        .declare_queue("parking", QueueOptions::new())
        .unwrap();
    broker
        .declare_queue(
            "work",
            QueueOptions::new()
                .with_queue_type(QueueType::Quorum)
                .with_delivery_limit(2)
                .with_dead_letter_exchange("")
                .with_dead_letter_routing_key("parking"),
        )
        .unwrap();
    broker
        .publish(Outgoing::to_queue("work", b"m".to_vec()))
        .unwrap();
    let conn = consumer(&broker, "work", 1);

    let mut counts = Vec::new();
    while let Some(d) = conn.try_recv().unwrap() {
        counts.push((
            d.message.headers().get("x-delivery-count").cloned(),
            d.facts.redelivered,
            d.facts.x_delivery_count,
        ));
        conn.settle_now(&d.tag, Settlement::Requeue).unwrap();
    }
    assert_eq!(
        counts,
        [
            (None, false, 0),
            (Some(HeaderValue::Int(1)), true, 1),
            (Some(HeaderValue::Int(2)), true, 2),
        ],
        "absent on the first delivery, then counting returns; limit 2 allows 3 deliveries"
    );
    let parked = broker.messages("parking").unwrap();
    assert_eq!(parked.len(), 1);
    let deaths = x_death(&parked[0].headers);
    assert_eq!(text(&deaths[0], "reason"), "delivery_limit");

    // A get from a quorum queue carries the count from the first delivery on, 0 included.
    broker
        .declare_queue(
            "got",
            QueueOptions::new().with_queue_type(QueueType::Quorum),
        )
        .unwrap();
    broker
        .publish(Outgoing::to_queue("got", b"g".to_vec()))
        .unwrap();
    let got = broker
        .connect()
        .fetch("got")
        .now_or_never()
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        got.message.headers().get("x-delivery-count"),
        Some(&HeaderValue::Int(0))
    );
    assert_eq!(text(&deaths[0], "queue"), "work");
}

#[test]
fn a_crash_counts_as_a_quorum_delivery_and_classic_queues_ignore_the_limit() {
    let broker = Broker::new();
    broker
        .declare_queue(
            "q",
            QueueOptions::new()
                .with_queue_type(QueueType::Quorum)
                .with_delivery_limit(0),
        )
        .unwrap();
    broker
        .declare_queue("c", QueueOptions::new().with_delivery_limit(0))
        .unwrap();
    for q in ["q", "c"] {
        broker
            .publish(Outgoing::to_queue(q, b"m".to_vec()))
            .unwrap();
        let conn = consumer(&broker, q, 1);
        assert!(conn.try_recv().unwrap().is_some());
        drop(conn);
    }
    assert_eq!(
        broker.ready("q"),
        Some(0),
        "past the limit, with no DLX: discarded"
    );
    assert_eq!(broker.ready("c"), Some(1));
}

#[test]
fn exchanges_route_direct_fanout_topic_and_default() {
    let broker = Broker::new();
    for q in ["eu", "us", "all", "created"] {
        broker.declare_queue(q, QueueOptions::new()).unwrap();
    }
    broker.declare_exchange("d", ExchangeKind::Direct).unwrap();
    broker.declare_exchange("f", ExchangeKind::Fanout).unwrap();
    broker.declare_exchange("t", ExchangeKind::Topic).unwrap();
    broker.bind("d", "eu", "eu").unwrap();
    broker.bind("d", "us", "us").unwrap();
    broker.bind("f", "all", "ignored").unwrap();
    broker.bind("f", "eu", "").unwrap();
    broker.bind("t", "created", "orders.*.created").unwrap();
    broker.bind("t", "all", "orders.#").unwrap();

    broker
        .publish(Outgoing::new("d", "eu", b"1".to_vec()))
        .unwrap();
    broker
        .publish(Outgoing::new("f", "x", b"2".to_vec()))
        .unwrap();
    broker
        .publish(Outgoing::new("t", "orders.eu.created", b"3".to_vec()))
        .unwrap();
    broker
        .publish(Outgoing::new("t", "orders.eu.paid.late", b"4".to_vec()))
        .unwrap();
    broker
        .publish(Outgoing::to_queue("us", b"5".to_vec()))
        .unwrap();

    assert_eq!(bodies(&broker, "eu"), [b"1".to_vec(), b"2".to_vec()]);
    assert_eq!(bodies(&broker, "us"), [b"5".to_vec()]);
    assert_eq!(
        bodies(&broker, "all"),
        [b"2".to_vec(), b"3".to_vec(), b"4".to_vec()]
    );
    assert_eq!(bodies(&broker, "created"), [b"3".to_vec()]);
    assert!(
        broker.bind("", "eu", "eu").is_err(),
        "the default exchange takes no bindings"
    );
    assert!(
        broker
            .declare_exchange("amq.mine", ExchangeKind::Direct)
            .is_err()
    );
}

#[test]
fn redeclaring_with_other_arguments_is_a_named_conflict() {
    let broker = Broker::new();
    broker
        .declare_queue("q", QueueOptions::new().with_message_ttl(secs(30)))
        .unwrap();
    broker
        .declare_queue("q", QueueOptions::new().with_message_ttl(secs(30)))
        .unwrap();
    let err = broker
        .declare_queue("q", QueueOptions::new().with_message_ttl(secs(60)))
        .unwrap_err();
    let TransportError::TopologyConflict {
        object,
        argument,
        existing,
        wanted,
    } = TransportError::from(err)
    else {
        panic!("not a topology conflict")
    };
    assert_eq!(
        (
            object.as_str(),
            argument.as_str(),
            existing.as_str(),
            wanted.as_str()
        ),
        ("queue 'q'", "x-message-ttl", "30000", "60000")
    );
}

#[test]
fn a_delivery_held_past_the_consumer_timeout_closes_the_channel() {
    let broker = Broker::builder()
        .with_consumer_timeout(Some(Duration::from_secs(60)))
        .build();
    fill_work(&broker, [b"m".to_vec()]);
    let conn = consumer(&broker, "work", 1).without_recovery();
    let _held = conn.try_recv().unwrap().unwrap();
    broker.advance(secs(59));
    assert!(conn.is_open());
    broker.advance(S);
    assert!(!conn.is_open());
    assert_eq!(since_start(&broker), secs(60));
    assert!(broker.messages("work").unwrap()[0].redelivered);
}

#[test]
fn a_recovering_transport_reports_the_close_then_reconnects() {
    let broker = Broker::new();
    fill_work(&broker, [b"m".to_vec()]);
    let conn = consumer(&broker, "work", 1);
    let stale = conn.try_recv().unwrap().unwrap();
    let first = conn.connection_id();
    broker.close_connection(first, "network blip");

    let err = conn.recv().now_or_never().unwrap().unwrap_err();
    assert!(matches!(err, TransportError::Connection { .. }));
    let d = conn
        .recv()
        .now_or_never()
        .expect("recovered and delivered at once")
        .unwrap()
        .unwrap();
    assert_ne!(conn.connection_id(), first);
    assert!(d.facts.redelivered);
    assert!(
        conn.conn
            .settle(&stale.tag, Settlement::Ack)
            .now_or_never()
            .unwrap()
            .is_err(),
        "a tag from the closed connection settles nothing"
    );
    conn.conn
        .settle(&d.tag, Settlement::Ack)
        .now_or_never()
        .unwrap()
        .unwrap();
    assert_eq!(
        broker.stats("work").map(|s| (s.ready, s.unacked)),
        Some((0, 0))
    );
}

#[test]
fn settling_an_unknown_tag_closes_the_channel() {
    let broker = Broker::new();
    fill_work(&broker, [b"m".to_vec()]);
    let conn = consumer(&broker, "work", 1);
    let d = conn.try_recv().unwrap().unwrap();
    conn.settle_now(&d.tag, Settlement::Ack).unwrap();
    assert!(
        conn.settle_now(&d.tag, Settlement::Ack).is_err(),
        "double ack"
    );
    assert!(!conn.is_open());
}

#[test]
fn injected_publish_faults_apply_to_connections_in_order() {
    let broker = Broker::new();
    broker.declare_queue("q", QueueOptions::new()).unwrap();
    let conn = broker.connect();
    broker.lose_publishes(1);
    broker.refuse_publishes(1);
    broker.lose_confirms(1);
    let results: Vec<&str> = (0..4)
        .map(
            |i| match conn.publish_message(Outgoing::to_queue("q", vec![i])) {
                PublishResult::Confirmed => "confirmed",
                PublishResult::Refused => "refused",
                PublishResult::Returned => "returned",
                PublishResult::Failed(_) => "failed",
            },
        )
        .collect();
    assert_eq!(results, ["failed", "refused", "failed", "confirmed"]);
    assert_eq!(
        bodies(&broker, "q"),
        [vec![2], vec![3]],
        "the lost publish never arrived; the one whose confirm was lost did"
    );
    // The producer's own publishes are never faulted.
    broker.refuse_publishes(1);
    assert_eq!(
        broker.publish(Outgoing::to_queue("q", vec![9])),
        Ok(Confirm::Ack)
    );
}

#[test]
fn a_duplicated_delivery_arrives_twice() {
    let broker = Broker::new();
    broker.declare_queue("q", QueueOptions::new()).unwrap();
    broker
        .publish(Outgoing::to_queue("q", b"m".to_vec()).with_message_id("m"))
        .unwrap();
    broker.duplicate_deliveries(1);
    let conn = consumer(&broker, "q", 10);
    let got = drain(&conn);
    assert_eq!(got.len(), 2);
    assert!(
        got.iter()
            .all(|d| d.message.properties().message_id.as_deref() == Some("m"))
    );
    assert!(got.iter().all(|d| !d.facts.redelivered));
}

#[test]
fn sleeps_end_at_exact_virtual_times() {
    let broker = Broker::new();
    let start = broker.now();
    let mut a = Box::pin(broker.sleep(secs(5)));
    let mut b = Box::pin(broker.sleep(secs(3)));
    assert!(a.as_mut().now_or_never().is_none());
    assert!(b.as_mut().now_or_never().is_none());
    assert_eq!(broker.step(), Some(start + secs(3)));
    assert!(b.now_or_never().is_some());
    assert!(a.as_mut().now_or_never().is_none());
    assert_eq!(broker.step(), Some(start + secs(5)));
    assert!(a.now_or_never().is_some());
    assert_eq!(broker.step(), None);
}

#[test]
fn a_zero_ttl_message_goes_to_a_waiting_consumer_or_expires() {
    let broker = Broker::new();
    work_and_delay(&broker, Some(Duration::ZERO));
    broker
        .publish(Outgoing::to_queue("delay", b"now".to_vec()))
        .unwrap();
    assert_eq!(
        broker.ready("work"),
        Some(1),
        "no consumer: expired on arrival"
    );
    let conn = consumer(&broker, "delay", 1);
    broker
        .publish(Outgoing::to_queue("delay", b"taken".to_vec()))
        .unwrap();
    assert_eq!(conn.try_recv().unwrap().unwrap().message.body(), b"taken");
}

#[test]
fn dead_letters_reach_the_parking_queue_of_a_plan_with_reasons() {
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::builder("comments", &policy)
        .with_queue_type(QueueType::Quorum)
        .with_delivery_limit(1)
        .build()
        .unwrap();
    let broker = Broker::new();
    broker.provision(&plan).unwrap();
    broker
        .publish(Outgoing::to_queue("comments", b"poison".to_vec()))
        .unwrap();
    for _ in 0..2 {
        let conn = consumer(&broker, "comments", 1);
        assert!(conn.try_recv().unwrap().is_some());
        drop(conn);
    }
    let parked = broker.messages(plan.parking_queue()).unwrap();
    assert_eq!(
        parked.len(),
        1,
        "the plan's dead-letter exchange routes to parking"
    );
    assert_eq!(
        text(&x_death(&parked[0].headers)[0], "reason"),
        DeathReason::DeliveryLimit.as_str()
    );
    let facts = DeliveryFacts::decode(&parked[0].headers, Default::default(), 0);
    assert_eq!(facts.deaths, 1);
}

#[test]
fn two_subscriptions_on_one_connection_have_their_own_prefetch_and_stream() {
    let broker = Broker::new();
    fill_work(&broker, (0..4u8).map(|i| vec![i]));
    let conn = broker.connect();
    let consume = |prefetch| {
        conn.consume("work", prefetch)
            .now_or_never()
            .unwrap()
            .unwrap()
    };
    let (one, two) = (consume(1), consume(2));
    let a = one.try_recv().unwrap().expect("one delivery for the first");
    assert!(one.try_recv().unwrap().is_none(), "its prefetch is 1");
    let b: Vec<_> = std::iter::from_fn(|| two.try_recv().unwrap()).collect();
    assert_eq!(b.len(), 2, "the second has its own prefetch of 2");
    assert_eq!(
        broker.stats("work").map(|s| (s.ready, s.unacked)),
        Some((1, 3))
    );

    // Cancelling one ends its stream and leaves the other consuming.
    one.cancel().now_or_never().unwrap().unwrap();
    assert!(one.recv().now_or_never().unwrap().unwrap().is_none());
    conn.settle_now(&a.tag, Settlement::Ack).unwrap();
    assert!(
        one.try_recv().unwrap().is_none(),
        "nothing more for the cancelled one"
    );
    for d in b {
        conn.settle_now(&d.tag, Settlement::Ack).unwrap();
    }
    assert!(
        two.try_recv().unwrap().is_some(),
        "the last message goes to the other"
    );
}

#[test]
fn fetch_takes_one_message_which_returns_redelivered_if_its_connection_closes() {
    let broker = Broker::new();
    fill_work(&broker, [b"first".to_vec(), b"second".to_vec()]);
    let conn = broker.connect();
    let got = conn.fetch("work").now_or_never().unwrap().unwrap().unwrap();
    assert_eq!(got.message.body(), b"first");
    assert!(!got.facts.redelivered);
    assert_eq!(
        broker.stats("work").map(|s| (s.ready, s.unacked)),
        Some((1, 1))
    );
    drop(conn);
    let conn = broker.connect();
    let again = conn.fetch("work").now_or_never().unwrap().unwrap().unwrap();
    assert_eq!(
        again.message.body(),
        b"first",
        "back at its place, at the head"
    );
    assert!(again.facts.redelivered);
    conn.settle_now(&again.tag, Settlement::Ack).unwrap();
    let next = conn.fetch("work").now_or_never().unwrap().unwrap().unwrap();
    conn.settle_now(&next.tag, Settlement::Ack).unwrap();
    assert!(
        conn.fetch("work")
            .now_or_never()
            .unwrap()
            .unwrap()
            .is_none()
    );
    // A missing queue is a channel error, as on RabbitMQ.
    let err = conn.fetch("nowhere").now_or_never().unwrap().unwrap_err();
    assert!(err.to_string().contains("nowhere"), "{err}");
}

#[test]
fn ready_wakes_when_a_message_arrives_without_spending_virtual_time() {
    let broker = Broker::new();
    broker
        .declare_queue("isolation", QueueOptions::new())
        .unwrap();
    let conn = broker.connect();
    let woken = Arc::new(AtomicBool::new(false));
    let waker = Waker::from(Arc::new(Flag(woken.clone())));
    let mut cx = Context::from_waker(&waker);
    let mut watch = Box::pin(conn.ready("isolation", Duration::from_secs(5)));
    assert!(watch.as_mut().poll(&mut cx).is_pending());
    assert_eq!(broker.next_deadline(), None, "a watch sets no timer");
    broker
        .publish(Outgoing::to_queue("isolation", b"suspect".to_vec()))
        .unwrap();
    assert!(woken.load(Ordering::SeqCst));
    assert!(matches!(watch.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
    assert_eq!(broker.ready("isolation"), Some(1), "nothing was taken");
}

struct Flag(Arc<AtomicBool>);

impl std::task::Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}
