//! transport-nats' `Admin` against the local NATS server (`NATS_URL`, loopback by default):
//! depths, applying a plan twice, checking it before and after streams are deleted, and
//! `NatsLayout` (no server needed) as the registration hands it out. Without a server each
//! test that needs one says so loudly and passes, unless `REQUIRE_NATS` is set. Every stream
//! has a name of its own, deleted at the end.

use std::time::Duration;

use async_nats::jetstream::stream::{Config as StreamConfig, RetentionPolicy};
use retry_core::{
    Admin, Applied, Cascade, Checked, ConnectOptions, DelayStrategy, Depth, Layout, PlanError,
    PlanOption, PlanOptions, QueueType, Registry, RetryPolicy, TopologyPlan, Transport,
    TransportError,
};
use test_brokers::nats_url;
use transport_nats::testing;
use transport_nats::{NatsLayout, NatsTransport, stream_name};

fn unique(what: &str) -> String {
    test_brokers::unique(&format!("tn-admin-{what}"))
}

async fn connect() -> Option<NatsTransport> {
    testing::connect_or_skip(
        "transport-nats' Admin tests",
        testing::test_config(&nats_url()),
    )
    .await
}

/// Two delays and the default crash delay: six streams, five consumers.
fn plan(queue: &str) -> TopologyPlan {
    let policy = RetryPolicy::delays([Duration::from_millis(500), Duration::from_secs(30)])
        .build()
        .expect("a policy");
    TopologyPlan::new(queue, &policy).expect("a plan")
}

fn js(t: &NatsTransport) -> async_nats::jetstream::Context {
    async_nats::jetstream::new(t.client().clone())
}

#[tokio::test]
async fn depth_is_missing_without_the_stream_then_counts_what_it_stores() {
    let Some(t) = connect().await else { return };
    let queue = unique("depth");
    let plan = plan(&queue);
    assert_eq!(t.depth(&queue).await.expect("depth"), Depth::Missing);
    t.apply(&plan).await.expect("apply");
    assert_eq!(t.depth(&queue).await.expect("depth"), Depth::Ready(0));
    for id in ["m-1", "m-2"] {
        test_brokers::nats::publish(t.client(), &queue, id, "body", &[]).await;
    }
    test_brokers::nats::publish(t.client(), plan.parking_queue(), "p-1", "parked", &[]).await;
    assert_eq!(t.depth(&queue).await.expect("depth"), Depth::Ready(2));
    assert_eq!(
        t.depth(plan.parking_queue()).await.expect("depth"),
        Depth::Ready(1),
        "a parking stream (no consumer) is counted too"
    );
    testing::delete_plan(t.client(), &plan).await;
    t.close().await;
}

#[tokio::test]
async fn apply_creates_every_stream_and_consumer_then_verifies_them() {
    let Some(t) = connect().await else { return };
    let queue = unique("apply");
    let plan = plan(&queue);
    let first = t.apply(&plan).await.expect("apply");
    let objects: Vec<&str> = first.iter().map(|o| o.object.as_str()).collect();
    let work = stream_name(&queue);
    assert_eq!(objects.len(), 11, "{objects:?}");
    assert_eq!(objects[0], format!("stream {work} (queue {queue})"));
    assert_eq!(
        objects[1],
        format!("consumer retry-engine on stream {work}")
    );
    assert_eq!(
        objects[10],
        format!(
            "stream {} (queue {})",
            stream_name(plan.parking_queue()),
            plan.parking_queue()
        )
    );
    assert!(
        first.iter().all(|o| o.applied == Applied::Created),
        "{first:?}"
    );
    let again = t.apply(&plan).await.expect("apply again");
    assert_eq!(
        again.iter().map(|o| o.object.as_str()).collect::<Vec<_>>(),
        objects
    );
    assert!(
        again.iter().all(|o| o.applied == Applied::Verified),
        "{again:?}"
    );
    // A consumer deleted alone is created again; its stream is verified.
    js(&t)
        .get_stream(&work)
        .await
        .expect("the work stream")
        .delete_consumer("retry-engine")
        .await
        .expect("delete the consumer");
    let third = t.apply(&plan).await.expect("apply a third time");
    let created: Vec<&str> = third
        .iter()
        .filter(|o| o.applied == Applied::Created)
        .map(|o| o.object.as_str())
        .collect();
    assert_eq!(created, [objects[1]], "{third:?}");
    testing::delete_plan(t.client(), &plan).await;
    t.close().await;
}

