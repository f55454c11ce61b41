//! Messages a producer the consumer does not control can send, which RabbitMQ 3.10 accepts
//! and delivers, and lapin cannot parse (short strings that are not UTF-8) or would overflow
//! its stack on (headers nested thousands deep): one of them in the middle of 240 good ones,
//! consumed by a `Consumer` on `AmqpTransport` at prefetch 20. The consumer must stay up,
//! handle every good message, and leave the hostile one in the parking queue with its bytes
//! as they came; the benign ones are handled like any other.
//!
//! The messages are written by `test_brokers::rabbitmq::RawPublisher`: lapin cannot write them.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{amqp_url, broker, ready_and_unacked_settled, unique};
use retry_core::{
    Consumer, HandlerError, HeaderValue, Message, RetryPolicy, TopologyPlan, Transport,
};
use test_brokers::authority;
use test_brokers::rabbitmq::{Cleanup, RawProperties, RawPublisher, RawTable};
use transport_amqp091::{AmqpTransport, RAW_PROPERTIES_HEADER, UNDECODABLE_HEADER};

const GOOD: usize = 240;
const HOSTILE_AT: usize = 120;
const HOSTILE_BODY: &[u8] = b"the hostile one";

/// One message, and what must become of it.
struct Case {
    properties: RawProperties,
    /// Sent through a fanout exchange bound to the work queue with this routing key, rather
    /// than through the default exchange.
    routing_key: Option<&'static [u8]>,
    /// Sent to the isolation queue, where the consumer fetches it as a suspect, rather than
    /// to the work queue.
    to_isolation: bool,
    /// Whether it is parked; otherwise it is handled.
    parked: bool,
    /// Bytes its properties hold that the parked copy must still hold.
    kept: Vec<u8>,
}

/// The routing key of the parked copy of a message sent with `routing_key`: a dead-lettered
/// message goes on with the dead-letter routing key, and the broker keeps the one it came
/// with in `x-death`.
fn routing_key_in_death(message: &Message) -> Option<Vec<u8>> {
    let death = message
        .headers()
        .get("x-death")?
        .as_array()?
        .first()?
        .as_table()?;
    match death.get("routing-keys")?.as_array()?.first()? {
        HeaderValue::Bytes(b) => Some(b.clone()),
        HeaderValue::Str(s) => Some(s.as_bytes().to_vec()),
        _ => None,
    }
}

impl Case {
    fn parked(properties: RawProperties, kept: &[u8]) -> Self {
        Case {
            properties,
            routing_key: None,
            to_isolation: false,
            parked: true,
            kept: kept.to_vec(),
        }
    }

    fn handled(properties: RawProperties) -> Self {
        Case {
            properties,
            routing_key: None,
            to_isolation: false,
            parked: false,
            kept: Vec::new(),
        }
    }
}

fn header(name: &[u8], value: &[u8]) -> RawProperties {
    RawProperties::new().headers(&RawTable::new().entry(name, value))
}

/// Publishes 240 good messages with the case's in the middle, runs a consumer until every
/// good one is handled, and checks what became of the case's.
async fn run(name: &str, case: Case) {
    let Some(config) = broker(name).await else {
        return;
    };
    let queue = unique(name);
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new(&queue, &policy).unwrap();
    let _cleanup = Cleanup::new(amqp_url()).with_plan(&plan);
    let transport = Arc::new(AmqpTransport::connect(config.clone()).await.unwrap());
    transport.provision(&plan).await.unwrap();

    let fanout = format!("{queue}.fanout");
    if case.routing_key.is_some() {
        let channel = transport.connection().create_channel().await.unwrap();
        channel
            .exchange_declare(
                fanout.as_str().into(),
                lapin::ExchangeKind::Fanout,
                // Gone with its binding, when the work queue is deleted.
                lapin::options::ExchangeDeclareOptions {
                    auto_delete: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.as_str().into(),
                fanout.as_str().into(),
                "".into(),
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap();
    }
    let raw = case.properties.encode();
    let at = authority(&amqp_url());
    let queue_name = queue.clone();
    let hostile_queue = match case.to_isolation {
        true => plan.isolation_queue().to_owned(),
        false => queue.clone(),
    };
    let fanout_name = fanout.clone();
    let routing_key = case.routing_key;
    tokio::task::spawn_blocking(move || {
        let mut p = RawPublisher::connect(&at, "guest", "guest", "/").unwrap();
        for i in 0..GOOD {
            if i == HOSTILE_AT {
                match routing_key {
                    Some(key) => p.publish(fanout_name.as_bytes(), key, &raw, HOSTILE_BODY),
                    None => p.publish(b"", hostile_queue.as_bytes(), &raw, HOSTILE_BODY),
                }
                .unwrap();
            }
            let good = RawProperties::new().delivery_mode(2).encode();
            p.publish(
                b"",
                queue_name.as_bytes(),
                &good,
                format!("good-{i}").as_bytes(),
            )
            .unwrap();
        }
        p.close().unwrap();
    })
    .await
    .unwrap();

    let handled: Arc<Mutex<HashSet<Vec<u8>>>> = Arc::default();
    let seen = Arc::clone(&handled);
    let handler = move |message: Message| {
        let seen = Arc::clone(&seen);
        async move {
            seen.lock().unwrap().insert(message.body().to_vec());
            Ok::<(), HandlerError>(())
        }
    };
    let consumer = Consumer::builder(Arc::clone(&transport), &queue, policy, handler)
        .with_prefetch(20)
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));

    let all_good =
        |set: &HashSet<Vec<u8>>| (0..GOOD).all(|i| set.contains(format!("good-{i}").as_bytes()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !all_good(&handled.lock().unwrap()) && !running.is_finished() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name}: {} of {GOOD} good messages handled in 60 s",
            handled.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !running.is_finished(),
        "{name}: the consumer ended ({:?}) with {} of {GOOD} good messages handled",
        running.await,
        handled.lock().unwrap().len()
    );
    if !case.parked {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !handled.lock().unwrap().contains(HOSTILE_BODY) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}: the message was not handled"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let _ = stop.send(());
    let report = running.await.unwrap().unwrap();
    assert_eq!(report.receive_errors, 0, "{name}: {report:?}");
    for q in [queue.as_str(), plan.isolation_queue()] {
        assert_eq!(
            ready_and_unacked_settled(q).await,
            (0, 0),
            "{name}: {q} is not empty"
        );
    }

    let parking = plan.parking_queue().to_owned();
    let mut walk = transport.walk(&parking).await.unwrap();
    let mut parked = Vec::new();
    while let Some(delivery) = walk.next().await.unwrap() {
        parked.push(delivery.message);
    }
    walk.end().await.unwrap();
    if !case.parked {
        assert!(parked.is_empty(), "{name}: parked {parked:?}");
        return;
    }
    assert!(
        !handled.lock().unwrap().contains(HOSTILE_BODY),
        "{name}: a handler ran the hostile message"
    );
    let [message] = parked.as_slice() else {
        panic!(
            "{name}: {} messages parked, not 1: {parked:?}",
            parked.len()
        );
    };
    assert_eq!(message.body(), HOSTILE_BODY, "{name}");
    if let Some(key) = case.routing_key {
        // Readable now: the broker routed it on with the dead-letter routing key.
        assert_eq!(
            routing_key_in_death(message).as_deref(),
            Some(key),
            "{name}: {message:?}"
        );
        return;
    }
    let why = message.headers().get(UNDECODABLE_HEADER);
    assert!(why.is_some(), "{name}: not marked undecodable: {message:?}");
    let Some(HeaderValue::Bytes(kept)) = message.headers().get(RAW_PROPERTIES_HEADER) else {
        panic!("{name}: no raw properties: {message:?}");
    };
    assert!(
        kept.windows(case.kept.len()).any(|w| w == case.kept),
        "{name}: the parked properties do not hold the original bytes"
    );
}

