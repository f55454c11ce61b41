//! transport-amqp10's `Admin` against the local RabbitMQ 3.x: a check of a plan declared over
//! AMQP 0-9-1 (as a deployment does) finds every object, then names the ones deleted; apply
//! is refused, saying how to apply instead; a message published over AMQP 0-9-1 reads as
//! hiding its headers, one published over AMQP 1.0 does not. Without a broker each test
//! says so loudly and passes, unless `REQUIRE_BROKER` is set. The topology of each test has
//! names of its own, deleted afterwards.

mod common;

use std::time::Duration;

use fe2o3_amqp::types::messaging::{ApplicationProperties, Body, Message as AmqpMessage};
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::{Connection, Sender, Session};
use lapin::BasicProperties;
use lapin::options::QueueDeleteOptions;
use lapin::types::{AMQPValue, FieldTable};
use retry_core::{
    Admin, Cascade, Checked, ConnectOptions, DelayStrategy, Depth, PlanOptions, QueueRole,
    Registry, RetryPolicy, TopologyPlan, Transport, TransportError,
};

use common::{amqp10_url, broker, transport, unique};

/// Two delay queues and the default crash delay.
fn plan(queue: &str) -> TopologyPlan {
    let policy = RetryPolicy::delays([Duration::from_millis(500), Duration::from_secs(30)])
        .build()
        .expect("a policy");
    TopologyPlan::new(queue, &policy).expect("a plan")
}

/// The plan's objects as the check names them: every exchange, then every queue.
fn objects(plan: &TopologyPlan) -> Vec<String> {
    plan.exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)))
        .collect()
}

#[tokio::test]
async fn check_finds_every_object_then_names_a_missing_queue() {
    let Some(b) = broker().await else { return };
    let queue = unique("admin-check");
    let plan = plan(&queue);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let t = transport().await;

    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), 0, "{report:?}");
    assert_eq!(
        report
            .objects
            .iter()
            .map(|o| o.object.clone())
            .collect::<Vec<_>>(),
        objects(&plan)
    );
    assert!(
        report
            .objects
            .iter()
            .all(|o| o.checked == Checked::Ok(String::new())),
        "{report:?}"
    );
    assert_eq!(
        report.scope.as_deref(),
        Some(
            "over AMQP 1.0: that every object exists (the probes through the delay queues need \
             AMQP 0-9-1)"
        )
    );
    let held: Vec<&str> = report
        .objects
        .iter()
        .filter_map(|o| o.queue.as_deref())
        .collect();
    let queues: Vec<&str> = plan.queues().iter().map(|q| q.name.as_str()).collect();
    assert_eq!(held, queues, "each queue is named as the plan's");
    // Nothing was sent: no probe waits in a delay queue.
    for q in &queues {
        assert_eq!(b.ready(q).await, 0, "{q}");
    }

    // One delay queue deleted: missing, the only problem.
    let slow = format!("{queue}.retry.30s");
    b.channel
        .queue_delete(slow.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete");
    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), 1, "{report:?}");
    assert!(report.is_missing(&slow), "{report:?}");
    assert!(!report.is_missing(&queue), "{report:?}");
    let problem = report
        .objects
        .iter()
        .find(|o| o.is_problem())
        .expect("a problem");
    assert_eq!(
        (problem.object.as_str(), &problem.checked),
        (format!("queue {slow}").as_str(), &Checked::Missing)
    );

    // The work queue deleted too: a tool tells a wrong name by it.
    b.channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete");
    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), 2, "{report:?}");
    assert!(report.is_missing(&queue), "{report:?}");
    t.close().await;
}