#[tokio::test]
async fn check_finds_every_object_after_apply_and_names_what_was_deleted() {
    let Some(t) = connect().await else { return };
    let queue = unique("check");
    let plan = plan(&queue);
    t.apply(&plan).await.expect("apply");
    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), 0, "{report:?}");
    assert_eq!(report.objects.len(), 11, "{report:?}");
    assert_eq!(
        report.scope.as_deref(),
        Some(
            "over NATS JetStream: that every stream and consumer exists with the plan's settings \
             (nothing is probed: the server holds the delays itself)"
        )
    );
    assert!(
        report
            .objects
            .iter()
            .all(|o| o.checked == Checked::Ok(String::new())),
        "{report:?}"
    );
    let streams: Vec<&str> = report
        .objects
        .iter()
        .filter_map(|o| o.queue.as_deref())
        .collect();
    let queues: Vec<&str> = plan.queues().iter().map(|q| q.name.as_str()).collect();
    assert_eq!(streams, queues, "each stream holds its queue");

    // A delay stream deleted: it is missing, its consumer with it.
    let slow = format!("{queue}.retry.30s");
    assert!(
        js(&t)
            .delete_stream(stream_name(&slow))
            .await
            .expect("delete")
            .success
    );
    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), 2, "{report:?}");
    assert!(report.is_missing(&slow), "{report:?}");
    assert!(!report.is_missing(&queue), "{report:?}");
    let stream = stream_name(&slow);
    let failed: Vec<(&str, &Checked)> = report
        .objects
        .iter()
        .filter(|o| o.is_problem())
        .map(|o| (o.object.as_str(), &o.checked))
        .collect();
    assert_eq!(
        failed,
        [
            (
                format!("stream {stream} (queue {slow})").as_str(),
                &Checked::Missing
            ),
            (
                format!("consumer retry-engine on stream {stream}").as_str(),
                &Checked::Failed("missing, with its stream".into())
            ),
        ]
    );

    // The work stream deleted too: a tool tells a wrong name by it.
    assert!(
        js(&t)
            .delete_stream(stream_name(&queue))
            .await
            .expect("delete")
            .success
    );
    let report = t.check(&plan, &PlanOptions::new()).await.expect("check");
    assert_eq!(report.problems(), 4, "{report:?}");
    assert!(report.is_missing(&queue), "{report:?}");
    testing::delete_plan(t.client(), &plan).await;
    t.close().await;
}

#[tokio::test]
async fn a_stream_with_other_settings_is_a_conflict_for_apply_and_check() {
    let Some(t) = connect().await else { return };
    let queue = unique("conflict");
    let plan = plan(&queue);
    js(&t)
        .create_stream(StreamConfig {
            name: stream_name(&queue),
            subjects: vec![queue.clone()],
            retention: RetentionPolicy::Limits,
            ..Default::default()
        })
        .await
        .expect("the other stream");
    for err in [
        t.apply(&plan).await.expect_err("apply: a conflict"),
        t.check(&plan, &PlanOptions::new())
            .await
            .expect_err("check: a conflict"),
    ] {
        match &err {
            TransportError::TopologyConflict {
                object, argument, ..
            } => {
                assert_eq!(object, &format!("stream {}", stream_name(&queue)));
                assert_eq!(argument, "retention");
            }
            other => panic!("not a conflict: {other:?}"),
        }
    }
    testing::delete_plan(t.client(), &plan).await;
    t.close().await;
}

#[tokio::test]
async fn the_streams_replicas_are_the_transports_configuration() {
    let Some(t) = connect().await else { return };
    let queue = unique("replicas");
    let plan = plan(&queue);
    t.apply(&plan).await.expect("apply, one replica");
    let config = testing::test_config(&nats_url()).with_replicas(2);
    let two = NatsTransport::connect(config).await.expect("connect");
    match two.check(&plan, &PlanOptions::new()).await {
        Err(TransportError::TopologyConflict {
            argument,
            existing,
            wanted,
            ..
        }) => assert_eq!(
            (argument.as_str(), existing.as_str(), wanted.as_str()),
            ("num_replicas", "1", "2")
        ),
        other => panic!("not a conflict on num_replicas: {other:?}"),
    }
    two.close().await;
    testing::delete_plan(t.client(), &plan).await;
    t.close().await;
}

#[tokio::test]
async fn a_cascade_is_refused_before_anything_is_created() {
    let Some(t) = connect().await else { return };
    let queue = unique("cascade");
    let cascade = TopologyPlan::builder(&queue, &RetryPolicy::default())
        .with_strategy(DelayStrategy::Cascade(Cascade::new()))
        .build()
        .expect("a cascade plan");
    let applied = t.apply(&cascade).await.expect_err("apply");
    let checked = t
        .check(&cascade, &PlanOptions::new())
        .await
        .expect_err("check");
    for err in [applied, checked] {
        assert!(
            matches!(&err, TransportError::Unsupported { what, .. } if what.contains("cascade")),
            "{err:?}"
        );
    }
    assert_eq!(t.depth(&queue).await.expect("depth"), Depth::Missing);
    t.close().await;
}