fn short_string_case(property: &str) -> Case {
    let value = b"bad-\xff\xfe-value";
    let mut kept = vec![value.len() as u8];
    kept.extend_from_slice(value);
    Case::parked(RawProperties::new().short_string(property, value), &kept)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_that_is_not_utf8_is_parked() {
    run("hostile-message-id", short_string_case("message-id")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_that_cannot_be_read_is_parked_from_the_isolation_queue() {
    let mut case = short_string_case("message-id");
    case.to_isolation = true;
    run("hostile-suspect", case).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_type_that_is_not_utf8_is_parked() {
    run("hostile-content-type", short_string_case("content-type")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_other_short_string_property_that_is_not_utf8_is_parked() {
    for property in [
        "content-encoding",
        "correlation-id",
        "reply-to",
        "type",
        "app-id",
        "cluster-id",
    ] {
        run(&format!("hostile-{property}"), short_string_case(property)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_that_is_not_utf8_is_parked() {
    let case = Case::parked(
        header(b"na\xffme", &RawTable::long_string(b"v")),
        b"na\xffme",
    );
    run("hostile-header-name", case).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routing_key_that_is_not_utf8_is_parked() {
    let mut case = Case::parked(RawProperties::new(), b"");
    case.routing_key = Some(b"key-\xff\xfe");
    run("hostile-routing-key", case).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_nested_2000_deep_are_parked() {
    let deep = RawTable::nested_tables(2_000);
    let kept = deep[deep.len() - 40..].to_vec();
    run(
        "hostile-tables-2000",
        Case::parked(header(b"deep", &deep), &kept),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_nested_15000_deep_are_parked() {
    let deep = RawTable::nested_tables(15_000);
    let kept = deep[deep.len() - 40..].to_vec();
    run(
        "hostile-tables-15000",
        Case::parked(header(b"deep", &deep), &kept),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrays_nested_20000_deep_are_parked() {
    let deep = RawTable::nested_arrays(20_000);
    let kept = deep[deep.len() - 40..].to_vec();
    run(
        "hostile-arrays-20000",
        Case::parked(header(b"deep", &deep), &kept),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_nested_past_the_limit_are_parked() {
    let deep = RawTable::nested_tables(200);
    let kept = deep[deep.len() - 40..].to_vec();
    run(
        "hostile-tables-200",
        Case::parked(header(b"deep", &deep), &kept),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_nested_within_the_limit_are_handled() {
    let case = Case::handled(header(b"deep", &RawTable::nested_tables(60)));
    run("benign-tables-60", case).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_value_that_is_not_utf8_is_handled() {
    let case = Case::handled(header(b"latin1", &RawTable::long_string(b"caf\xe9 \xff")));
    run("benign-header-value", case).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_headers_are_handled() {
    let mut table = RawTable::new();
    for i in 0..5_000 {
        table = table.entry(format!("h{i}").as_bytes(), &RawTable::long_string(b"v"));
    }
    run(
        "benign-5000-headers",
        Case::handled(RawProperties::new().headers(&table)),
    )
    .await;
}
