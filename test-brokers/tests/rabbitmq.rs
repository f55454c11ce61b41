//! The `rabbitmq` helpers on the local broker (`AMQP_URL`): the side connection, a plan's
//! queue redeclared to refuse, and the cleanup guard deleting a plan with its cascade.
//! Without a broker these tests skip loudly, and with `REQUIRE_BROKER=1` they fail.

#![cfg(feature = "rabbitmq")]

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind as LapinKind};
use retry_proto::{Cascade, DelayStrategy, ExchangeKind, RetryPolicy, TopologyPlan};
use test_brokers::rabbitmq::{self, Cleanup};
use test_brokers::{amqp_url, unique};

/// A durable queue of its own (deleted when the guard drops) and a side channel, or `None`
/// after the skip policy when no broker answers.
async fn queue_of_its_own(
    what: &str,
    prefix: &str,
) -> Option<(String, Cleanup, Connection, Channel)> {
    if let Err(why) = rabbitmq::probe(&amqp_url()).await {
        test_brokers::no_broker(what, &why);
        return None;
    }
    let queue = unique(prefix);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.queue(&queue);
    let (connection, ch) = rabbitmq::raw().await;
    rabbitmq::declare_durable(&ch, &queue, FieldTable::default()).await;
    Some((queue, cleanup, connection, ch))
}

#[tokio::test]
async fn the_side_connection_publishes_counts_and_takes() {
    let Some((queue, _cleanup, _connection, ch)) =
        queue_of_its_own("test-brokers' side connection", "tb-side").await
    else {
        return;
    };
    rabbitmq::publish(&ch, &queue, b"one", "m-1").await;
    let headers = rabbitmq::table([("tenant", AMQPValue::LongString("acme".into()))]);
    let properties = BasicProperties::default().with_headers(headers);
    rabbitmq::publish_with(&ch, &queue, b"two", properties).await;

    let within = Duration::from_secs(5);
    assert_eq!(
        rabbitmq::wait_for_count(&ch, &queue, 2, within)
            .await
            .unwrap(),
        2
    );
    assert_eq!(rabbitmq::ready_and_unacked(&queue).await, (2, 0));
    let listed = rabbitmq::list_queues(&queue).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["durable"], true, "{listed:?}");

    let first = rabbitmq::get(&ch, &queue).await.expect("the first message");
    assert_eq!(first.data, b"one");
    assert_eq!(
        first.properties.message_id().as_ref().unwrap().as_str(),
        "m-1"
    );
    let second = rabbitmq::wait_get(&ch, &queue, within)
        .await
        .expect("the second");
    let tenant = second
        .properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .get("tenant")
        .cloned();
    assert_eq!(tenant, Some(AMQPValue::LongString("acme".into())));
    assert!(rabbitmq::get(&ch, &queue).await.is_none());
    assert_eq!(rabbitmq::message_count(&ch, &queue).await.unwrap(), 0);
}

#[tokio::test]
async fn a_raw_publisher_publishes_what_lapin_cannot_write() {
    let Some((queue, _cleanup, _connection, _ch)) =
        queue_of_its_own("test-brokers' raw publisher", "tb-raw").await
    else {
        return;
    };
    let at = test_brokers::authority(&amqp_url());
    let properties = rabbitmq::RawProperties::new()
        .message_id(b"bad-\xff-id")
        .delivery_mode(2);
    let sent = queue.clone();
    tokio::task::spawn_blocking(move || {
        let mut publisher = rabbitmq::RawPublisher::connect(&at, "guest", "guest", "/")?;
        publisher.publish(b"", sent.as_bytes(), &properties.encode(), b"raw")?;
        publisher.close()
    })
    .await
    .unwrap()
    .expect("published and confirmed");
    assert_eq!(rabbitmq::ready_and_unacked(&queue).await, (1, 0));
}

/// Declares `plan` and its cascade by hand (exchanges, then queues with their bindings
/// through `redeclare`), as a transport would provision them.
async fn declare(ch: &Channel, plan: &TopologyPlan) {
    let cascade = plan.cascade().expect("a cascade");
    for exchange in plan.exchanges().iter().chain(cascade.exchanges()) {
        let kind = match exchange.kind {
            ExchangeKind::Direct => LapinKind::Direct,
            ExchangeKind::Fanout => LapinKind::Fanout,
            ExchangeKind::Topic => LapinKind::Topic,
        };
        let options = ExchangeDeclareOptions {
            durable: exchange.durable,
            ..ExchangeDeclareOptions::default()
        };
        ch.exchange_declare(
            exchange.name.as_str().into(),
            kind,
            options,
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    for queue in plan.queues() {
        rabbitmq::redeclare(ch, plan, &queue.name, |args| args)
            .await
            .unwrap();
    }
    for queue in cascade.queues() {
        let options = QueueDeclareOptions {
            durable: queue.durable,
            ..QueueDeclareOptions::default()
        };
        ch.queue_declare(queue.name.as_str().into(), options, FieldTable::default())
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_redeclared_queue_refuses_and_the_cleanup_takes_plan_and_cascade() {
    if let Err(why) = rabbitmq::probe(&amqp_url()).await {
        test_brokers::no_broker("test-brokers' topology helpers", &why);
        return;
    }
    let queue = unique("tb-plan");
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .unwrap();
    let cascade = Cascade::new().with_prefix(format!("{queue}.cascade"));
    let plan = TopologyPlan::builder(&queue, &policy)
        .with_strategy(DelayStrategy::Cascade(cascade))
        .build()
        .unwrap();
    let (_connection, ch) = rabbitmq::raw().await;
    let cleanup = Cleanup::new(amqp_url()).with_plan(&plan);
    declare(&ch, &plan).await;
    let declared = rabbitmq::list_queues(&queue).await;
    let expected = plan.queues().len() + plan.cascade().unwrap().queues().len();
    assert_eq!(declared.len(), expected, "{declared:?}");
    assert!(!rabbitmq::list_bindings(&queue).await.is_empty());

    rabbitmq::redeclare(&ch, &plan, &queue, rabbitmq::refusing)
        .await
        .unwrap();
    let confirm = ch
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            Default::default(),
            b"refused",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_nack(), "{confirm:?}");

    drop(cleanup);
    assert_eq!(
        rabbitmq::list_queues(&queue).await,
        Vec::<serde_json::Value>::new()
    );
    let exchanges = rabbitmq::rabbitmqctl(&["list_exchanges", "-q", "name"]);
    assert!(!exchanges.contains(&queue), "{exchanges}");
}