/// What `retryctl` gets: the registry's transport keeps `Admin`, and closes.
#[tokio::test]
async fn the_registrations_transport_administers_and_closes() {
    if connect().await.is_none() {
        return;
    }
    let registry = Registry::new().with(transport_nats::registration());
    let transport = registry
        .connect_with(&nats_url(), ConnectOptions::new())
        .await
        .expect("connect");
    assert!(transport.has_admin());
    let queue = unique("registry");
    let plan = plan(&queue);
    assert_eq!(
        transport.depth(&queue).await.expect("depth"),
        Depth::Missing
    );
    let applied = transport.apply(&plan).await.expect("apply");
    assert_eq!(applied.len(), 11);
    let report = transport
        .check(&plan, &PlanOptions::new())
        .await
        .expect("check");
    assert_eq!(report.problems(), 0, "{report:?}");
    let nats = transport
        .downcast_ref::<NatsTransport>()
        .expect("a NatsTransport inside");
    testing::delete_plan(nats.client(), &plan).await;
    // `Transport::close` is the transport's own: it ends the connection.
    tokio::time::timeout(Duration::from_secs(10), Transport::close(&transport))
        .await
        .expect("close returns");
    // async-nats ends the connection on its own task, a moment after `close` returns.
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        while transport.depth(&queue).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "a closed transport still answers");
}

#[test]
fn the_registrations_layout_refuses_what_has_no_meaning_on_nats() {
    let registration = transport_nats::registration();
    let layout = registration.layout();
    let policy = RetryPolicy::default();
    let url = "nats://127.0.0.1:1";
    let refusal = |options: PlanOptions| {
        layout
            .plan(url, "comments", &policy, &options)
            .expect_err("refused")
    };
    let quorum = refusal(PlanOptions::new().with_queue_type(QueueType::Quorum));
    assert!(
        matches!(
            &quorum,
            PlanError::Unsupported { option: PlanOption::Quorum, transport, .. }
                if transport == "NATS JetStream"
        ),
        "{quorum:?}"
    );
    assert!(
        quorum
            .to_string()
            .ends_with("queue types are RabbitMQ's, and every queue is a stream; a replication factor of N keeps each stream on N servers"),
        "{quorum}"
    );
    let seven = refusal(PlanOptions::new().with_replication_factor(7));
    assert!(
        matches!(
            &seven,
            PlanError::OutOfRange { option: PlanOption::ReplicationFactor, value, why, .. }
                if value == "7" && why == "a NATS JetStream stream has 1 to 5 replicas"
        ),
        "{seven:?}"
    );
    let ttl = refusal(PlanOptions::new().with_max_probe_ttl(Duration::from_secs(2)));
    assert!(
        matches!(
            &ttl,
            PlanError::Unsupported { option: PlanOption::MaxProbeTtl, why, .. }
                if why == "nothing is probed, as the server holds every delayed copy itself (no queue TTL or dead-lettering routes it); the check looks at the streams and consumers"
        ),
        "{ttl:?}"
    );
    let bad = layout
        .plan(url, "orders.*", &policy, &PlanOptions::new())
        .expect_err("a wildcard");
    assert!(matches!(bad, PlanError::BadName { .. }), "{bad:?}");
}

#[test]
fn the_registrations_layout_shows_streams_and_asks_for_replicas() {
    let registration = transport_nats::registration();
    let layout = registration.layout();
    let policy = RetryPolicy::delays([
        Duration::from_millis(500),
        Duration::from_secs(2),
        Duration::from_secs(5),
    ])
    .build()
    .expect("a policy");
    let options = PlanOptions::new().with_replication_factor(3);
    let plan = layout
        .plan("nats://127.0.0.1:1", "comments", &policy, &options)
        .expect("a plan");
    assert_eq!(plan.queue_type(), QueueType::Classic);
    let view = layout.view(&plan, &options).expect("a view of its own");
    assert!(
        view.text.starts_with(
            "plan for work queue `comments` on NATS JetStream (7 streams, 3 replicas each)\n"
        ),
        "{}",
        view.text
    );
    assert!(
        view.text.contains(
            "  comments_retry_500ms  (subject comments.retry.500ms; delay queue, 500ms; due \
             copies go to comments)\n"
        ),
        "{}",
        view.text
    );
    let json: serde_json::Value = serde_json::from_str(&view.json).expect("JSON");
    assert_eq!(json["protocol"], "nats");
    assert_eq!(json["replicas"], 3);
    assert_eq!(json["streams"][6]["name"], "comments_parking", "{json:#}");
    assert_eq!(json["streams"][6]["retention"], "limits", "{json:#}");
    assert_eq!(json["streams"][6]["consumer"], serde_json::Value::Null);
    assert_eq!(
        layout.settings(&options),
        [("replicas".to_owned(), "3".to_owned())]
    );
    assert_eq!(
        NatsLayout.view(&plan, &PlanOptions::new()).unwrap().text,
        view.text.replace("3 replicas each", "1 replica each")
    );
}