#[tokio::test]
async fn depth_is_unknown_and_apply_says_to_apply_over_amqp091() {
    let Some(_b) = broker().await else { return };
    let queue = unique("admin-apply");
    let plan = plan(&queue);
    let t = transport().await;
    assert_eq!(t.depth(&queue).await.expect("depth"), Depth::Unknown);
    match t.apply(&plan).await {
        Err(TransportError::Unsupported { what, why }) => {
            assert_eq!(what, "creating queues over AMQP 1.0");
            assert_eq!(
                why,
                "RabbitMQ cannot declare queues over AMQP 1.0: apply the topology over AMQP \
                 0-9-1 (protocol amqp091, the broker's amqp:// URL on port 5672), then check it \
                 over AMQP 1.0"
            );
        }
        other => panic!("not refused: {other:?}"),
    }
    // Nothing was declared: every object is missing.
    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), report.objects.len(), "{report:?}");
    assert!(report.is_missing(&queue), "{report:?}");
    let cascade = TopologyPlan::builder(&queue, &RetryPolicy::default())
        .with_strategy(DelayStrategy::Cascade(Cascade::new()))
        .build()
        .expect("a cascade plan");
    let refused = t
        .check(&cascade, &PlanOptions::new())
        .await
        .expect_err("a cascade");
    assert!(
        matches!(&refused, TransportError::Unsupported { what, .. } if what.contains("cascade")),
        "{refused:?}"
    );
    t.close().await;
}

/// Sends one message to `queue` over AMQP 1.0 with `tenant` as an application property.
async fn publish10(queue: &str, tenant: &str) {
    let mut connection = Connection::open("admin-test", amqp10_url().as_str())
        .await
        .expect("AMQP 1.0 connection");
    let mut session = Session::begin(&mut connection).await.expect("session");
    let mut sender = Sender::attach(&mut session, "producer", format!("/amq/queue/{queue}"))
        .await
        .expect("sender");
    let message = AmqpMessage::builder()
        .application_properties(
            ApplicationProperties::builder()
                .insert("tenant", tenant.to_owned())
                .build(),
        )
        .body(Body::Value(fe2o3_amqp::types::messaging::AmqpValue(
            Value::String("over 1.0".into()),
        )))
        .build();
    let outcome = sender.send(message).await.expect("send");
    assert!(outcome.is_accepted(), "{outcome:?}");
    let _ = sender.detach().await;
    let _ = session.end().await;
    let _ = connection.close().await;
}

#[tokio::test]
async fn a_message_published_over_amqp091_hides_its_headers_over_amqp10() {
    let Some(b) = broker().await else { return };
    let queue = unique("admin-hidden");
    let plan = plan(&queue);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let parking = plan.parking_queue();
    let mut headers = FieldTable::default();
    headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    b.publish(
        parking,
        b"over 0-9-1",
        BasicProperties::default().with_headers(headers),
    )
    .await;
    publish10(parking, "acme").await;

    let t = transport().await;
    assert!(t.may_hide_headers());
    let mut walk = t.walk(parking).await.expect("walk");
    let mut read = Vec::new();
    while let Some(delivery) = walk.next().await.expect("next") {
        read.push(t.hidden_headers(&delivery.message));
        walk.leave(delivery.tag);
    }
    walk.end().await.expect("end");
    drop(walk);
    assert_eq!(read.len(), 2, "{read:?}");
    let why = read[0]
        .as_deref()
        .expect("the AMQP 0-9-1 message hides them");
    assert!(
        why.starts_with("show no headers over AMQP 1.0, as RabbitMQ 3.x shows"),
        "{why}"
    );
    assert!(why.ends_with("(protocol amqp091)"), "{why}");
    assert_eq!(read[1], None, "the AMQP 1.0 message shows its headers");
    assert_eq!(b.ready(parking).await, 2, "the walk left both");
    t.close().await;
}

/// What `retryctl` gets: the registry's transport keeps `Admin`, and closes.
#[tokio::test]
async fn the_registrations_transport_checks_and_closes() {
    let Some(b) = broker().await else { return };
    let queue = unique("admin-registry");
    let plan = plan(&queue);
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let registry = Registry::new().with(transport_amqp10::registration());
    let t = registry
        .connect_with(&amqp10_url(), ConnectOptions::new().with_protocol("amqp10"))
        .await
        .expect("connect");
    assert!(t.has_admin());
    assert!(t.may_hide_headers());
    let delay = plan
        .queues()
        .iter()
        .find(|q| matches!(q.role, QueueRole::Delay { .. }))
        .expect("a delay queue");
    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), 0, "{report:?}");
    assert!(!report.is_missing(&delay.name));
    tokio::time::timeout(Duration::from_secs(10), Transport::close(&t))
        .await
        .expect("close returns");
    // The transport's own close: a walk (on links of its own) is refused from then on.
    let walk = t.walk(plan.parking_queue()).await;
    assert!(
        matches!(walk, Err(TransportError::Closed)),
        "a walk after close: {:?}",
        walk.map(|_| "opened")
    );
}
